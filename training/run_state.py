"""A training run's state between steps: its setup, its resume from a checkpoint, and its checkpoints.

:func:`open_run` builds everything :func:`training.trainer.rl_train` holds across steps, in a fixed order
(the order the random streams are drawn in: LoRA's and the value head's initialisations): the KL reference
(the initial policy, saved once per fresh start), the policy (gradient checkpointing, LoRA), the rollout copy
under torchrun, PPO's critic, the FSDP2-sharded forward, the optimizers and the learning-rate schedule, the
question stream, the health alarms; on a resume it restores all of them from the latest complete
checkpoint. :func:`save_run` writes an atomic checkpoint of the same state (the full weights, the full
optimizer state, every rank's RNG states), so ``k`` steps + resume + ``N - k`` steps equals ``N`` steps, and
the settings the policy is trained with (the run directory's ``sleuth_settings.json``, which the command that
starts the run writes: :func:`training.infra.checkpoint.write_settings`), so that every checkpoint knows them.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from corpora.formats import QAExample
from training.algos.estimators import ADV_ESTIMATORS
from training.infra.checkpoint import (
    best_source,
    commit_directory,
    latest_checkpoint,
    load_optimizer_state,
    load_pretrained_weights,
    load_trainer_state,
    read_extra,
    read_settings,
    remove_unfinished,
    restore_rng,
    rng_state,
    save_best,
    save_checkpoint,
    write_settings,
)
from training.infra.distributed import (
    all_reduce_min,
    full_optimizer_state,
    full_state_dict,
    gather_objects,
    load_full_optimizer_state,
    run_on_rank0,
)
from training.infra.monitors import Alarms
from training.model.critic import ValueModel
from training.model.forward import LogprobModule
from training.model.fsdp import shard, shard_value_model
from training.model.lora import MergedView, apply_lora, base_model, lora_state
from training.rollout.worker import DataStream


@dataclass
class RunState:
    """Everything a run holds between steps. ``policy`` is the model being trained (peft-wrapped with LoRA),
    ``fwd`` its :class:`training.model.forward.LogprobModule` (FSDP2-sharded under torchrun),
    ``rollout_model`` the full copy the rollout side runs under torchrun (``None`` on one process: the policy
    itself), ``base_state`` LoRA's frozen base weights (written into every checkpoint); ``start`` is the first
    step to run, ``best``/``best_step`` the best held-out EM so far, ``nonfinite`` the steps skipped for a
    non-finite loss; ``resumed`` the trainer state of the checkpoint resumed (``None``: a fresh start);
    ``frontier`` the stream position a checkpoint saves when the asynchronous rollouts read ahead of the
    training (:meth:`training.rollout.producer.AsyncRollouts.frontier`; ``None``: ``data.position``);
    ``settings`` the run directory's training settings, copied into every checkpoint (``None``: it has none);
    ``fleet`` the :class:`training.rollout.fleet_run.FleetSide` in fleet mode (``train.rollout.engines``)."""

    run_dir: Path
    rank: int
    world_size: int
    ckpt: Path | None
    policy: Any
    fwd: LogprobModule
    rollout_model: Any | None
    ref_model: Any | None
    critic: Any | None
    optimizer: Any
    scheduler: Any
    critic_optimizer: Any | None
    data: DataStream
    alarms: Alarms
    base_state: dict[str, torch.Tensor] | None = None
    start: int = 0
    best: float | None = None
    best_step: int | None = None
    nonfinite: int = 0
    resumed: dict[str, Any] | None = field(default=None, repr=False)
    frontier: Callable[[], int] | None = field(default=None, repr=False)
    settings: dict[str, Any] | None = field(default=None, repr=False)
    fleet: Any | None = field(default=None, repr=False)

    @property
    def gen_model(self) -> Any:
        """The full model the rollout side generates with (the policy itself on one process)."""
        return self.rollout_model if self.rollout_model is not None else self.policy

    @property
    def device(self) -> torch.device:
        return next(self.fwd.parameters()).device


def check_resumable(ckpt: Path, tc: Any) -> None:
    """Raise ``ValueError`` when checkpoint ``ckpt`` was written by another ``train.algorithm.adv_estimator``
    (GRPO weights resumed as PPO would start a fresh critic without a word) or with another
    ``train.optim.lora`` (its optimizer state is the adapters' or the full model's; checkpoints before that
    field tell by their files)."""
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    name = tc.algorithm.adv_estimator
    algo = saved.get("algorithm", name)
    if algo != name:
        raise ValueError(f"{ckpt} was written by train.algorithm.adv_estimator={algo}, not {name}: resume it "
                         f"with train.algorithm.adv_estimator={algo}, or start a new run in another run directory")
    lora = saved.get("lora")
    if lora is None:
        lora = (ckpt / "base").is_dir() or "lora" in read_extra(ckpt)
    if lora != tc.optim.lora:
        raise ValueError(f"{ckpt} was written with train.optim.lora={str(lora).lower()}: resume it with "
                         f"train.optim.lora={str(lora).lower()}, or start a new run in another run directory")


def reference_model(model: Any, run_dir: Path, ckpt: Path | None, rank: int) -> Any:
    """The frozen KL reference: the initial policy, saved by every fresh start in ``run_dir/reference`` (a
    reference left by an earlier run that died before its first checkpoint may be of another model), and
    loaded from there on a resume (``train.algorithm.kl_coef`` turned on at a resume: the resumed checkpoint stands in,
    with a warning)."""
    ref_dir = run_dir / "reference"
    ref = copy.deepcopy(model).eval()
    if ckpt is not None and (ref_dir / "config.json").exists():
        load_pretrained_weights(ref, ref_dir)  # one file or shards
    elif rank == 0:
        if ckpt is not None:
            warnings.warn(f"{ref_dir} is missing: the KL reference is the resumed checkpoint {ckpt.name}, not "
                          "the run's initial policy", stacklevel=3)
        tmp = run_dir / ".reference.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        ref.save_pretrained(tmp)
        commit_directory(tmp, ref_dir)  # flushed: a power loss leaves no empty weight files behind
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def prepare_policy(model: Any, tc: Any, ckpt: Path | None, saved: dict[str, Any]) -> tuple[Any, dict | None]:
    """``model`` with gradient checkpointing and LoRA as ``tc`` asks (the checkpoint's frozen base weights and
    adapters loaded on a resume); returns ``(policy, LoRA base weights or None)``."""
    if tc.optim.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if not tc.optim.lora:
        return model, None
    if ckpt is not None and (ckpt / "base" / "model.safetensors").exists():
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(ckpt / "base" / "model.safetensors")), strict=False)
    base_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    policy = apply_lora(model, tc)
    if "lora" in saved:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy, saved["lora"])
    return policy, base_state


def open_run(tc: Any, model: Any, run_dir: str | Path, train_examples: list[QAExample], *, seed: int,
             resume: bool, rank: int, world_size: int) -> RunState:
    """Set the run up (see the module docstring), resuming the latest complete checkpoint of ``run_dir`` when
    ``resume`` (the model weights must already be loaded from it by the caller). Seeds torch and ``random``
    with ``seed`` first. Raises ``ValueError`` for a checkpoint of another algorithm or LoRA setting, or when
    the ranks see different latest checkpoints (a run directory not shared by every rank)."""
    run_dir, W = Path(run_dir), world_size
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # the temporary copies of checkpoint writes killed midway (gigabytes each)
        remove_unfinished(run_dir)
    torch.manual_seed(seed)
    random.seed(seed)
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        check_resumable(ckpt, tc)
    if W > 1:  # every rank must resume the same step (and load the same weights): a shared run directory
        seen = gather_objects(ckpt.name if ckpt is not None else None)
        if len(set(seen)) > 1:
            raise ValueError(f"the ranks see different latest checkpoints of {run_dir} (by rank: {seen}); the run "
                             "directory must be on a file system every rank sees")
    alg, opt = tc.algorithm, tc.optim
    ref = reference_model(model, run_dir, ckpt, rank) if alg.kl_coef > 0 else None
    critic_needed = ADV_ESTIMATORS.get(alg.adv_estimator).critic
    # the checkpoint's LoRA adapters and critic, read once and loaded before sharding (plain tensors)
    saved = read_extra(ckpt) if ckpt is not None and (opt.lora or critic_needed) else {}
    policy, base_state = prepare_policy(model, tc, ckpt, saved)
    # rollout side: the same object on one process; a full copy (LoRA wrapper included) when the update side
    # is sharded, refreshed from the gathered full weights after every update
    # (in fleet mode the engines generate: rank 0 alone keeps a copy, for checkpoints and evaluation)
    rollout_model = copy.deepcopy(policy) if W > 1 and (rank == 0 or not tc.rollout.fleet) else None
    critic = None
    if critic_needed:  # from the full policy, before it is sharded; then sharded on its own
        critic = ValueModel(base_model(policy), shared=alg.critic == "shared")
        if "critic" in saved:
            critic.load_state_dict(saved["critic"])
        if W > 1:
            shard_value_model(critic)
    fwd = LogprobModule(policy)
    if W > 1:
        shard(fwd, mixed_precision=opt.bf16 and torch.cuda.is_available())
    optimizer = torch.optim.AdamW([p for p in fwd.parameters() if p.requires_grad], lr=opt.lr,
                                  weight_decay=opt.weight_decay)
    warmup = opt.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    critic_opt = torch.optim.AdamW(critic.trainable_parameters(), lr=opt.critic_lr) if critic is not None else None
    state = RunState(run_dir, rank, W, ckpt, policy, fwd, rollout_model, ref, critic, optimizer, scheduler,
                     critic_opt, DataStream(train_examples, seed),
                     Alarms.from_config(tc),
                     base_state, settings=read_settings(run_dir))
    if ckpt is not None:
        restore(state, tc)
    return state


def restore(state: RunState, tc: Any) -> None:
    """Load the checkpoint's optimizer (the full, name-keyed state: rank 0 reads it and broadcasts; any world
    size), scheduler, data position, best metric, alarm patience, skipped-step count and critic optimizer
    into ``state``, then the config's learning rates (so ``--resume train.optim.lr=...`` takes effect). The RNG
    streams are restored later, once the rollout backend is built (:func:`restore_rng_streams`)."""
    ckpt, rank, W = state.ckpt, state.rank, state.world_size
    if (ckpt / "optimizer.pt").exists():
        load_full_optimizer_state(state.fwd, state.optimizer, load_optimizer_state(ckpt) if rank == 0 else {})
    elif W > 1:
        warnings.warn(f"{ckpt} has no optimizer.pt: the optimizer restarts from zero moments", stacklevel=2)
    # (a checkpoint of the older one-process format keeps optimizer.state_dict() in trainer.pt)
    saved = load_trainer_state(ckpt, state.optimizer if W == 1 else None, state.scheduler, rank=rank,
                               world_size=W, rng=False)
    state.resumed = saved
    state.start, state.data.position, state.best = saved["step"], saved["data_position"], saved.get("best")
    state.best_step = saved.get("best_step")
    if rank == 0 and state.best_step == state.start and state.best is not None and best_source(state.run_dir) != ckpt.name:
        save_best(state.run_dir, ckpt, state.best)  # killed inside save_best right after this checkpoint: redo it
    if saved.get("world_size", 1) != W:
        warnings.warn(f"resuming a run saved on {saved.get('world_size', 1)} ranks on {W}: same weights, "
                      "optimizer and data position, but another split of the questions over ranks and other "
                      "sampling streams, so not bit-identical to an uninterrupted run", stacklevel=2)
    extra = saved["extra"]
    if state.critic is not None and extra.get("critic_optimizer"):
        load_critic_optimizer(state.critic, state.critic_optimizer, extra["critic_optimizer"], rank, W)
    apply_config_lr(state.optimizer, state.scheduler, tc.optim.lr, "train.optim.lr", rank)
    if state.critic_optimizer is not None:
        apply_config_lr(state.critic_optimizer, None, tc.optim.critic_lr, "train.optim.critic_lr", rank)
    # the alarm's patience and the skipped-step count run on across the interruption
    state.alarms.restore(saved.get("alarms_below", {}))
    state.alarms.restore_signals(saved.get("alarms_signals", {}))
    state.nonfinite = int(saved.get("nonfinite", 0))


def restore_rng_streams(state: RunState, seed: int) -> None:
    """After the rollout backend's start, which may seed the global RNGs (vLLM's engine does): a resumed run
    gets every rank's saved RNG streams back; a fresh run under torchrun gives each rank its own sampling
    stream (``seed + rank``)."""
    if state.ckpt is not None:
        restore_rng(state.resumed["rng_states"], state.rank, state.world_size)
    elif state.world_size > 1:
        torch.manual_seed(seed + state.rank)
        random.seed(seed + state.rank)


def save_run(state: RunState, step: int, tokenizer: Any, tc: Any, best_metric: float | None = None,
             record: dict[str, Any] | None = None) -> None:
    """Checkpoint ``state`` at ``step`` (and copy it to ``best`` when ``best_metric`` is given), with the
    step's metrics ``record`` (JSON; logged after the checkpoint, so a run killed in between gets it back
    on resume, :func:`relog_saved_record`). Every rank
    calls it (the optimizer state and the RNG states are gathered); rank 0 writes while the others wait
    without the collective timeout (a large checkpoint may take longer;
    :func:`training.infra.distributed.run_on_rank0`), so nobody reads a checkpoint before it is complete and a
    failed write fails every rank."""
    # full optimizer state (rank 0 gets it); none before the first optimizer step (all steps skipped)
    opt_state = full_optimizer_state(state.fwd, state.optimizer) if state.optimizer.state else None
    rngs = gather_objects(rng_state())
    critic_state = critic_opt_state = None
    if state.critic is not None:  # full weights and name-keyed optimizer state, as the policy's (collectives)
        critic_state = full_state_dict(state.critic)
        if state.critic_optimizer.state:
            critic_opt_state = full_optimizer_state(state.critic, state.critic_optimizer)

    # the oldest question not yet trained on, over every rank (asynchronous rollouts read ahead per rank)
    frontier = all_reduce_min(float(state.frontier() if state.frontier is not None else state.data.position))

    def write() -> None:
        src = state.gen_model  # full weights (the synced copy under FSDP)
        extra: dict[str, Any] = {}
        lora = tc.optim.lora
        if lora:
            extra["lora"] = lora_state(src)
        if state.critic is not None:
            extra["critic"], extra["critic_optimizer"] = critic_state, critic_opt_state

        def write_files(d: Path) -> None:
            if state.settings is not None:  # how the policy is trained, for ask/eval/serve --model <ckpt>
                write_settings(d, state.settings)
            if lora:  # LoRA's frozen base weights, so resume rebuilds base + adapters
                from safetensors.torch import save_file

                (d / "base").mkdir(exist_ok=True)
                save_file({k: v.contiguous() for k, v in state.base_state.items()},
                          str(d / "base" / "model.safetensors"))

        position = int(frontier)
        trainer_state = {"data_position": position, "best": state.best, "best_step": state.best_step,
                         "algorithm": tc.algorithm.adv_estimator, "lora": lora, "world_size": state.world_size,
                         "alarms_below": state.alarms.state(),
                         "alarms_signals": state.alarms.signal_state(), "nonfinite": state.nonfinite}
        if record is not None:
            trainer_state["record"] = record
        path = save_checkpoint(state.run_dir, step, MergedView(src) if lora else src, tokenizer, None,
                               state.scheduler, trainer_state=trainer_state, keep=tc.checkpoints.keep, extra=extra,
                               optimizer_state=opt_state, rng_states=rngs,
                               write_files=write_files)
        if best_metric is not None:
            save_best(state.run_dir, path, best_metric)

    run_on_rank0(write)


def relog_saved_record(state: RunState, logger: Any) -> None:
    """A resumed run whose checkpoint was written before its step's record reached ``metrics.jsonl`` (a kill
    between the two): log the record the checkpoint saved (:func:`save_run`), so no step goes missing."""
    saved = (state.resumed or {}).get("record")
    if saved is not None and state.start not in logger.steps():
        logger.log(state.start, saved)


def load_critic_optimizer(critic: Any, optimizer: Any, state: dict[str, Any], rank: int, W: int) -> None:
    """Restore the critic's optimizer from a checkpoint: the full, name-keyed state (rank 0 broadcasts it; any
    world size), or the position-keyed ``optimizer.state_dict()`` that checkpoints before PPO ran under
    torchrun hold (one process only; under torchrun the moments restart, with a warning)."""
    if not any(isinstance(p, int) for g in state.get("param_groups", []) for p in g.get("params", [])):
        load_full_optimizer_state(critic, optimizer, state if rank == 0 else {})
    elif W == 1:
        optimizer.load_state_dict(state)
    else:
        warnings.warn("the checkpoint's critic optimizer state is of the one-process format: the critic's "
                      "optimizer restarts from zero moments", stacklevel=2)


def apply_config_lr(optimizer: Any, scheduler: Any | None, lr: float, key: str, rank: int) -> None:
    """After a resume: restoring the optimizer/scheduler state brings back the old run's base learning rate;
    set it to the config's ``lr`` (the scheduler's position, e.g. the warm-up, is kept), warning on rank 0
    when it differs, so ``--resume train.optim.lr=...`` takes effect."""
    old = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    if all(o == lr for o in old):
        return
    if rank == 0:
        warnings.warn(f"resuming with {key}={lr:g} (the checkpoint's run used {old[0]:g})", stacklevel=2)
    for g in optimizer.param_groups:
        g["initial_lr"] = lr
    if scheduler is not None:
        scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        for g, f in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=False):
            g["lr"] = lr * f(scheduler.last_epoch)
    else:
        for g in optimizer.param_groups:
            g["lr"] = lr
