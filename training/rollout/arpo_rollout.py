"""ARPO's rollout (Dong et al., 2025, "Agentic Reinforced Policy Optimization", arXiv 2507.19849): one budget
of ``M`` rollouts per question, spent on ``N`` global samples and on step-level branches at the tool steps
where the policy's entropy rose.

The episodes run as one batch graph with a branch step after every tool step
(:func:`agent.loop.batch.run_states`). At each, every episode that just received a tool result is a branch
source with its entropy change ``dH_t = H_t - H_initial`` (:func:`training.algos.arpo.entropy_changes`, over
the first ``k`` policy tokens of its turns, divided by ``log V``); :func:`training.algos.arpo.branch_plan`
draws how many copies to make (``P_t = clip(alpha + beta dH_t, 0, 1)``, up to ``Z`` per source, while the
question has fewer than ``M`` rollouts) and each copy (:func:`agent.loop.batch.fork`) continues on its own
from the shared prefix. Questions whose rollouts ended with fewer than ``M`` get fresh global samples
after the graph (the authors' rollout adds them one per round while others run; the count is the same: every
group has exactly ``M`` rollouts, as GRPO's, so a comparison is fair in samples).

Entropy: the authors read the top-10 log-probabilities vLLM reports (``_calc_entropy`` in
``vllm_rollout_with_tools.py``). Sleuth's backends report the sampled token's log-probability only, so the
per-token entropy is estimated by the sampled token's surprisal ``-log p(y_t)``, whose expectation is the
entropy ``H_t``; a rollout without reported log-probabilities has ``dH = 0`` (branch probability
``alpha``).

A branch is marked ``metadata["arpo"] = {"branch_at": tokens shared with its source}``; a global sample
``{"branch_at": 0}``. ARPO's hard advantage attribution over shared prefixes is the estimator ``arpo``
(:mod:`training.algos.estimators`).
"""

from __future__ import annotations

import math
import random
from typing import Any

from agent.loop.batch import NEXT, fork, run_states
from agent.loop.nodes import AgentContext, EpisodeState, new_episode
from agent.trajectory import Role, Trajectory
from corpora.formats import QAExample
from training.algos.arpo import ARPOOptions, BranchSource, branch_plan, entropy_changes


def surprisals(traj: Trajectory) -> list[float]:
    """Per token of ``traj``: ``-log p`` of each policy token as the backend reported it (0 at other tokens,
    and everywhere when it reported none): a one-sample estimate of the token's entropy (nats)."""
    if traj.logprobs is None:
        return [0.0] * len(traj.token_ids)
    return [-lp if r == Role.POLICY and math.isfinite(lp) else 0.0 for lp, r in zip(traj.logprobs, traj.roles, strict=True)]


def delta_entropy(traj: Trajectory, turn: int, k: int, vocab_size: int) -> float:
    """``dH`` of the tool step after turn ``turn`` of ``traj`` (0 for the first turn): see
    :func:`training.algos.arpo.entropy_changes`."""
    return entropy_changes(traj, surprisals(traj), k, vocab_size).get(turn, 0.0)


class Brancher:
    """The ``after_tool`` hook of ARPO's batch graph: at each tool step, the branch sources, the draws and
    the copies. ``counts``: rollouts per question so far (updated); ``stats``: sources, copies, summed dH."""

    def __init__(self, opts: ARPOOptions, counts: list[int], vocab_size: int, rng: random.Random):
        self.opts, self.counts, self.vocab_size, self.rng = opts, counts, vocab_size, rng
        self.sources = self.branches = 0
        self.delta_sum = 0.0

    def __call__(self, states: list[EpisodeState]) -> list[EpisodeState]:
        ready = [st for st in states if st[NEXT] == "policy"]  # just got a tool result (the graph alternates)
        deltas = [delta_entropy(st["traj"], st["turn"] - 1, self.opts.entropy_window, self.vocab_size)
                  for st in ready]
        plan = branch_plan([BranchSource(st["traj"].group, d) for st, d in zip(ready, deltas, strict=True)],
                           self.counts, self.opts, self.rng)
        self.sources += len(ready)
        self.delta_sum += sum(deltas)
        added = []
        for st, n in zip(ready, plan, strict=True):
            for _ in range(n):
                copy = fork(st)
                copy["traj"].metadata["arpo"] = {"branch_at": len(copy["traj"].token_ids)}
                added.append(copy)
        self.branches += len(added)
        return added


def arpo_groups(worker: Any, questions: list[QAExample], opts: ARPOOptions,
                rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    """ARPO's ``M = opts.group_size`` rollouts for each question (group ``i`` for question ``i``): ``N``
    global samples branched at tool steps, then fresh global samples for the questions still short of ``M``
    (:meth:`training.rollout.worker.RolloutWorker.episodes`). Returns ``(trajectories, stats)`` with
    ``arpo/branches`` (copies made), ``arpo/sources`` (tool steps that could branch), ``arpo/delta_h_mean``
    (mean ``dH`` at them) and ``arpo/refills`` (global samples added after the graph). Raises ``ValueError``
    for an external agent (the strategy steps the built-in loop)."""
    if worker.external is not None:
        raise ValueError("train.rollout.strategy=arpo branches the built-in agent loop: set agent.kind=builtin")
    counts = [opts.global_samples] * len(questions)
    brancher = Brancher(opts, counts, len(worker.llm.tokenizer), rng)

    def build(ctx: AgentContext) -> list[EpisodeState]:
        states = []
        for g, q in enumerate(questions):
            for _ in range(opts.global_samples):
                st = new_episode(ctx, q, g)
                st["traj"].metadata["arpo"] = {"branch_at": 0}
                states.append(st)
        return states

    kw = {"judge": worker.judge} if worker.judge is not None else {}
    trajs = run_states(build, worker.llm, worker.retriever, worker.agent, after_tool=brancher, top_k=worker.top_k, **kw)
    refills = 0
    short: dict[int, list[int]] = {}
    for g, n in enumerate(counts):
        if n < opts.group_size:
            short.setdefault(opts.group_size - n, []).append(g)
    for missing, groups in sorted(short.items()):
        more = worker.episodes([questions[g] for g in groups], missing)
        for t in more:
            t.group = groups[t.group]
            t.metadata["arpo"] = {"branch_at": 0}
        trajs.extend(more)
        refills += len(more)
    stats = {"arpo/branches": float(brancher.branches), "arpo/sources": float(brancher.sources),
             "arpo/delta_h_mean": brancher.delta_sum / max(brancher.sources, 1), "arpo/refills": float(refills)}
    return trajs, stats
