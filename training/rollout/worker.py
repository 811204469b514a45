"""The rollout role: the agent loop samples groups of episodes with the current policy, and the training
questions arrive from a checkpointed stream.

* :class:`DataStream`: an endless, seeded, epoch-shuffled stream of training questions;
* :class:`RolloutWorker`: the rollout backend, retriever, agent settings and judge, one call per group of
  episodes (:func:`agent.loop.batch.run_episodes`);
* :func:`rollout`: ``train.rollout.group_size`` episodes per question, sampled by the rollout strategy
  ``train.rollout.strategy`` (:mod:`training.rollout.strategies`; by default independent episodes), with DAPO's dynamic sampling (Yu et al., 2025)
  dropping groups whose rewards are all equal and refilling the batch from the stream;
* :func:`rollout_stats`: the episode-level means logged each step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from agent.trajectory import Trajectory
from corpora.formats import QAExample
from retrieval.base import Retriever
from training.infra.distributed import all_reduce_max, all_reduce_min, world
from training.infra.monitors import health_stats
from training.rollout.faults import drop_failed, run_episodes_retrying
from training.rollout.strategies import sample_groups


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


@dataclass
class RolloutWorker:
    """What rolls out episodes: the backend ``llm`` (an :class:`agent.llm.LLM` over the current policy), the
    ``retriever``, the agent's settings (:class:`agent.config.AgentConfig`), the search top-k, the judge
    (``None``: the agent config's own) and the waits in seconds before rerunning episodes that a service
    outage failed (``None``: :data:`training.rollout.faults.RETRY_WAITS_S`; ``train.rollout.retry_waits``)."""

    llm: Any
    retriever: Retriever
    agent: Any
    top_k: int
    judge: Any = None
    external: Any = None  # an agent.external.runner.ExternalRunner: agent.kind=external
    retry_waits: tuple[float, ...] | None = None

    def episodes(self, questions: list[QAExample], n: int) -> list[Trajectory]:
        """``n`` episodes per question, grouped by question (group id = its index); episodes that failed on
        a retrieval server or backend that went away are run again
        (:func:`training.rollout.faults.run_episodes_retrying`). An external agent's episodes run over its
        proxy (:class:`agent.external.runner.ExternalRunner`, failed ones run again there); one that a chat
        template split is several sequences of its group."""
        if self.external is not None:
            return self.external.run_episodes(questions, n, self.judge)
        kw: dict[str, Any] = {"n_samples": n, "top_k": self.top_k, "waits": self.retry_waits}
        if self.judge is not None:
            kw["judge"] = self.judge
        return run_episodes_retrying(questions, self.llm, self.retriever, self.agent, **kw)


def flat_groups(trajs: list[Trajectory]) -> set[int]:
    """The groups whose rewards are all equal (no learning signal for a group-relative estimator)."""
    by: dict[int, list[float]] = {}
    for t in trajs:
        by.setdefault(t.group, []).append(t.reward)
    return {g for g, rs in by.items() if max(rs) - min(rs) < 1e-9}


def rollout(worker: RolloutWorker, questions: list[QAExample], tc: Any,
            data: DataStream | None = None) -> tuple[list[Trajectory], dict[str, float]]:
    """Sample ``tc.rollout.group_size`` episodes per question (``tc``: a :class:`training.config.TrainConfig`) with
    the rollout strategy ``tc.rollout.strategy`` (:func:`training.rollout.strategies.sample_groups`; its
    statistics join ``stats``).
    With ``rollout.dynamic_sampling`` (DAPO), groups whose rewards are all equal are dropped and up to
    ``rollout.dynamic_sampling_max_tries`` extra rounds of fresh questions from ``data`` refill the batch to
    ``len(questions)`` groups (:func:`dynamic_sampling`). Episodes that still failed on a service outage
    after their reruns are left out of the update (:mod:`training.rollout.faults`; counted in ``stats``'
    ``rollout_errors`` and ``rollout_dropped``; ``RuntimeError`` when every episode failed). Returns
    ``(trajectories, stats)``; group ids are renumbered 0..G-1."""
    before = dict(worker.external.stats) if worker.external is not None else None
    trajs, stats = sample_groups(worker, questions, tc)
    if tc.rollout.dynamic_sampling and data is not None:
        trajs, ds_stats = dynamic_sampling(worker, trajs, len(questions), tc, data)
        stats.update(ds_stats)
    trajs, fault_stats = drop_failed(trajs)  # episodes that still failed: left out of the update, counted
    stats.update(fault_stats)
    if before is not None:  # the proxy's counters this step: calls, and splits (templates rewriting history)
        after = worker.external.stats
        stats.update({f"proxy_{k}": float(after[k] - before[k]) for k in ("calls", "splits")})
    remap = {g: i for i, g in enumerate(sorted({t.group for t in trajs}))}
    for t in trajs:
        t.group = remap[t.group]
    return trajs, stats


def dynamic_sampling(worker: RolloutWorker, trajs: list[Trajectory], want: int, tc: Any,
                     data: DataStream) -> tuple[list[Trajectory], dict[str, float]]:
    """DAPO's dynamic sampling on a first round ``trajs`` of ``want`` groups: drop the flat groups, refill
    from ``data`` for up to ``tc.rollout.dynamic_sampling_max_tries`` rounds, keep at most ``want`` groups (all of the
    first round's when none has a signal: their advantages are all 0). Returns the kept trajectories and
    ``ds_dropped_groups``, ``ds_rounds``, ``ds_kept_groups``.

    Under torchrun every rank calls it with its own questions and the same ``data`` (the same stream at the
    same position on every rank): each refill round draws ``W x`` the largest shortfall over ranks from the
    stream and rank ``r`` takes the ``r``-th of every ``W`` questions, so every rank's stream stays at the
    same position (the checkpointed one) and the refill is deterministic. Ranks then keep as many groups as
    the rank with the fewest (FSDP needs the same number of forward passes on every rank); the data a rank
    drew but did not need is skipped."""
    rank, W = world()
    flat = flat_groups(trajs)
    dropped, rounds, offset = len(flat), 0, want
    kept = [t for t in trajs if t.group not in flat]
    while rounds < tc.rollout.dynamic_sampling_max_tries:
        need = want - len({t.group for t in kept})
        need_all = int(all_reduce_max(need))  # the same on every rank: the rounds stay in step
        if need_all <= 0:
            break
        rounds += 1
        fresh = data.next(need_all * W)[rank::W][:need]
        if not fresh:
            continue
        more, _ = sample_groups(worker, fresh, tc)
        for t in more:
            t.group += offset
        offset = max(offset, *(t.group + 1 for t in more))  # an external episode may be several sequences
        flat = flat_groups(more)
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
    stats = {"ds_dropped_groups": float(dropped), "ds_rounds": float(rounds), "ds_kept_groups": float(n_signal)}
    return [t for t in kept if t.group in keep_set], stats


def rollout_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """Episode-level means: reward, EM, F1, format validity, search calls, turns, response tokens, plus the
    health metrics of :func:`training.infra.monitors.health_stats`."""
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
