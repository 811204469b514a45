"""REX-RAG's mixed sampling and its importance correction (Jiang et al., 2025, arXiv 2508.08149).

Rollout (:func:`rexrag_groups`): the ``group_size`` ordinary episodes of each question, then a probe of each
dead end (a wrong answer, drawn with probability ``p``: :func:`training.algos.rexrag.dead_ends`): its
trajectory cut before its final answer turn (:func:`training.algos.rexrag.probe_cut`), a hint of the pool
written as the start of that turn (policy tokens: the hint is trained), and the policy continues from there
in the same batch graph as every episode (:func:`agent.loop.batch.run_states`, resumed from the prefix).
The probe joins its question's group, marked ``metadata["probe"] = {"keep": prefix tokens, "hint_len":
hint tokens, "hint_logp": the pool's log-probability of each hint token}``. The hint tokens' rollout
log-probabilities are NaN (no backend sampled them: the rollout correction leaves them out).

Update (:func:`rexrag_behaviour_logprobs`, a prepare step of the strategy): the batch's behaviour
distribution is the mixture ``mu = (1 - alpha) pi_old + alpha pi_probe`` (``alpha``: the share of probe
rows, ``err``: the error rate of the ordinary rows; :func:`training.algos.rexrag.mixture_weights`), and the
PPO ratio's denominator is ``log mu`` per token (:func:`training.algos.rexrag.behaviour_logprobs`),
recorded on the batch as ``Batch.behaviour_logprobs`` ``[N, T-1]``, which the actor's loss uses in place of
``old_logprobs`` (the KL to the reference and the rollout correction keep ``old_logprobs``). Followed: the
importance block of ``DataParallelPPOActor.update_policy`` in the authors' ``verl/workers/actor/dp_actor.py``
(MiliLab/REX-RAG); the differences from it are listed in :mod:`training.algos.rexrag`.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import torch

from agent.llm import encode
from agent.loop.batch import NEXT, run_states
from agent.loop.nodes import AgentContext, EpisodeState
from agent.trajectory import Role, Trajectory
from corpora.formats import QAExample
from training.algos.rexrag import (
    ProbePlan,
    RexRagOptions,
    behaviour_logprobs,
    dead_ends,
    hint_logprobs,
    mixture_weights,
    probe_masks,
    probe_plan,
)


def correct(traj: Trajectory) -> bool:
    """Whether an episode's answer is right (the judge's exact match)."""
    return float(traj.verdict.get("em", 0.0)) > 0.0


def probe_state(traj: Trajectory, plan: ProbePlan, hint_ids: list[int], pool_ids: list[list[int]]) -> EpisodeState:
    """The episode state of a probe: a copy of ``traj`` cut to its first ``plan.keep_tokens`` tokens (the turns
    before the final one, their tool results), the hint appended as policy tokens of the final turn, waiting
    for the policy to continue that turn."""
    last = max(t.index for t in traj.turns)
    probe = copy.deepcopy(traj)
    k = plan.keep_tokens
    probe.token_ids, probe.roles, probe.turn_ids = probe.token_ids[:k], probe.roles[:k], probe.turn_ids[:k]
    if probe.logprobs is not None:
        probe.logprobs = probe.logprobs[:k]
    probe.turns = [t for t in probe.turns if t.index < last]
    probe.retrieved_ids = [h for t in probe.turns for h in t.hit_ids]
    probe.answer, probe.reward, probe.verdict, probe.stop_reason = None, 0.0, {}, ""
    probe.metadata = {k_: v for k_, v in probe.metadata.items() if k_ not in ("failed_attempts", "error")}
    probe.append(hint_ids, Role.POLICY, last, [float("nan")] * len(hint_ids) if probe.logprobs is not None else None)
    probe.metadata["probe"] = {"keep": k, "hint_len": len(hint_ids), "hint_index": plan.hint_index,
                               "hint_logp": hint_logprobs(hint_ids, pool_ids)}
    return {"traj": probe, "turn": last, "finish": "", NEXT: "policy"}


def rexrag_groups(worker: Any, questions: list[QAExample], group_size: int, opts: RexRagOptions,
                  rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    """The ``group_size`` ordinary episodes per question, then one probe per dead end, in its group. A probe
    whose hint would not fit the episode's token budget (``agent.max_total_tokens``) is not made. Returns
    ``(trajectories, stats)`` with ``rexrag/probes`` (probes run) and ``rexrag/probe_em`` (their exact-match
    rate; 0 without probes). Raises ``ValueError`` for an external agent."""
    if worker.external is not None:
        raise ValueError("train.rollout.strategy=rexrag resumes episodes of the built-in agent loop: set "
                         "agent.kind=builtin")
    base = worker.episodes(questions, group_size)
    n = len(base)
    answered = torch.tensor([t.answer is not None and t.stop_reason == "answer" for t in base], dtype=torch.bool)
    right = torch.tensor([correct(t) for t in base], dtype=torch.bool)
    u = torch.tensor([rng.random() for _ in base])
    dead = dead_ends(answered, right, torch.zeros(n, dtype=torch.bool), u, opts.probe_prob)
    plans = probe_plan(base, dead, opts, rng)
    tok = worker.llm.tokenizer
    pool_ids = [encode(tok, h) for h in opts.hints]
    budget = worker.agent.max_total_tokens
    plans = [p for p in plans if p.keep_tokens + len(pool_ids[p.hint_index]) < budget]
    if not plans:
        return base, {"rexrag/probes": 0.0, "rexrag/probe_em": 0.0}

    def build(ctx: AgentContext) -> list[EpisodeState]:
        return [probe_state(base[p.row], p, pool_ids[p.hint_index], pool_ids) for p in plans]

    kw = {"judge": worker.judge} if worker.judge is not None else {}
    probes = run_states(build, worker.llm, worker.retriever, worker.agent, top_k=worker.top_k, **kw)
    stats = {"rexrag/probes": float(len(probes)), "rexrag/probe_em": sum(map(correct, probes)) / len(probes)}
    return base + probes, stats


def probe_tensors(trajs: list[Trajectory], T: int) -> tuple[torch.Tensor, ...]:
    """``(is_probe [N] bool, prefix [N, T-1] bool, hint [N, T-1] bool, hint_logp [N, T-1] float32)`` of a batch
    of ``T`` token columns, aligned with the loss's target positions (shifted by one). A probe cut by
    ``collate``'s ``max_len`` keeps the part of its hint that fits."""
    N = len(trajs)
    is_probe = torch.zeros(N, dtype=torch.bool)
    prefix = torch.zeros(N, T, dtype=torch.bool)
    hint = torch.zeros(N, T, dtype=torch.bool)
    hint_lp = torch.zeros(N, T)
    for i, t in enumerate(trajs):
        p = t.metadata.get("probe")
        if not p:
            continue
        is_probe[i] = True
        pre, h = probe_masks(len(t.token_ids), p["keep"], p["hint_len"])
        width = min(len(t.token_ids), T)
        prefix[i, :width], hint[i, :width] = pre[:width], h[:width]
        lp = torch.tensor(p["hint_logp"], dtype=torch.float32)
        end = min(p["keep"] + p["hint_len"], T)
        hint_lp[i, p["keep"]:end] = lp[: max(end - p["keep"], 0)]
    return is_probe, prefix[:, 1:], hint[:, 1:], hint_lp[:, 1:]


