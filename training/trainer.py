"""Multi-turn policy-gradient training: rollout -> reward -> advantages -> masked policy loss -> optimizer.

The roles are separate, as in verl, and joined by :class:`training.batch.Batch`:

* rollout: the LangGraph agent loop (:func:`agent.loop.run_episodes`) samples ``group_size`` episodes per
  question with the current policy and records token-level trajectories; its judge sets the rewards
  (outcome metric + ``agent.format_reward``). DAPO's dynamic sampling drops groups whose rewards are all
  equal and rolls out more questions to refill the batch (``train.dynamic_sampling``);
* advantages (:func:`compute_advantages`, selected by ``train.algorithm``): GRPO, Dr. GRPO, RLOO,
  REINFORCE++, Stratified GRPO (outcome level), PPO with GAE and a value model (token level), IGPO
  (turn level, information gain); plus a per-turn search cost and KL to the reference as a reward penalty;
* update: PPO-clip over policy tokens only (:func:`training.kernels.policy_loss`: kernel or reference) with
  DAPO clip-higher, KL-to-reference loss, entropy bonus; micro-batches by a token budget; optional LoRA
  (peft), gradient checkpointing, bf16 autocast on GPU, FSDP2 across ranks (:mod:`training.distributed`).

Every step appends a metrics record (rollout, loss and health stats, :mod:`training.monitors`) to
``metrics.jsonl`` and TensorBoard, and every ``save_every`` steps an atomic checkpoint is written;
``resume=True`` continues from the last complete one with the same data order, RNG, optimizer and
scheduler state, so ``k`` steps + resume + ``N - k`` steps equals ``N`` steps.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agent.trajectory import Trajectory, save_trajectories
from corpora.formats import QAExample, json_records
from retrieval.base import Retriever
from training import advantages as A
from training.batch import Batch, _unwrap, check_packed_masks, collate, micro_batches
from training.checkpoint import (
    best_source,
    commit_directory,
    latest_checkpoint,
    load_optimizer_state,
    load_trainer_state,
    read_extra,
    remove_unfinished,
    restore_rng,
    rng_state,
    run_dir_lock,
    save_best,
    save_checkpoint,
)
from training.distributed import (
    LogprobModule,
    all_reduce_max,
    all_reduce_min,
    all_reduce_sum,
    full_optimizer_state,
    full_state_dict,
    gather_objects,
    init_from_env,
    load_full_optimizer_state,
    pad_micro_batches,
    run_on_rank0,
    shard,
    shard_value_model,
    sync_rollout_weights,
    world,
)
from training.faults import FAULT_COUNTS, drop_failed, run_episodes_retrying
from training.gpu_health import check_gpu_memory
from training.losses import LOSS_AGGS
from training.monitors import Alarms, health_stats
from training.rewards import gold_answer_probs, kl_penalty


# -- data ---------------------------------------------------------------------------------------------
class DataStream:
    """An endless, seeded, epoch-shuffled stream of training questions whose position is checkpointed."""

    def __init__(self, examples: list[QAExample], seed: int):
        if not examples:
            raise ValueError("no training questions")
        self.examples, self.seed, self.position = examples, seed, 0
        self._epoch, self._order = -1, []

    def _epoch_order(self, epoch: int) -> list[int]:
        """The shuffled example indices of ``epoch`` (shuffled once per epoch, then cached)."""
        if epoch != self._epoch:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 100003 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def next(self, n: int) -> list[QAExample]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.examples))
            out.append(self.examples[self._epoch_order(epoch)[i]])
            self.position += 1
        return out


def drop_steps_after(path: Path, step: int, step_of: Callable[[dict], int]) -> None:
    """Keep only the records of ``path`` (JSONL) whose ``step_of(record)`` is at most ``step``: a resumed run
    rewrites the steps after its checkpoint, so their records from before the interruption must go. Records
    are split at ``\n`` only (a record may hold raw U+2028 or U+0085). A last line without its newline that
    is not JSON (a kill mid-append) is dropped with a warning; any other line that is not JSON raises
    ``json.JSONDecodeError`` before anything is written (the file is left as it was). The file is rewritten
    through a temporary file renamed into place, so an interruption leaves the old or the new records."""
    if not path.exists():
        return

    def torn(line: str) -> None:
        warnings.warn(f"{path}: dropping a torn last line of {len(line)} characters (interrupted write)",
                      stacklevel=5)  # the caller of drop_steps_after

    keep = [ln for ln, rec in json_records(path, on_torn=torn) if step_of(rec) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """Appends one JSON record per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    ``truncate_after`` drops records of steps after it (a resumed run rewrites the steps it redoes), in
    ``metrics.jsonl`` and in TensorBoard (``SummaryWriter``'s ``purge_step``: TensorBoard hides the earlier
    events of those steps, so a redone step is not plotted twice)."""

    def __init__(self, run_dir: Path, truncate_after: int | None = None, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        if truncate_after is not None:
            drop_steps_after(self.path, truncate_after, lambda r: r.get("step", 0))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if truncate_after is None else truncate_after + 1
                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge)
            except Exception:  # noqa: BLE001 - TensorBoard is optional at run time
                self.tb = None

    def log(self, step: int, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()


def rollout_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """Episode-level means: reward, EM, F1, format validity, search calls, turns, response tokens, plus the
    health metrics of :func:`training.monitors.health_stats`."""
    n = max(len(trajs), 1)
    mean = lambda xs: float(sum(xs) / n)
    return {
        "reward": mean(t.reward for t in trajs),
        "em": mean(t.verdict.get("em", 0.0) for t in trajs),
        "f1": mean(t.verdict.get("f1", 0.0) for t in trajs),
        "turns": mean(t.num_turns for t in trajs),
        "episode_tokens": mean(len(t) for t in trajs),
        **health_stats(trajs),
    }


# -- update -------------------------------------------------------------------------------------------
def _autocast(device: torch.device, enabled: bool):
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def split_micro_batches(batch: Batch, cfg: Any) -> tuple[list[torch.Tensor], list[Batch], int]:
    """The micro-batches :func:`update_policy` runs, in its order: ``(row-index tensors, micro-batches,
    number of real ones)``. Rows are split by ``cfg.micro_batch`` rows and ``cfg.micro_batch_tokens`` tokens
    (a packed budget with ``cfg.packing``, :func:`training.batch.micro_batches`); under torchrun the list is
    padded to the same count on every rank (:func:`training.distributed.pad_micro_batches`; the padding
    repeats the last one and must get zero weight). ``cfg`` is a :class:`training.config.TrainConfig`."""
    idx = micro_batches(batch, cfg.micro_batch, cfg.micro_batch_tokens, packed=cfg.packing)
    idx, n_real = pad_micro_batches(idx)
    return idx, [batch.select(i, packed=cfg.packing) for i in idx], n_real


def update_policy(
    module: Any,
    ref_model: Any | None,
    optimizer: Any,
    batch: Batch,
    cfg: Any,
    *,
    scheduler: Any | None = None,
    critic: Any | None = None,
    critic_optimizer: Any | None = None,
    old_logprobs: list[torch.Tensor] | None = None,
    loss_scale: float | None = None,
) -> dict[str, float]:
    """PPO-clip update(s) on one rollout batch; returns averaged loss statistics (``lr``: the
    learning rate the optimizer steps used, before the scheduler advanced it).

    ``module`` is the policy (a Hugging Face causal LM) or its :class:`training.distributed.LogprobModule`
    (possibly FSDP2-sharded); ``batch.token_advantages`` ``[N, T-1]`` must be set (else ``batch.advantages``
    ``[N]`` is broadcast). ``cfg`` is a :class:`training.config.TrainConfig`. The old log-probs are those of
    the policy before the update (recomputed, as verl does), so with ``ppo_epochs == 1`` the ratio is 1 and
    the update is the on-policy policy gradient. Micro-batches follow ``cfg.micro_batch`` rows and
    ``cfg.micro_batch_tokens``; each is weighted so that the step equals one full-batch step, also across
    ranks (global token and sequence counts). A non-finite loss raises ``FloatingPointError`` before any
    parameter moves in its epoch (with ``cfg.ppo_epochs > 1`` the earlier epochs' steps stand; a non-finite
    value loss of PPO's critic too: neither model steps): at once on one
    process; under torchrun after the backward (so no rank is left waiting in the gradient reduction), when
    the NaN it spread makes every rank's gradient norm non-finite. With
    ``cfg.packing`` the micro-batches are packed (:meth:`training.batch.Batch.select`); under torchrun they are
    padded to the same count on every rank (:func:`training.distributed.pad_micro_batches`, zero weight).
    ``critic`` (PPO, with ``batch.returns`` and ``batch.old_values``) is a :class:`training.critic.ValueModel`,
    under torchrun FSDP2-sharded (:func:`training.distributed.shard_value_model`); its value loss is weighted
    by the same global token counts and it runs every padded micro-batch too.
    """
    from training.kernels import policy_loss

    fwd = module if isinstance(module, LogprobModule) else LogprobModule(module)
    device = next(fwd.parameters()).device
    _rank, W = world()
    if batch.token_advantages is None:
        if batch.advantages is None:
            raise ValueError("update_policy needs batch.token_advantages or batch.advantages")
        batch.token_advantages = A.to_token_advantages(batch.advantages, batch.loss_mask)
    _, micro, n_real = split_micro_batches(batch, cfg)
    with torch.no_grad(), _autocast(device, cfg.bf16):
        old = old_logprobs if old_logprobs is not None else [fwd(mb, False)[0].detach() for mb in micro]
        use_ref = ref_model is not None and cfg.kl_coef > 0 and cfg.kl_mode == "loss"
        ref = [LogprobModule(ref_model)(mb, False)[0] for mb in micro] if use_ref else None
    total_tokens = all_reduce_sum(float(batch.loss_mask.sum()))
    # the "rows" aggregations average over the rows that have a policy token (training.losses.LOSS_AGGS)
    unit = LOSS_AGGS.get(cfg.loss_agg).unit
    total_rows_with_tokens = all_reduce_sum(float((batch.loss_mask.sum(-1) > 0).sum()))
    stats_acc: dict[str, float] = {}
    count = 0
    for _ in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for j, mb in enumerate(micro):
            with _autocast(device, cfg.bf16):
                lp, ent = fwd(mb)
            mask = mb.loss_mask.to(lp.device)
            adv = mb.token_advantages.to(lp.device)
            loss, stats = policy_loss(
                lp, old[j].to(lp.device), adv, mask, loss=cfg.policy_loss, clip_low=cfg.clip_low,
                clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c, loss_agg=cfg.loss_agg,
                ref_logprobs=ref[j] if ref is not None else None, kl_coef=cfg.kl_coef,
                kl_type=cfg.kl_type, entropy=ent, entropy_coef=cfg.entropy_coef, loss_scale=loss_scale,
                options=cfg.options,
            )
            if not torch.isfinite(loss) and W == 1:  # under torchrun the NaN reaches every rank through the
                optimizer.zero_grad(set_to_none=True)  # gradient reduction: all ranks skip at the norm check
                raise FloatingPointError(f"non-finite policy loss ({float(loss)})")
            # weight micro-batches (and ranks: FSDP averages gradients) so the step is one full-batch step
            if unit == "tokens":
                share = float(mask.sum()) / max(total_tokens, 1.0)
            else:
                share = float((mask.sum(-1) > 0).sum()) / max(total_rows_with_tokens, 1.0)
            share = share if j < n_real else 0.0
            (loss * share * W).backward()
            for k, v in stats.items():
                stats_acc[k] = stats_acc.get(k, 0.0) + v * share
        params = [p for p in fwd.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError("non-finite gradient norm")
        use_critic = critic is not None and batch.returns is not None
        if use_critic:  # the value loss's gradients (and its finiteness check) before either model steps
            from training.critic import value_loss

            critic_optimizer.zero_grad(set_to_none=True)
            vl = vf_norm = torch.zeros(())
            # under torchrun every rank runs every (padded) micro-batch, as FSDP2 needs, and a NaN is caught at
            # the gradient norm, which the reduction makes the same on every rank
            for j, mb in enumerate(micro if W > 1 else micro[:n_real]):
                v = critic(mb)
                vl, vs = value_loss(v, mb.old_values.to(v.device), mb.returns.to(v.device),
                                    mb.loss_mask.to(v.device), cfg.vf_clip)
                share = float(mb.loss_mask.sum()) / max(total_tokens, 1.0) if j < n_real else 0.0
                if not torch.isfinite(vl) and W == 1:
                    break
                (cfg.vf_coef * vl * share * W).backward()
                for k, val in vs.items():
                    stats_acc[k] = stats_acc.get(k, 0.0) + val * share
            else:
                vf_norm = torch.nn.utils.clip_grad_norm_(critic.trainable_parameters(), cfg.max_grad_norm)
                if hasattr(vf_norm, "full_tensor"):
                    vf_norm = vf_norm.full_tensor()
            # under torchrun the norm alone decides: a rank's own loss would let the ranks decide apart
            if (W == 1 and not torch.isfinite(vl)) or not torch.isfinite(vf_norm):
                optimizer.zero_grad(set_to_none=True)
                critic_optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(f"non-finite value loss ({float(vl.detach())}) or value-model gradient norm "
                                         f"({float(vf_norm)})")
        stats_acc["lr"] = stats_acc.get("lr", 0.0) + optimizer.param_groups[0]["lr"]  # the rate this step uses
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if use_critic:
            critic_optimizer.step()
        stats_acc["grad_norm"] = stats_acc.get("grad_norm", 0.0) + float(grad_norm)
        count += 1
    return {k: v / count for k, v in stats_acc.items()}


# -- rollout ------------------------------------------------------------------------------------------
def _all_equal_groups(trajs: list[Trajectory]) -> set[int]:
    by: dict[int, list[float]] = {}
    for t in trajs:
        by.setdefault(t.group, []).append(t.reward)
    return {g for g, rs in by.items() if max(rs) - min(rs) < 1e-9}


def rollout(questions: list[QAExample], llm: Any, retriever: Retriever, cfg: Any, data: DataStream | None = None,
            judge: Any = None) -> tuple[list[Trajectory], dict[str, float]]:
    """Sample ``train.group_size`` episodes per question. With ``train.dynamic_sampling`` (DAPO), groups
    whose rewards are all equal (no learning signal) are dropped and up to ``dynamic_sampling_max_tries``
    extra rounds of fresh questions from ``data`` refill the batch to ``len(questions)`` groups.
    Episodes that ended on an error (a retrieval server or backend that went away) are run again and, when
    they still fail, left out (:mod:`training.faults`; counted in ``stats``' ``rollout_errors`` and
    ``rollout_dropped``; ``RuntimeError`` when every episode failed).
    Returns ``(trajectories, stats)``; group ids are renumbered 0..G-1.

    Under torchrun every rank calls it with its own questions and the same ``data`` (the same stream at the
    same position on every rank): each refill round draws ``W x`` the largest shortfall over ranks from the
    stream and rank ``r`` takes the ``r``-th of every ``W`` questions, so every rank's stream stays at the
    same position (the checkpointed one) and the refill is deterministic. Ranks then keep as many groups as
    the rank with the fewest (FSDP needs the same number of forward passes on every rank); the data a rank
    drew but did not need is skipped. On one process this is the plain DAPO refill."""
    tc = cfg.train
    kw = {"n_samples": tc.group_size, "top_k": cfg.retrieval.top_k}
    if judge is not None:
        kw["judge"] = judge
    trajs = run_episodes_retrying(questions, llm, retriever, cfg.agent, **kw)  # failed episodes run again
    stats: dict[str, float] = {}
    if tc.dynamic_sampling and data is not None:
        want = len(questions)
        dropped, rounds = 0, 0
        flat = _all_equal_groups(trajs)
        dropped += len(flat)
        kept = [t for t in trajs if t.group not in flat]
        offset = len(questions)
        rank, W = world()
        while rounds < tc.dynamic_sampling_max_tries:
            need = want - len({t.group for t in kept})
            need_all = int(all_reduce_max(need))  # the same on every rank: the rounds stay in step
            if need_all <= 0:
                break
            rounds += 1
            fresh = data.next(need_all * W)[rank::W][:need]
            if not fresh:
                continue
            more = run_episodes_retrying(fresh, llm, retriever, cfg.agent, **kw)
            for t in more:
                t.group += offset
            offset += len(more) // tc.group_size
            flat = _all_equal_groups(more)
            dropped += len(flat)
            kept += [t for t in more if t.group not in flat]
        groups = sorted({t.group for t in kept})[:want]
        n_signal = len(groups)
        if not groups:  # nothing to learn from: keep the original batch (its advantages are all 0)
            kept, groups = trajs, sorted({t.group for t in trajs})
        if W > 1:  # as many groups on every rank
            groups = groups[: int(all_reduce_min(len(groups)))]
            n_signal = min(n_signal, len(groups))
        keep_set = set(groups)
        kept = [t for t in kept if t.group in keep_set]
        stats = {"ds_dropped_groups": float(dropped), "ds_rounds": float(rounds), "ds_kept_groups": float(n_signal)}
        trajs = kept
    trajs, fault_stats = drop_failed(trajs)  # episodes that still failed: left out of the update, counted
    stats.update(fault_stats)
    remap = {g: i for i, g in enumerate(sorted({t.group for t in trajs}))}
    for t in trajs:
        t.group = remap[t.group]
    return trajs, stats


def merge_rank_records(records: list[tuple[dict[str, Any], int]], loss_keys: set[str]) -> dict[str, Any]:
    """One step record from every rank's ``(record, number of trajectories)``.

    Loss statistics of :func:`update_policy` (``loss_keys``) are each rank's share of the global mean, so
    they are summed (``grad_norm`` and ``lr`` are already global: rank 0's); ``ds_dropped_groups`` and
    ``ds_kept_groups`` are summed; timings and ``ds_rounds`` take the maximum; ``stop/<reason>`` rates are
    means over every rank's trajectories (a rank without the key had no such episode: rate 0); other numbers
    (rollout and health statistics) are means weighted by each rank's trajectory count, over the ranks that
    have the key (per-dataset splits are therefore approximate); anything else is rank 0's."""
    summed = {k for k in loss_keys if k not in ("grad_norm", "lr", "skipped")} | {"ds_dropped_groups", "ds_kept_groups",
                                                                                  *FAULT_COUNTS}
    maxed = {"rollout_s", "step_s", "ds_rounds"}
    first = {"grad_norm", "lr", "skipped"}
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for rec, _ in records for k in rec):
        if k.startswith("stop/"):  # a rate over all episodes: missing on a rank means none stopped so
            vals = [(rec.get(k, 0.0), n) for rec, n in records]
        else:
            vals = [(rec[k], n) for rec, n in records if k in rec]
        if k in first or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v, _ in vals):
            out[k] = vals[0][0]
        elif k in summed:
            out[k] = float(sum(v for v, _ in vals))
        elif k in maxed:
            out[k] = float(max(v for v, _ in vals))
        else:
            total = sum(n for _, n in vals)
            out[k] = float(sum(v * n for v, n in vals) / total) if total else float(vals[0][0])
    return out


