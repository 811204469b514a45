"""Rollouts through infrastructure faults: a retrieval server or policy backend that goes away and comes back.

An episode whose search or generation call failed ends with ``stop_reason == "error"``
(:func:`agent.loop.episode.run_episode`); its tokens stop where the call failed and its reward is 0. Trained
on, such an episode would teach the policy that the action it took just before the outage (usually a search)
earns nothing. So the trainer's rollout goes through :func:`run_episodes_retrying`, which runs the failed
episodes again (after a growing wait when the service was down: ``train.rollout.retry_waits``, by default
:data:`RETRY_WAITS_S`; at once, and once only, when the failure was the request's own), and
:func:`drop_failed`, which leaves the episodes that still failed out of the update and counts both in the
step's metrics (:data:`FAULT_COUNTS`).

A rerun episode is a fresh sample of the same question in the same group (GRPO's group statistics take
groups of any size, so a group that lost a member still has a baseline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from agent.loop.batch import run_episodes
from agent.trajectory import Trajectory
from corpora.formats import QAExample

log = logging.getLogger(__name__)

RETRY_WAITS_S = (2.0, 4.0, 8.0, 16.0)
"""Seconds waited before each rerun of the episodes that failed because a service was down (30 s in all, on
top of the retries of the retrieval client and the OpenAI-compatible backend themselves)."""

FAULT_COUNTS = ("rollout_errors", "rollout_dropped")
"""Metrics of :func:`drop_failed`: episode runs that ended on an error (every failed attempt, the rerun ones
included), and episodes left out of the update because they still failed. Counts: summed over ranks."""


def failed(traj: Trajectory) -> bool:
    """Whether ``traj`` ended on an error (a failed backend or retriever call), not on the policy's doing."""
    return traj.stop_reason == "error"


def service_down(traj: Trajectory) -> bool:
    """Whether ``traj`` failed because a service as a whole was unavailable (``metadata["service_down"]``,
    set by :func:`agent.loop.episode.run_episode` from :func:`agent.loop.scheduler.is_global`), so that a
    rerun after a wait may succeed, rather than on a fault of its own request."""
    return failed(traj) and bool(traj.metadata.get("service_down"))


def run_episodes_retrying(examples: list[QAExample], llm: Any, retriever: Any, cfg: Any, *, n_samples: int = 1,
                          waits: Sequence[float] | None = None, **kw: Any) -> list[Trajectory]:
    """:func:`agent.loop.batch.run_episodes` (same arguments and result: ``len(examples) * n_samples``
    trajectories, grouped by example, group id = example index), with the episodes that ended on an error run
    again, each in its own place and group. While some failed because a service was down
    (:func:`service_down`), the failed ones are rerun after each wait of ``waits`` in turn (default
    :data:`RETRY_WAITS_S`); when none did, they are rerun once at once.
    Each trajectory's ``metadata["failed_attempts"]`` counts its failed runs (the last one included, if it
    still failed). Raises what :func:`agent.loop.batch.run_episodes` raises (a prompt that cannot be
    built)."""
    trajs = run_episodes(examples, llm, retriever, cfg, n_samples=n_samples, **kw)
    for t in trajs:
        t.metadata["failed_attempts"] = int(failed(t))
    waits_left = list(RETRY_WAITS_S if waits is None else waits)
    rerun_at_once = True  # one immediate rerun of request faults
    while True:
        bad = [i for i, t in enumerate(trajs) if failed(t)]
        if not bad:
            return trajs
        if any(service_down(trajs[i]) for i in bad) and waits_left:
            wait = waits_left.pop(0)
            log.warning("%d of %d episodes failed (%s); running them again in %g s", len(bad), len(trajs),
                        trajs[bad[0]].metadata.get("error"), wait)
            time.sleep(wait)
        elif rerun_at_once and not any(service_down(trajs[i]) for i in bad):
            rerun_at_once = False
        else:
            return trajs
        again = run_episodes([examples[i // n_samples] for i in bad], llm, retriever, cfg, n_samples=1, **kw)
        for i, t in zip(bad, again, strict=True):
            t.group = trajs[i].group
            t.metadata["failed_attempts"] = trajs[i].metadata["failed_attempts"] + int(failed(t))
            trajs[i] = t


def drop_failed(trajs: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
    """``(kept, stats)``: the trajectories that did not end on an error, and :data:`FAULT_COUNTS`
    (``rollout_errors``: the failed runs of all of them, from ``metadata["failed_attempts"]``;
    ``rollout_dropped``: the ones left out). Raises ``RuntimeError`` with the last error when every
    trajectory failed: there is nothing to learn from, and training on the failed ones would teach the policy
    that its actions before the failure earn nothing."""
    kept = [t for t in trajs if not failed(t)]
    errors = sum(int(t.metadata.get("failed_attempts", int(failed(t)))) for t in trajs)
    if trajs and not kept:
        agent = trajs[-1].metadata.get("agent")  # an external agent's own failure (agent.external.runner)
        hint = (f"the agent {agent} failed, not Sleuth's services: fix it, or raise agent.external_timeout_s if it "
                "only needs more time" if agent else "is the retrieval server or policy backend up?")
        raise RuntimeError(f"all {len(trajs)} episodes of this rollout failed, also when run again (the last: "
                           f"{trajs[-1].metadata.get('error')}); {hint}")
    if len(kept) < len(trajs):
        log.warning("%d of %d episodes still failed and are left out of the update (e.g. %s)", len(trajs) - len(kept),
                    len(trajs), next(t for t in trajs if failed(t)).metadata.get("error"))
    return kept, {"rollout_errors": float(errors), "rollout_dropped": float(len(trajs) - len(kept))}
