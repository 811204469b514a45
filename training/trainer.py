"""Multi-turn policy-gradient training: rollout -> reward -> advantages -> masked policy loss -> optimizer.

The roles are separate, as in verl, and joined by one :class:`training.batch.Batch`; each phase of a step
is a function below, and :func:`rl_train`'s loop reads as the algorithm of the GRPO / PPO papers:

1. **rollout** (:mod:`training.rollout.worker`): the LangGraph agent loop samples ``group_size`` episodes per
   question with the current policy; its judge sets the rewards; DAPO's dynamic sampling optionally drops
   flat groups and refills the batch;
2. **score** (:func:`score`): the old policy's and the reference's log-probs (:mod:`training.model.actor`),
   then the registered estimator's own prepare steps (:class:`training.algos.estimators.PrepareContext`:
   the critic's values, IGPO's gold-answer probabilities, the KL penalty when it is a reward, ...), all
   written onto the batch;
3. **advantages** (:mod:`training.algos.estimators`: the estimator ``train.algorithm.adv_estimator``), then
   the rollout correction (:mod:`training.algos.offpolicy`);
4. **update** (:func:`training.model.actor.update_policy`): the registered policy loss over policy tokens only
   (:func:`training.model.kernels.policy_loss`, its settings one ``LossConfig`` built once), micro-batched,
   with PPO's critic stepping beside it;
5. **sync** the new weights to the rollout side (the rollout copy under FSDP2, a vLLM engine, or every engine
   of a fleet: ``train.rollout.engines``, :mod:`training.rollout.fleet_run`, each verified);
6. **eval** every ``monitoring.eval_every`` steps on held-out questions; the step's record (rollout, loss
   and health stats, :mod:`training.infra.monitors`) and its alarms;
7. **checkpoint** (:mod:`training.run_state`) every ``checkpoints.save_every`` steps, on a new best and at
   the end; then the record is **logged**.

Every phase is timed into the step's record as ``timing/<phase>_s``
(:func:`training.infra.monitors.marked_timer`); ``step_s`` is the time from the rollout through the sync.

``resume=True`` continues from the last complete checkpoint with the same data order, RNG, optimizer and
scheduler state, so ``k`` steps + resume + ``N - k`` steps equals ``N`` steps.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agent.trajectory import Trajectory, save_trajectories
from corpora.formats import QAExample
from retrieval.base import Retriever
from training.algos import estimators as E
from training.algos.losses import LossConfig
from training.algos.offpolicy import rollout_correction, turn_staleness
from training.algos.rewards import training_rewards
from training.batch import Batch, collate
from training.infra.checkpoint import latest_checkpoint, run_dir_lock
from training.infra.distributed import (
    all_reduce_max,
    all_reduce_sum,
    full_state_dict,
    gather_objects,
    init_from_env,
    run_on_rank0,
    sync_rollout_weights,
)
from training.infra.gpu_health import check_gpu_memory
from training.infra.monitors import MetricsLogger, drop_steps_after, marked_timer
from training.model.actor import score_logprobs, split_micro_batches, update_policy
from training.model.critic import critic_values
from training.model.forward import check_packed_masks, policy_logprobs
from training.model.lora import base_model, merged_lora_state
from training.rollout.faults import FAULT_COUNTS
from training.rollout.fleet_run import open_fleet
from training.rollout.fleet_run import push as fleet_push
from training.rollout.producer import AsyncRollouts, rollout_copy
from training.rollout.strategies import prepare_steps as strategy_prepare_steps
from training.rollout.weight_sync import check_tensors, probe_ids, verify_engine
from training.rollout.worker import RolloutWorker, rollout, rollout_stats
from training.run_state import RunState, open_run, relog_saved_record, restore_rng_streams, save_run


# -- the phases of a step -----------------------------------------------------------------------------
def rollout_phase(state: RunState, worker: RolloutWorker, tc: Any, step: int,
                  producer: AsyncRollouts | None = None) -> tuple[list[Trajectory], dict]:
    """This rank's share of the step's questions, ``rollout.group_size`` episodes each, with the policy (and
    the critic) in eval mode; ZeroSearch's noise curriculum follows the step. With ``producer``
    (``train.rollout.asynchronous``) the groups it generated in the background, at most
    ``rollout.max_staleness`` updates old (:meth:`training.rollout.producer.AsyncRollouts.take`)."""
    state.policy.eval()
    if state.critic is not None:  # as verl's critic: values estimated in eval mode, the update in train mode
        state.critic.eval()
    if callable(getattr(worker.retriever, "set_step", None)):
        worker.retriever.set_step(step, tc.steps)
    if producer is not None:
        return producer.take(step)
    questions = state.data.next(tc.rollout.questions_per_step)
    W = state.world_size
    per_rank = questions[state.rank :: W] if W > 1 else questions
    return rollout(worker, per_rank, tc, state.data)


@torch.no_grad()
def score(state: RunState, batch: Batch, trajs: list[Trajectory], tc: Any, tokenizer: Any, max_len: int,
          worker: RolloutWorker | None = None, step: int = 0) -> None:
    """Set ``batch.rewards`` to the rewards trained on (``train.algorithm.reward``,
    :func:`training.algos.rewards.training_rewards`), fill ``batch.old_logprobs`` / ``batch.ref_logprobs``, then
    run the registered estimator's prepare steps (:func:`training.algos.estimators.prepare_inputs`) and then the
    rollout strategy's (:func:`training.rollout.strategies.prepare_steps`), which write what they need onto the
    batch."""
    batch.rewards = training_rewards(tc.algorithm, trajs, batch.groups)
    score_logprobs(state.fwd, state.ref_model, batch, tc)
    ctx = prepare_context(state, batch, trajs, tc, tokenizer, max_len, worker, step)
    E.prepare_inputs(ctx)
    for prepare in strategy_prepare_steps(tc):  # what the rollout strategy's update needs (REX-RAG's mixture)
        prepare(ctx)


def prepare_context(state: RunState, batch: Batch, trajs: list[Trajectory], tc: Any, tokenizer: Any, max_len: int,
                    worker: RolloutWorker | None, step: int) -> E.PrepareContext:
    """The :class:`training.algos.estimators.PrepareContext` of a step: the batch, the trajectories, the run's
    models (the policy's log-probs of any batch, the critic's values on the update's micro-batches), the
    tokenizer and the rollout worker."""
    critic = state.critic

    def values(b: Batch) -> torch.Tensor:
        idx, micro, _ = split_micro_batches(b, tc)
        return critic_values(critic, b, idx, micro)

    return E.PrepareContext(batch=batch, trajs=trajs, tc=tc, tokenizer=tokenizer, max_len=max_len,
                            policy=state.gen_model,
                            logprobs=lambda b: policy_logprobs(state.gen_model, b, with_entropy=False)[0],
                            ref_model=state.ref_model, critic=critic, values=values if critic is not None else None,
                            worker=worker, step=step,
                            score=lambda b: score_logprobs(state.fwd, state.ref_model, b, tc),
                            entropy=lambda b: policy_logprobs(state.gen_model, b, with_entropy=True)[1])


def advantage_phase(tc: Any, batch: Batch, trajs: list[Trajectory]) -> None:
    """Set ``batch.token_advantages`` (and PPO's ``returns``) from the registered estimator, on the inputs the
    score phase prepared."""
    adv = E.compute_advantages(tc, E.advantage_inputs(batch, trajs))
    batch.token_advantages = adv["advantages"]
    if "returns" in adv:
        batch.returns = adv["returns"]


def update_phase(state: RunState, batch: Batch, tc: Any, loss: LossConfig, step: int) -> tuple[dict, bool]:
    """The update in train mode with the loss settings ``loss``; returns ``(loss stats, whether the weights
    moved)``. A non-finite loss skips the step with a warning (``{"skipped": 1.0}``; with ``ppo_epochs > 1``
    earlier epochs have stepped); after ``monitoring.max_nonfinite_steps`` such steps the run stops with a
    ``RuntimeError`` naming the last complete checkpoint to resume from."""
    state.policy.train()
    if state.critic is not None:
        state.critic.train()
    limit = tc.monitoring.max_nonfinite_steps
    try:
        stats = update_policy(state.fwd, state.ref_model, state.optimizer, batch, tc, scheduler=state.scheduler,
                              critic=state.critic, critic_optimizer=state.critic_optimizer, loss=loss)
        return stats, True
    except FloatingPointError as e:  # the same decision on every rank
        state.nonfinite += 1
        warnings.warn(f"step {step + 1}: {e}; step skipped ({state.nonfinite}/{limit})", stacklevel=2)
        if state.nonfinite >= limit:
            last = latest_checkpoint(state.run_dir)
            raise RuntimeError(
                f"stopping at step {step + 1}: {state.nonfinite} steps skipped for a non-finite loss or gradient "
                f"norm (train.monitoring.max_nonfinite_steps={limit}; the last: {e}); the last complete "
                f"checkpoint is {last or 'none yet'}: resume it with --resume and a lower train.optim.lr") from e
        return {"skipped": 1.0}, tc.algorithm.ppo_epochs > 1


def sync_phase(state: RunState, worker: RolloutWorker, tc: Any, moved: bool,
               sync_weights: Callable[[Any, dict[str, torch.Tensor]], None] | None,
               probe: list[int] | None, step: int = 0) -> dict[str, float]:
    """Push the updated weights (of step ``step``'s update) to the rollout side: in fleet mode
    (``rollout.engines``) streamed to every engine and each verified (:func:`training.rollout.fleet_run.push`:
    a failing engine is out of rotation, named; none left raises
    :class:`training.rollout.weight_sync.WeightSyncError`); under torchrun the gathered full weights into every
    rank's rollout copy (what checkpoints and evaluation see); to a backend holding its own weights (vLLM)
    under the base model's names, LoRA merged (:func:`training.model.lora.merged_lora_state`). With
    ``rollout.verify_sync`` each push is checked (:mod:`training.rollout.weight_sync`: the copy tensor by tensor,
    the engine on the ``probe`` sequence) and a rollout side that does not run the new weights raises
    :class:`training.rollout.weight_sync.WeightSyncError`; returns the checks' ``sync/...`` statistics."""
    if state.fleet is not None:
        stats = fleet_push(state, state.fleet, step + 1) if moved else {}
        state.policy.eval()
        return stats
    full, stats = None, {}
    verify, lora = tc.rollout.verify_sync, tc.optim.lora
    if moved and state.world_size > 1:
        gathered = {k.removeprefix("model."): v for k, v in full_state_dict(state.fwd).items()}
        sync_rollout_weights(None, state.rollout_model, gathered)
        if verify:
            stats["sync/tensors_checked"] = float(check_tensors(state.rollout_model, gathered))
        full = merged_lora_state(state.rollout_model) if lora else gathered
    elif moved and (sync_weights is not None or hasattr(worker.llm, "update_weights")):
        full = merged_lora_state(state.policy) if lora else full_state_dict(base_model(state.policy))
    if full is not None:
        sync_rollout_weights(worker.llm, None, full) if sync_weights is None else sync_weights(worker.llm, full)
        if verify:
            stats.update(verify_engine(worker.llm, state.gen_model, full, tc, probe))
    state.policy.eval()
    return stats


def merge_rank_records(records: list[tuple[dict[str, Any], int]], loss_keys: set[str]) -> dict[str, Any]:
    """One step record from every rank's ``(record, number of trajectories)``.

    Loss statistics of :func:`update_policy` (``loss_keys``) are each rank's share of the global mean, so
    they are summed (``grad_norm`` and ``lr`` are already global: rank 0's); ``ds_dropped_groups`` and
    ``ds_kept_groups`` are summed; timings (``step_s``, ``timing/...``), ``ds_rounds`` and the
    ``offpolicy/..._max`` drift metrics take the maximum; ``stop/<reason>`` rates are means over every rank's trajectories (a rank without the key had no
    such episode: rate 0); other numbers (rollout and health statistics, the drift's quantiles: an
    approximation) are means weighted by each rank's trajectory count, over the ranks that have the key
    (per-dataset splits are therefore approximate); anything else is rank 0's."""
    summed = {k for k in loss_keys if k not in ("grad_norm", "lr", "skipped")} | {"ds_dropped_groups", "ds_kept_groups",
                                                                                  *FAULT_COUNTS}
    maxed = {"step_s", "ds_rounds"}
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
        elif k in maxed or k.startswith("timing/") or (k.startswith("offpolicy/") and k.endswith("_max")):
            out[k] = float(max(v for v, _ in vals))
        else:
            total = sum(n for _, n in vals)
            out[k] = float(sum(v * n for v, n in vals) / total) if total else float(vals[0][0])
    return out


def step_record(state: RunState, trajs: list[Trajectory], batch: Batch, stats: dict[str, float],
                loss_stats: dict[str, float]) -> dict[str, Any]:
    """The step's metrics record: rollout and health statistics, ``stats``, the loss statistics and the mean
    |advantage| over policy tokens; under torchrun one record of the whole batch, the same on every rank
    (so alarms decide alike; :func:`merge_rank_records`)."""
    # mean |advantage| over the policy tokens of every rank (sums reduced: the same value as one process)
    adv_abs = all_reduce_sum(float((batch.token_advantages.abs() * batch.loss_mask).sum()))
    adv_abs_mean = adv_abs / max(all_reduce_sum(float(batch.loss_mask.sum())), 1.0)
    prepared = {k: float(v) for k, v in batch.prepared.get("stats", {}).items()}  # what prepare steps report
    record = {**rollout_stats(trajs), **stats, **prepared, **loss_stats, "adv_abs_mean": adv_abs_mean}
    if state.world_size > 1:
        record = merge_rank_records(gather_objects((record, len(trajs))), set(loss_stats))
        record["adv_abs_mean"] = adv_abs_mean
    return record


def log_phase(state: RunState, logger: MetricsLogger | None, step: int, record: dict[str, Any],
              trajs: list[Trajectory], tc: Any) -> None:
    """Rank 0 appends the step's first group of trajectories to ``trajectories.jsonl`` (tagged with the step)
    and then the record to ``metrics.jsonl`` / TensorBoard."""
    if logger is None:
        return
    group = trajs[: tc.rollout.group_size]
    for t in group:
        t.metadata["step"] = step
    save_trajectories(state.run_dir / "trajectories.jsonl", group, append=True)
    logger.log(step, record)


def checkpoint_phase(state: RunState, step: int, record: dict[str, Any], tokenizer: Any, tc: Any) -> None:
    """Checkpoint every ``checkpoints.save_every`` steps, at the last step, when the alarms stop the run, and
    when the held-out EM improves (then also copied to ``checkpoints/best``), with the step's ``record``. A NaN
    metric (an empty eval) is no best: once best were NaN, no later metric would beat it."""
    metric = record.get("eval_em", None)
    improved = metric is not None and math.isfinite(metric) and (state.best is None or metric > state.best)
    if improved:
        state.best, state.best_step = metric, step
    if step % tc.checkpoints.save_every == 0 or step == tc.steps or improved or state.alarms.should_stop:
        save_run(state, step, tokenizer, tc, metric if improved else None, record)


def check_setup(tc: Any, agent_cfg: Any) -> None:
    """Raise ``ValueError`` before anything is built for settings that cannot train and that the ``train``
    section alone does not decide (it validates itself, :mod:`training.config`): greedy rollouts (log-probs
    are scored at the rollout temperature), packing on a transformers without packed-sequence masks
    (:func:`training.model.forward.check_packed_masks`), asynchronous rollouts with an external agent (it
    does not run in the background producer), a rollout strategy other than ``plain`` with an external agent
    (it steps the built-in loop)."""
    if tc.rollout.asynchronous and getattr(agent_cfg, "kind", "builtin") == "external":
        raise ValueError("train.rollout.asynchronous runs the built-in agent loop: set agent.kind=builtin, or "
                         "train.rollout.asynchronous=false")
    if tc.rollout.strategy != "plain" and getattr(agent_cfg, "kind", "builtin") == "external":
        raise ValueError(f"train.rollout.strategy={tc.rollout.strategy} steps the built-in agent loop: set "
                         "agent.kind=builtin, or train.rollout.strategy=plain")
    if not agent_cfg.temperature > 0:
        raise ValueError(f"RL needs sampled rollouts: agent.temperature must be > 0, got {agent_cfg.temperature}")
    if tc.rollout.fleet and tc.optim.lora:
        raise ValueError("train.rollout.engines (a fleet) takes the full weights, and LoRA's merged push is not "
                         "streamed yet: set train.optim.lora=false, or leave train.rollout.engines unset")
    if tc.optim.packing:  # before the first rollout, not at the first packed micro-batch
        check_packed_masks()


def policy_vocab_size(model: Any, tokenizer: Any) -> int | None:
    """``V``: the tokens of the policy's output layer (its config's ``vocab_size``; the tokenizer's length for a
    model without one); ``None`` when neither says."""
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    try:
        return len(tokenizer)
    except TypeError:
        return None


def check_world(tc: Any, W: int) -> None:
    """Raise ``ValueError`` for settings torchrun cannot run on ``W`` ranks (a shared critic, questions that
    do not split evenly)."""
    if W == 1:
        return
    if tc.rollout.asynchronous and not tc.rollout.fleet:
        raise ValueError("train.rollout.asynchronous under torchrun (world size > 1) needs a fleet of rollout engines "
                         "(train.rollout.engines: URLs, or a count to start): each rank's copy cannot generate while "
                         "the sharded policy updates")
    if tc.rollout.fleet:
        full = [s.__name__ for s in E.ADV_ESTIMATORS.get(tc.algorithm.adv_estimator).prepare
                if s not in (E.kl_reward_penalty, E.critic_values)]
        if full:
            raise ValueError(f"train.algorithm.adv_estimator={tc.algorithm.adv_estimator} scores with the full "
                             f"policy on every rank ({', '.join(full)}), which holds none in fleet mode under torchrun "
                             "(train.rollout.engines): train it on one process, or without engines")
    if E.ADV_ESTIMATORS.get(tc.algorithm.adv_estimator).critic and tc.algorithm.critic == "shared":
        raise ValueError("train.algorithm.critic=shared is not supported under torchrun (world size > 1): its "
                         "value head rides on the sharded policy's backbone; use train.algorithm.critic=separate "
                         "(a value model sharded on its own, as verl's critic)")
    qps = tc.rollout.questions_per_step
    if qps % W:
        raise ValueError(f"train.rollout.questions_per_step={qps} must be a multiple of the world size {W} (every "
                         "rank rolls out as many questions)")


def rollout_side(state: RunState, tc: Any, agent_cfg: Any, tokenizer: Any, retriever: Retriever, top_k: int,
                 judge: Any, llm_factory: Callable[[Any, Any], Any] | None, seed: int,
                 stack: contextlib.ExitStack) -> RolloutWorker:
    """The rollout backend and its :class:`training.rollout.worker.RolloutWorker`: with ``rollout.engines`` the
    fleet (:func:`training.rollout.fleet_run.open_fleet`, kept in ``state.fleet``; ``llm_factory`` unused), else
    ``llm_factory(model, tokenizer)``, by default :class:`agent.backends.hf.TransformersLLM` on the trainer's
    own model, or with ``rollout.asynchronous`` a worker process on a copy
    (:class:`agent.backends.process.ProcessLLM`, closed by ``stack``; the backend must hold its own weights:
    ``ValueError`` for one that generates on the parameters being updated)."""
    from agent.backends.hf import TransformersLLM
    from agent.external.runner import runner_for

    asynchronous = tc.rollout.asynchronous
    if tc.rollout.fleet:
        probe = probe_ids(tokenizer) if tc.rollout.verify_sync else None
        state.fleet = open_fleet(state, tc, tokenizer, probe, stack)
        llm = state.fleet.fleet
    elif asynchronous and llm_factory is None:
        from agent.backends.process import ProcessLLM

        llm = ProcessLLM(rollout_copy(state.policy, tc.optim.lora), tokenizer, threads=torch.get_num_threads(),
                         seed=seed + 1)
        stack.callback(llm.close)
    else:
        llm = (llm_factory or TransformersLLM)(state.gen_model, tokenizer)
    if asynchronous and state.fleet is None and (getattr(llm, "model", None) is state.gen_model
                                                 or not hasattr(llm, "update_weights")):
        raise ValueError("train.rollout.asynchronous needs a rollout backend that holds its own weights and takes "
                         "update_weights (vLLM, or the default worker process): this one generates on the "
                         "trainer's parameters, which the update changes under it")
    if callable(getattr(retriever, "bind_policy", None)):  # a search engine the policy itself plays (SSRL)
        from agent.llm import SamplingParams, complete

        params = SamplingParams(max_new_tokens=agent_cfg.simulator.max_doc_tokens,
                                temperature=agent_cfg.simulator.temperature, stop=())
        retriever.bind_policy(lambda prompts: complete(llm, prompts, params))
    external = runner_for(llm, agent_cfg, judge)  # agent.kind=external: its proxy serves llm
    stack.callback(lambda: external is not None and external.close())
    return RolloutWorker(llm, retriever, agent_cfg, top_k, judge, external, tuple(tc.rollout.retry_waits))


def start_rollouts(state: RunState, worker: RolloutWorker, tc: Any, tokenizer: Any,
                   stack: contextlib.ExitStack) -> tuple[list[int] | None, AsyncRollouts | None]:
    """Before the first step: the weight-sync probe (``None`` without ``rollout.verify_sync``), checked on the
    rollout backend at once (an engine started from other weights than the trainer's fails here, not after
    a step; a fleet is pushed the trainer's weights and each engine verified), and with ``rollout.asynchronous`` the background producer, started on ``state.data`` (closed by
    ``stack`` before the backend; checkpoints then save its frontier)."""
    probe = probe_ids(tokenizer) if tc.rollout.verify_sync else None
    if state.fleet is not None:  # every engine runs the trainer's weights before the first step, or is out
        fleet_push(state, state.fleet, state.start)
    elif probe is not None:
        verify_engine(worker.llm, state.gen_model, None, tc, probe)
    producer = None
    if tc.rollout.asynchronous:
        producer = AsyncRollouts(worker, state.data, tc, version=state.start, rank=state.rank,
                                 world_size=state.world_size, turn_versions=state.fleet is not None)
        stack.callback(producer.close)
        state.frontier = producer.frontier
    return probe, producer


def train_step(state: RunState, worker: RolloutWorker, tc: Any, agent_cfg: Any, tokenizer: Any, step: int,
               loss: LossConfig, producer: AsyncRollouts | None, probe: list[int] | None,
               sync_weights: Callable[[Any, dict[str, torch.Tensor]], None] | None,
               evaluate: Callable[[Any], dict[str, float]] | None,
               logger: MetricsLogger | None) -> tuple[dict[str, Any], list[str]]:
    """One RL step, its phases in order, each timed as ``timing/<phase>_s`` in the step's record (the maximum
    over ranks under torchrun, so the record stays the same on every rank); returns ``(record, alarms fired)``.
    The record is logged after the checkpoint, so a checkpoint's step always has its record (the checkpoint
    keeps a copy for a run killed in between, :func:`training.run_state.relog_saved_record`)."""
    timing: dict[str, float] = {}
    t0 = time.time()
    with marked_timer("rollout", timing):
        trajs, stats = rollout_phase(state, worker, tc, step, producer)
    with marked_timer("score", timing):
        batch = collate(trajs, tokenizer.pad_token_id, agent_cfg.max_total_tokens)
        batch.temperature = agent_cfg.temperature  # score the distribution the rollout sampled from
        score(state, batch, trajs, tc, tokenizer, agent_cfg.max_total_tokens, worker, step)
    with marked_timer("advantages", timing):
        advantage_phase(tc, batch, trajs)
        # drift of the rollout's log-probs; TIS / MIS; each turn's staleness from the version that generated it
        staleness = turn_staleness(batch, trajs, step) if state.fleet is not None else None  # versions = steps
        stats.update(rollout_correction(batch, tc, staleness))
    with marked_timer("update", timing):
        loss_stats, moved = update_phase(state, batch, tc, loss, step)
    with marked_timer("sync", timing):
        stats.update(sync_phase(state, worker, tc, moved, sync_weights, probe, step))
        if producer is not None:  # groups started from now on run the weights of this update
            producer.publish(step + 1)
    stats.update(timing)
    stats["step_s"] = time.time() - t0
    timing.clear()  # the phases below are timed after the record is merged over ranks
    with marked_timer("log", timing):
        record = step_record(state, trajs, batch, stats, loss_stats)
    every = tc.monitoring.eval_every
    if evaluate is not None and every and ((step + 1) % every == 0 or step + 1 == tc.steps):
        with marked_timer("eval", timing):
            scores = run_on_rank0(lambda: evaluate(state.gen_model))  # the others wait without the timeout
        record.update({f"eval_{k}": v for k, v in scores.items()})
    with marked_timer("log", timing):
        fired = state.alarms.check(step + 1, record)
        if fired:
            record["alarms"] = fired
    with marked_timer("checkpoint", timing):
        checkpoint_phase(state, step + 1, record, tokenizer, tc)
    record.update({k: all_reduce_max(v) for k, v in timing.items()})
    log_phase(state, logger, step + 1, record, trajs, tc)
    return record, fired


# -- the loop -----------------------------------------------------------------------------------------
def rl_train(
    tc: Any,
    agent_cfg: Any,
    model: Any,
    tokenizer: Any,
    retriever: Retriever,
    train_examples: list[QAExample],
    run_dir: str | Path,
    *,
    seed: int = 0,
    top_k: int = 3,
    resume: bool = False,
    llm_factory: Callable[[Any, Any], Any] | None = None,
    sync_weights: Callable[[Any, dict[str, torch.Tensor]], None] | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    evaluate: Callable[[Any], dict[str, float]] | None = None,
    judge: Any = None,
) -> dict[str, Any]:
    """Train ``model`` in place with multi-turn RL: ``tc`` is the :class:`training.config.TrainConfig`,
    ``agent_cfg`` the :class:`agent.config.AgentConfig` of the rollouts (searching ``top_k`` passages).

    Rolls out ``rollout.questions_per_step`` questions x ``rollout.group_size`` episodes per step (split over
    ranks under torchrun), for ``tc.steps`` steps, checkpointing to ``run_dir/checkpoints``. With ``resume=True``
    it continues from the latest complete checkpoint of ``run_dir`` (the model weights must already be
    loaded from it by the caller; LoRA adapters, critic, optimizer, scheduler, RNG and data position are
    restored here, :mod:`training.run_state`).

    ``llm_factory(model, tokenizer)`` builds the rollout backend (default:
    :class:`agent.backends.hf.TransformersLLM` on the same model object, so no weight sync is needed); after
    each update a backend holding its own weights (vLLM) gets them through ``sync_weights(llm, state)`` or
    ``llm.update_weights``. ``evaluate(model) -> {"em": ...}`` runs every ``monitoring.eval_every`` steps (logged as
    ``eval_*``; the best ``eval_em`` checkpoint is kept in ``checkpoints/best``). ``judge`` overrides the
    agent config's judge. With ``agent.kind: external`` the episodes are the ``agent.entry`` function's, run
    over a training proxy in front of the rollout backend (:func:`agent.external.runner.runner_for`;
    ``proxy_calls`` / ``proxy_splits`` logged per step).
    A non-finite loss skips the step; after ``monitoring.max_nonfinite_steps`` such steps the run stops
    (``RuntimeError``). Health alarms (``train.monitoring.alarms``) warn or stop the run. Returns a summary
    dict.

    Under ``torchrun`` (``WORLD_SIZE > 1``; the process group is created here with ``tc.dist_timeout_s``
    unless the caller made it, and left for the caller to end with
    :func:`training.infra.distributed.shutdown`) every rank updates an FSDP2 shard of the policy and rolls out
    on a full copy refreshed after each update (in fleet mode, ``train.rollout.engines``, on the engines: rank 0
    alone keeps a copy); rank 0 alone writes metrics, trajectories and checkpoints, and
    evaluates (the others wait for it without the collective timeout). One training at a time per ``run_dir``:
    rank 0 holds :func:`training.infra.checkpoint.run_dir_lock` for the whole run (``RuntimeError`` for a
    second one). Raises ``ValueError`` for settings that cannot train (:func:`check_setup`,
    :func:`check_world`) and for a checkpoint of another estimator or LoRA setting.
    """
    check_setup(tc, agent_cfg)
    vocab = policy_vocab_size(model, tokenizer)
    if vocab is not None:  # the options that need the policy (AEPO's entropy target below log V)
        tc.check_model(vocab)
    rank, W = init_from_env(timeout_s=tc.dist_timeout_s)  # torchrun: the process group; else a no-op
    check_gpu_memory()  # logs each device's free memory; warns when something else holds over 10% of one
    check_world(tc, W)
    # rank 0 writes run_dir; the stack closes an external agent's proxy however the run ends
    with run_dir_lock(run_dir) if rank == 0 else contextlib.nullcontext(), contextlib.ExitStack() as stack:
        state = open_run(tc, model, run_dir, train_examples, seed=seed, resume=resume, rank=rank, world_size=W)
        worker = rollout_side(state, tc, agent_cfg, tokenizer, retriever, top_k, judge, llm_factory, seed, stack)
        probe, producer = start_rollouts(state, worker, tc, tokenizer, stack)
        restore_rng_streams(state, seed)
        logger = None
        if rank == 0:  # a resumed run rewrites the steps after its checkpoint: their old records go
            logger = MetricsLogger(state.run_dir, truncate_after=state.start)
            drop_steps_after(state.run_dir / "trajectories.jsonl", state.start,
                             lambda r: r.get("metadata", {}).get("step", 0))
            relog_saved_record(state, logger)
        loss = LossConfig.of(tc.algorithm, loss_scale=float(agent_cfg.max_total_tokens))  # once, for every step
        last: dict[str, Any] = {}
        stopped = None
        for step in range(state.start, tc.steps):
            last, fired = train_step(state, worker, tc, agent_cfg, tokenizer, step, loss, producer, probe,
                                     sync_weights, evaluate, logger)
            if on_step is not None:
                on_step(step + 1, last)
            if state.alarms.should_stop:
                stopped = fired
                break
        return {"steps": tc.steps, "start_step": state.start, "last": last, "best_eval_em": state.best,
                "stopped": stopped}