# -- LoRA ---------------------------------------------------------------------------------------------
def apply_lora(model: Any, tc: Any) -> Any:
    """Wrap ``model`` with LoRA adapters (Hu et al., 2021) through peft (``pip install sleuth[lora]``); only
    the adapters are trainable. Raises ``ImportError`` with the install hint when peft is missing."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("train.lora=true needs peft: pip install 'sleuth[lora]'") from e
    conf = LoraConfig(r=tc.lora_rank, lora_alpha=tc.lora_alpha, lora_dropout=tc.lora_dropout,
                      target_modules=list(tc.lora_targets), task_type="CAUSAL_LM")
    return get_peft_model(model, conf)


def _lora_state(model: Any) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}


def merged_lora_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The full weights of a LoRA policy under the base model's Hugging Face names, each adapted weight
    merged (``W + scale * B @ A``, peft's ``get_delta_weight``; the same as ``merge_and_unload``), on the
    CPU: what a rollout backend that holds its own weights (vLLM) loads. The policy itself is unchanged."""
    from peft.tuners.lora import LoraLayer

    base = _unwrap(peft_model)
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if isinstance(mod, LoraLayer) and not mod.merged:
                for a in mod.active_adapters:
                    if a in mod.lora_A:
                        d = mod.get_delta_weight(a)
                        deltas[name] = deltas[name] + d if name in deltas else d
        out = {}
        for k, v in base.state_dict().items():
            if ".lora_" in k:  # the adapters' own tensors
                continue
            k = k.replace(".base_layer.", ".")
            owner, _, leaf = k.rpartition(".")
            if leaf == "weight" and owner in deltas:
                v = v + deltas[owner].to(v.dtype)
            out[k] = v.detach().cpu()
    return out