def rexrag_behaviour_logprobs(ctx: Any) -> None:
    """The prepare step of ``rexrag``: ``ctx.batch.behaviour_logprobs`` ``[N, T-1]`` float32, ``log mu`` at
    the policy tokens (``old_logprobs`` elsewhere), when the batch holds a probe and the strategy's
    ``correction`` is on; left ``None`` otherwise (the ratio then uses ``old_logprobs``). ``alpha`` and ``err``
    are those of this rank's rows under torchrun. The error rate is kept above 0 (``1 / ordinary rows``) for a
    batch whose ordinary rows are all right (a probe can only come from a wrong one, so this happens only when
    that row was dropped, e.g. by a fault)."""
    b = ctx.batch
    if not getattr(ctx.tc.rollout.strategy_options, "correction", True):
        return
    is_probe, prefix, hint, hint_lp = probe_tensors(ctx.trajs, b.input_ids.shape[1])
    if not bool(is_probe.any()):
        return
    right = torch.tensor([correct(t) for t in ctx.trajs], dtype=torch.bool)
    alpha, err = mixture_weights(is_probe, right)
    err = max(err, 1.0 / max(int((~is_probe).sum()), 1))
    b.behaviour_logprobs = behaviour_logprobs(b.old_logprobs, b.loss_mask, is_probe, hint, hint_lp, prefix, alpha,
                                              err).to(b.old_logprobs.dtype)