class _MergedView:
    """``save_pretrained`` of a LoRA policy as a plain model directory: the base model's config and the
    merged weights of :func:`merged_lora_state` (no copy of the model is made)."""

    def __init__(self, peft_model: Any):
        self.peft_model = peft_model

    def save_pretrained(self, path: Any) -> None:
        _unwrap(self.peft_model).save_pretrained(path, state_dict=merged_lora_state(self.peft_model))


def load_pretrained_weights(model: Any, path: str | Path) -> None:
    """Load the safetensors weights of a ``save_pretrained`` directory into ``model`` in place: one
    ``model.safetensors`` or the shards named by ``model.safetensors.index.json``. Raises
    ``FileNotFoundError`` when the directory has neither, ``ValueError`` when a saved tensor is unknown to
    ``model`` or a parameter of ``model`` is not saved (a tied LM head excepted)."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = [path / f for f in sorted(set(index["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors nor model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{path}: missing weights {missing[:5]}, unexpected weights {list(unexpected)[:5]}")


# -- the loop -----------------------------------------------------------------------------------------
def rl_train(
    cfg: Any,
    model: Any,
    tokenizer: Any,
    retriever: Retriever,
    train_examples: list[QAExample],
    run_dir: str | Path,
    *,
    resume: bool = False,
    llm_factory: Callable[[Any, Any], Any] | None = None,
    sync_weights: Callable[[Any, dict[str, torch.Tensor]], None] | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    evaluate: Callable[[Any], dict[str, float]] | None = None,
    judge: Any = None,
) -> dict[str, Any]:
    """Train ``model`` in place with multi-turn RL (``cfg`` is the whole :class:`sleuth.config.Config`).

    Rolls out ``cfg.train.questions_per_step`` questions x ``cfg.train.group_size`` episodes per step (split
    over ranks under torchrun), for ``cfg.train.steps`` steps, checkpointing to ``run_dir/checkpoints``.
    With ``resume=True`` it continues from the latest complete checkpoint of ``run_dir`` (model weights must
    already be loaded from it by the caller, see :func:`resume_model_path`; LoRA adapters, critic,
    optimizer, scheduler, RNG and data position are restored here).

    ``llm_factory(model, tokenizer)`` builds the rollout backend (default: :class:`agent.hf.TransformersLLM`
    on the same model object, so no weight sync is needed); after each update, when the rollout side holds
    its own weights (vLLM, FSDP), the full state dict (with LoRA: the adapters merged, under the base
    model's names, :func:`merged_lora_state`) is pushed with ``sync_weights(llm, state)`` or, by default,
    ``llm.update_weights(iter(state.items()))`` when the backend has that method.
    ``evaluate(model) -> {"em": ...}`` runs every ``train.eval_every`` steps (logged as ``eval_*``; the best
    ``eval_em`` checkpoint is kept in ``checkpoints/best``). A non-finite loss skips the step with a warning;
    after ``train.max_nonfinite_steps`` such steps the run stops (``RuntimeError``). Health alarms
    (``train.alarm_*``) warn or stop the run. Returns a summary dict.

    Under ``torchrun`` (``WORLD_SIZE > 1``; the process group is created here with
    ``train.dist_timeout_s`` unless the caller made it, and left for the caller to end with
    :func:`training.distributed.shutdown`): every rank loads the same initial weights, rolls out
    ``questions_per_step / W`` questions (which must divide) and updates an FSDP2 shard of the policy; a
    full rollout copy per rank is refreshed after each update. Rank 0 alone writes metrics, trajectories
    and checkpoints (the full weights, the full optimizer state, every rank's RNG states); the logged
    record and the alarm decisions cover the whole batch. ``evaluate`` runs on rank 0 (the others wait
    for it without ``train.dist_timeout_s``). Resuming with the
    same number of ranks continues exactly; with another number it continues from the same weights,
    optimizer state and data position (with a warning); ranks that see different latest checkpoints (a run
    directory not shared by every rank) raise ``ValueError``, as does a checkpoint written by another
    ``train.algorithm`` or ``train.lora``. PPO's ``separate`` critic is built from the
    full policy and sharded on its own (:func:`training.distributed.shard_value_model`), its advantages are
    whitened over every rank's tokens, and its checkpoint holds the full critic and its name-keyed optimizer
    state; a ``shared`` critic is refused under torchrun (``ValueError``): its head rides on the sharded
    policy's backbone.

    One training at a time per ``run_dir``: rank 0 holds it (:func:`training.checkpoint.run_dir_lock`) for
    the whole run, and another ``rl_train`` on it raises ``RuntimeError`` before writing anything.
    """
    from agent.hf import TransformersLLM

    tc = cfg.train
    if not cfg.agent.temperature > 0:  # log-probs are scored at the rollout temperature (Batch.temperature)
        raise ValueError(f"RL needs sampled rollouts: agent.temperature must be > 0, got {cfg.agent.temperature}")
    estimator = A.ADV_ESTIMATORS.get(tc.algorithm)
    if estimator.critic and tc.critic == "none":  # also enforced by the config schema
        raise ValueError(f"train.algorithm={tc.algorithm} needs train.critic (separate or shared)")
    if tc.packing:  # before the first rollout, not at the first packed micro-batch
        check_packed_masks()
    # torchrun: one process group over every rank (no-op on one process, or when the caller made it)
    rank, W = init_from_env(timeout_s=tc.dist_timeout_s)
    check_gpu_memory()  # logs each device's free memory; warns when something else holds over 10% of one
    if W > 1:
        if estimator.critic and tc.critic == "shared":
            raise ValueError("train.critic=shared is not supported under torchrun (world size > 1): its value head "
                             "rides on the sharded policy's backbone; use train.critic=separate (a value model "
                             "sharded on its own, as verl's critic)")
        if tc.questions_per_step % W:
            raise ValueError(f"train.questions_per_step={tc.questions_per_step} must be a multiple of the "
                             f"world size {W} (every rank rolls out as many questions)")
    with run_dir_lock(run_dir) if rank == 0 else contextlib.nullcontext():  # rank 0 writes run_dir
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if rank == 0:  # the temporary copies of checkpoint writes killed midway (gigabytes each)
            remove_unfinished(run_dir)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        ckpt = latest_checkpoint(run_dir) if resume else None
        if ckpt is not None:  # GRPO weights resumed as PPO would start a fresh critic without a word
            saved_state = json.loads((ckpt / "trainer_state.json").read_text())
            algo = saved_state.get("algorithm", tc.algorithm)
            if algo != tc.algorithm:
                raise ValueError(f"{ckpt} was written by train.algorithm={algo}, not {tc.algorithm}: resume it with "
                                 f"train.algorithm={algo}, or start a new run in another run directory")
            # its optimizer state is the adapters' or the full model's (checkpoints before "lora": its files tell)
            lora = saved_state.get("lora")
            if lora is None:
                lora = (ckpt / "base").is_dir() or "lora" in read_extra(ckpt)
            if lora != tc.lora:
                raise ValueError(f"{ckpt} was written with train.lora={str(lora).lower()}: resume it with "
                                 f"train.lora={str(lora).lower()}, or start a new run in another run directory")
        if W > 1:  # every rank must resume the same step (and load the same weights): a shared run directory
            seen = gather_objects(ckpt.name if ckpt is not None else None)
            if len(set(seen)) > 1:
                raise ValueError(f"the ranks see different latest checkpoints of {run_dir} (by rank: {seen}); the run "
                                 "directory must be on a file system every rank sees")

        # reference model (KL): the initial policy, saved by every fresh start (a reference left by an earlier run
        # that died before its first checkpoint may be of another model) so that a resumed run uses the same one
        ref_model = None
        if tc.kl_coef > 0:
            ref_dir = run_dir / "reference"
            ref_model = copy.deepcopy(model).eval()
            if ckpt is not None and (ref_dir / "config.json").exists():
                load_pretrained_weights(ref_model, ref_dir)  # one file or shards
            elif rank == 0:
                import shutil

                if ckpt is not None:  # train.kl_coef turned on at a resume: the initial policy is gone
                    warnings.warn(f"{ref_dir} is missing: the KL reference is the resumed checkpoint {ckpt.name}, not "
                                  "the run's initial policy", stacklevel=1)
                tmp = run_dir / ".reference.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                ref_model.save_pretrained(tmp)
                commit_directory(tmp, ref_dir)  # flushed: a power loss leaves no empty weight files behind
            for p in ref_model.parameters():
                p.requires_grad_(False)

        # the checkpoint's LoRA adapters and critic, read once and loaded before sharding (plain tensors)
        saved = read_extra(ckpt) if ckpt is not None and (tc.lora or estimator.critic) else {}
        if tc.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        policy = model
        if tc.lora:
            if ckpt is not None and (ckpt / "base" / "model.safetensors").exists():
                from safetensors.torch import load_file

                model.load_state_dict(load_file(str(ckpt / "base" / "model.safetensors")), strict=False)
            base_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            policy = apply_lora(model, tc)
            if "lora" in saved:
                from peft import set_peft_model_state_dict

                set_peft_model_state_dict(policy, saved["lora"])

        # rollout side: the same object on one process; a full copy (LoRA wrapper included) when the update side
        # is sharded, refreshed from the gathered full weights after every update
        rollout_model = copy.deepcopy(policy) if W > 1 else None
        critic = None
        if estimator.critic:  # from the full policy, before it is sharded; then sharded on its own
            from training.critic import ValueModel

            critic = ValueModel(_unwrap(policy), shared=tc.critic == "shared")
            if "critic" in saved:
                critic.load_state_dict(saved["critic"])
            if W > 1:
                shard_value_model(critic)
        fwd = LogprobModule(policy)
        if W > 1:
            shard(fwd, mixed_precision=tc.bf16 and torch.cuda.is_available())
        params = [p for p in fwd.parameters() if p.requires_grad]
        device = next(fwd.parameters()).device
        optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / tc.warmup_steps) if tc.warmup_steps else 1.0)
        critic_opt = None
        if critic is not None:
            critic_opt = torch.optim.AdamW(critic.trainable_parameters(), lr=tc.critic_lr)
        data = DataStream(train_examples, cfg.seed)
        start, best, best_step = 0, None, None
        if ckpt is not None:
            # the full, name-keyed optimizer state (rank 0 reads it and broadcasts; any world size), then the
            # scheduler (this rank's RNG streams once the rollout backend is built)
            if (ckpt / "optimizer.pt").exists():
                load_full_optimizer_state(fwd, optimizer, load_optimizer_state(ckpt) if rank == 0 else {})
            elif W > 1:
                warnings.warn(f"{ckpt} has no optimizer.pt: the optimizer restarts from zero moments", stacklevel=1)
            # (a checkpoint of the older one-process format keeps optimizer.state_dict() in trainer.pt)
            state = load_trainer_state(ckpt, optimizer if W == 1 else None, scheduler, rank=rank, world_size=W,
                                       rng=False)  # the RNG streams: after llm_factory (below)
            start, data.position, best = state["step"], state["data_position"], state.get("best")
            best_step = state.get("best_step")
            if rank == 0 and best_step == start and best is not None and best_source(run_dir) != ckpt.name:
                save_best(run_dir, ckpt, best)  # killed inside save_best right after this checkpoint: redo it
            extra = state["extra"]
            if state.get("world_size", 1) != W:
                warnings.warn(f"resuming a run saved on {state.get('world_size', 1)} ranks on {W}: same weights, "
                              "optimizer and data position, but another split of the questions over ranks and other "
                              "sampling streams, so not bit-identical to an uninterrupted run", stacklevel=1)
            if critic is not None and extra.get("critic_optimizer"):
                _load_critic_optimizer(critic, critic_opt, extra["critic_optimizer"], rank, W)
            _apply_config_lr(optimizer, scheduler, tc.lr, "train.lr", rank)
            if critic_opt is not None:
                _apply_config_lr(critic_opt, None, tc.critic_lr, "train.critic_lr", rank)

        gen_model = rollout_model if rollout_model is not None else policy
        llm = (llm_factory or TransformersLLM)(gen_model, tokenizer)
        if ckpt is not None:  # after the backend's start, which may seed the global RNGs (vLLM's engine does)
            restore_rng(state["rng_states"], rank, W)
        logger = MetricsLogger(run_dir, truncate_after=start, tensorboard=rank == 0) if rank == 0 else None
        if rank == 0:  # each step's sample trajectories carry it (metadata["step"]), as metrics records do
            drop_steps_after(run_dir / "trajectories.jsonl", start, lambda r: r.get("metadata", {}).get("step", 0))
        alarms = Alarms(tc.alarm_min_format_ok, tc.alarm_min_entropy, tc.alarm_patience, tc.alarm_action)
        nonfinite = 0
        if ckpt is not None:  # the alarm's patience and the skipped-step count run on across the interruption
            alarms.restore(state.get("alarms_below", {}))
            nonfinite = int(state.get("nonfinite", 0))
        last: dict[str, Any] = {}
        stopped = None

        def save(step: int, best_metric: float | None = None) -> None:
            """Every rank calls it (the optimizer state and the RNG states are gathered); rank 0 writes the
            checkpoint (and copies it to ``best`` when ``best_metric`` is given) while the others wait without the
            collective timeout (a large checkpoint may take longer; :func:`training.distributed.run_on_rank0`), so
            nobody reads a checkpoint before it is complete and a failed write fails every rank."""
            # full optimizer state (rank 0 gets it); none before the first optimizer step (all steps skipped)
            opt_state = full_optimizer_state(fwd, optimizer) if optimizer.state else None
            rngs = gather_objects(rng_state())
            critic_state = critic_opt_state = None
            if critic is not None:  # full weights and name-keyed optimizer state, as the policy's (collectives)
                critic_state = full_state_dict(critic)
                critic_opt_state = full_optimizer_state(critic, critic_opt) if critic_opt.state else None

            def write() -> None:
                src = rollout_model if rollout_model is not None else policy  # full weights (synced copy under FSDP)
                target = _MergedView(src) if tc.lora else src
                extra: dict[str, Any] = {}
                if tc.lora:
                    extra["lora"] = _lora_state(src)
                if critic is not None:
                    extra["critic"], extra["critic_optimizer"] = critic_state, critic_opt_state

                def write_base(d: Path) -> None:  # LoRA's frozen base weights, so resume rebuilds base + adapters
                    from safetensors.torch import save_file

                    (d / "base").mkdir(exist_ok=True)
                    save_file({k: v.contiguous() for k, v in base_state.items()}, str(d / "base" / "model.safetensors"))

                path = save_checkpoint(run_dir, step, target, tokenizer, None, scheduler,
                                       trainer_state={"data_position": data.position, "best": best, "best_step": best_step,
                                                      "algorithm": tc.algorithm, "lora": tc.lora, "world_size": W,
                                                      "alarms_below": alarms.state(), "nonfinite": nonfinite},
                                       keep=tc.keep_checkpoints, extra=extra, optimizer_state=opt_state, rng_states=rngs,
                                       write_files=write_base if tc.lora else None)
                if best_metric is not None:
                    save_best(run_dir, path, best_metric)

            run_on_rank0(write)

        if W > 1 and ckpt is None:  # independent sampling streams per rank (a resumed run restores them)
            torch.manual_seed(cfg.seed + rank)
            random.seed(cfg.seed + rank)

        for step in range(start, tc.steps):
            t0 = time.time()
            questions = data.next(tc.questions_per_step)
            per_rank = questions[rank::W] if W > 1 else questions
            policy.eval()
            if critic is not None:  # as verl's critic: values estimated in eval mode, the update in train mode
                critic.eval()
            if callable(getattr(retriever, "set_step", None)):  # ZeroSearch's noise curriculum follows training
                retriever.set_step(step, tc.steps)
            trajs, ds_stats = rollout(per_rank, llm, retriever, cfg, data, judge)
            t_roll = time.time() - t0
            batch = collate(trajs, tokenizer.pad_token_id, cfg.agent.max_total_tokens)
            batch.temperature = cfg.agent.temperature  # score the distribution the rollout sampled from
            with torch.no_grad():
                idx, micro, _ = split_micro_batches(batch, tc)  # update_policy's split: old log-probs align
                # the update's autocast (bf16 on GPU), so that the first epoch's ratio is exactly 1
                with _autocast(device, tc.bf16):
                    old = [fwd(mb, False)[0].detach() for mb in micro]
                kl_tokens = values = gold = None
                if ref_model is not None and tc.kl_mode == "reward":
                    full_old = torch.zeros_like(batch.loss_mask)
                    full_ref = torch.zeros_like(batch.loss_mask)
                    for i, mb, o in zip(idx, micro, old, strict=True):
                        full_old[i, : o.shape[1]] = o.to(full_old.device)
                        with _autocast(device, tc.bf16):
                            full_ref[i, : o.shape[1]] = LogprobModule(ref_model)(mb, False)[0].to(full_ref.device)
                    kl_tokens = kl_penalty(full_old, full_ref, batch.loss_mask, tc.kl_type)
                if critic is not None:
                    values = torch.zeros_like(batch.loss_mask)
                    for i, mb in zip(idx, micro, strict=True):
                        v = critic(mb).detach().cpu()
                        values[i, : v.shape[1]] = v
                if estimator.gold_probs:
                    gold = gold_answer_probs(gen_model, tokenizer, trajs, max_len=cfg.agent.max_total_tokens)
            adv = A.compute_advantages(tc, A.advantage_inputs(batch, trajs, values=values, gold_probs=gold,
                                                               kl_tokens=kl_tokens))
            batch.token_advantages = adv["advantages"]
            if "returns" in adv:
                batch.returns, batch.old_values = adv["returns"], values
            policy.train()
            if critic is not None:
                critic.train()
            moved = True
            try:
                loss_stats = update_policy(fwd, ref_model, optimizer, batch, tc, scheduler=scheduler, critic=critic,
                                           critic_optimizer=critic_opt, old_logprobs=old,
                                           loss_scale=tc.loss_scale_factor or float(cfg.agent.max_total_tokens))
            except FloatingPointError as e:
                # the same decision on every rank; with ppo_epochs > 1 the epochs before the NaN have stepped
                moved = tc.ppo_epochs > 1
                nonfinite += 1
                warnings.warn(f"step {step + 1}: {e}; step skipped ({nonfinite}/{tc.max_nonfinite_steps})", stacklevel=1)
                loss_stats = {"skipped": 1.0}
                if nonfinite >= tc.max_nonfinite_steps:
                    last = latest_checkpoint(run_dir)
                    raise RuntimeError(
                        f"stopping at step {step + 1}: {nonfinite} steps skipped for a non-finite loss or gradient norm "
                        f"(train.max_nonfinite_steps={tc.max_nonfinite_steps}; the last: {e}); the last complete "
                        f"checkpoint is {last or 'none yet'}: resume it with --resume and a lower train.lr") from e
            # a backend holding its own weights (vLLM) gets them under the base model's names (LoRA merged)
            state = None
            if moved and W > 1:  # the rollout copy is what checkpoints and evaluate see: refreshed with any backend
                full = {k.removeprefix("model."): v for k, v in full_state_dict(fwd).items()}
                sync_rollout_weights(None, rollout_model, full)
                state = merged_lora_state(rollout_model) if tc.lora else full
            elif moved and (sync_weights is not None or hasattr(llm, "update_weights")):
                state = merged_lora_state(policy) if tc.lora else full_state_dict(_unwrap(policy))
            if state is not None:
                sync_rollout_weights(llm, None, state) if sync_weights is None else sync_weights(llm, state)
            policy.eval()
            # mean |advantage| over the policy tokens of every rank (sums reduced: the same value as one process)
            adv_abs = all_reduce_sum(float((batch.token_advantages.abs() * batch.loss_mask).sum()))
            adv_abs_mean = adv_abs / max(all_reduce_sum(float(batch.loss_mask.sum())), 1.0)
            record = {**rollout_stats(trajs), **ds_stats, **loss_stats, "adv_abs_mean": adv_abs_mean,
                      "rollout_s": t_roll, "step_s": time.time() - t0}
            if W > 1:  # one record for the whole batch, the same on every rank (so alarms decide alike)
                record = merge_rank_records(gather_objects((record, len(trajs))), set(loss_stats))
                record["adv_abs_mean"] = adv_abs_mean
            if evaluate is not None and tc.eval_every and ((step + 1) % tc.eval_every == 0 or step + 1 == tc.steps):
                # rank 0 evaluates its full rollout copy while the others wait without the collective timeout
                # (an evaluation may take longer); an error there fails every rank at once
                scores = run_on_rank0(lambda: evaluate(gen_model))
                record.update({f"eval_{k}": v for k, v in scores.items()})
            fired = alarms.check(step + 1, record)
            if fired:
                record["alarms"] = fired
            if logger is not None:
                logger.log(step + 1, record)
                for t in trajs[: tc.group_size]:
                    t.metadata["step"] = step + 1
                save_trajectories(run_dir / "trajectories.jsonl", trajs[: tc.group_size], append=True)
            last = record
            if on_step is not None:
                on_step(step + 1, record)
            metric = record.get("eval_em", None)
            # a NaN metric (an empty eval) is no best: once best were NaN, no later metric would beat it
            improved = metric is not None and math.isfinite(metric) and (best is None or metric > best)
            if improved:
                best, best_step = metric, step + 1
            if (step + 1) % tc.save_every == 0 or step + 1 == tc.steps or improved or alarms.should_stop:
                save(step + 1, metric if improved else None)
            if alarms.should_stop:
                stopped = fired
                break
        return {"steps": tc.steps, "start_step": start, "last": last, "best_eval_em": best, "stopped": stopped}


def _load_critic_optimizer(critic: Any, optimizer: Any, state: dict[str, Any], rank: int, W: int) -> None:
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


def _apply_config_lr(optimizer: Any, scheduler: Any | None, lr: float, key: str, rank: int) -> None:
    """After a resume: restoring the optimizer/scheduler state brings back the old run's base learning rate;
    set it to the config's ``lr`` (the scheduler's position, e.g. the warm-up, is kept), warning on rank 0
    when it differs, so ``--resume train.lr=...`` takes effect."""
    old = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    if all(o == lr for o in old):
        return
    if rank == 0:
        warnings.warn(f"resuming with {key}={lr:g} (the checkpoint's run used {old[0]:g})", stacklevel=2)
    for g in optimizer.param_groups:
        g["initial_lr"] = lr
    if scheduler is not None:
        scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        for g, f in zip(optimizer.param_groups, scheduler.lr_lambdas):
            g["lr"] = lr * f(scheduler.last_epoch)
    else:
        for g in optimizer.param_groups:
            g["lr"] = lr


def resume_model_path(run_dir: str | Path) -> Path | None:
    """The model directory to load when resuming ``run_dir`` (its latest complete checkpoint), or None."""
    return latest_checkpoint(run_dir)
