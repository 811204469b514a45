"""AdaSearch's rollout (Lin et al., 2025, "AdaSearch: Balancing Parametric Knowledge and Search in Large
Language Models via Reinforcement Learning", arXiv 2512.16883): problem solving and the decision to search
trained in two stages of one policy, each stage a run of ``sleuth train`` with
``train.rollout.strategy=adasearch`` and ``train.rollout.strategy_options.stage`` 1 or 2 (stage 2 is a new run,
in its own ``out_dir``, starting from stage 1's weights: ``policy.model=<stage-1 out_dir>/<run>/checkpoints/latest``,
e.g. ``.../grpo/checkpoints/latest``; its optimizer starts afresh). The strategy function has no step counter
(it is also called for DAPO's refill rounds), so one run is one stage.

**Stage 1** (:func:`stage1_groups`): each question's ``group_size`` rollouts are split into parametric-mode
episodes (:func:`training.algos.knowledge_boundary.parametric_prompt`, one turn, no retriever: a search
action ends the episode unanswered) and ordinary search-mode episodes (the agent loop and retriever), both
scored by the run's judge (EM by default). The two modes of a question are **two groups** (search: group
``i``, parametric: group ``Q + i``): a group-relative baseline estimates the value of one prompt, and the two
prompts' success rates differ by design (on a question beyond the policy's knowledge only search can win);
one mixed group would give every parametric answer a negative advantage there, even the best one, which
teaches "do not answer without search" (stage 2's decision) instead of "answer well without search" (stage
1's aim), and DAPO's dynamic sampling would keep or drop both modes together.

**Stage 2** (:func:`stage2_groups`): per question, ``K = label_rollouts`` parametric-mode episodes label it
known when their EM rate reaches ``known_threshold``
(:func:`training.algos.knowledge_boundary.known_questions`), and ``group_size`` decision episodes
(:func:`training.algos.knowledge_boundary.decision_prompt`, one generation stopped at ``</decision>``, no
retriever) form the question's group, rewarded by
:func:`training.algos.knowledge_boundary.decision_rewards` against that label (the label comes from the
same step's policy, so it follows the policy's knowledge as it changes). The parametric episodes only label
unless ``train_label_rollouts`` (then they are group ``Q + i`` with their outcome reward).

Every episode runs through the agent loop's batch graph (:func:`agent.loop.batch.arun_states`), so its
trajectory holds the prompt as prompt tokens and the policy's turn as policy tokens (the only trained ones);
the prompt goes through the model's chat template as the search mode's does (``agent.chat_template``), or
is the one-line prompt of the tiny policy (``agent.short_prompt``). Each trajectory says its mode in
``metadata["mode"]`` (``parametric``, ``search``, ``decision``); a decision's verdict holds ``decision``
(``answer`` / ``search`` / ``None``), ``known`` and ``format_ok``, and its turn's action is ``decision``.

**Inference** (:func:`adaptive_episodes`): one decision episode per question; ``answer`` routes the
question to a parametric-mode episode, ``search`` (or an unparseable decision: searching is the safe side)
to a search-mode episode. The step's ``em`` in the training log mixes the modes (decision episodes have no
EM); the ``adasearch/...`` statistics split them.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import torch

from agent.llm import run_sync
from agent.loop.batch import arun_states
from agent.loop.nodes import make_context, new_episode
from agent.protocols.base import user_message_ids
from agent.trajectory import Trajectory
from corpora.formats import QAExample
from training.algos.knowledge_boundary import (
    DECISION_STOP,
    AdaSearchOptions,
    adasearch_split,
    decision_prompt,
    decision_rewards,
    f1_aware,
    known_questions,
    parametric_prompt,
    parse_decision,
)

PARAMETRIC, SEARCH, DECISION = "parametric", "search", "decision"
NO_DECISION = "no single <decision> answer </decision> or <decision> search </decision>"


def _unscored(traj: Trajectory) -> tuple[float, dict[str, Any]]:
    """The judge of decision episodes: scored after the run, once the labels are known."""
    return 0.0, {}


def one_turn_episodes(worker: Any, tasks: list[tuple[QAExample, int]], mode: str) -> list[Trajectory]:
    """One-turn episodes without a retriever, one per ``(question, group)`` of ``tasks``, in order: ``mode``
    ``parametric`` (the parametric prompt, the protocol's stop strings, scored by the worker's judge; a
    search action is recorded as an invalid turn, for no tool answers it) or ``decision`` (the decision
    prompt, stopped at ``</decision>``, reward 0 until :func:`score_decisions`). Raises ``ValueError`` for
    another mode."""
    if mode not in (PARAMETRIC, DECISION):
        raise ValueError(f"a one-turn AdaSearch episode is parametric or decision, got {mode!r}")
    if not tasks:
        return []
    cfg = worker.agent.model_copy(update={"max_turns": 1})
    short = bool(getattr(cfg, "short_prompt", False))
    judge = worker.judge if mode == PARAMETRIC else _unscored
    ctx = make_context(worker.llm, None, cfg, top_k=worker.top_k, judge=judge)
    prompt = parametric_prompt if mode == PARAMETRIC else decision_prompt
    if mode == DECISION:
        ctx.params = replace(ctx.params, stop=(DECISION_STOP,))
    states = []
    for ex, g in tasks:
        st = new_episode(ctx, ex, g, prompt_ids=user_message_ids(ctx.tokenizer, prompt(ex.question, short), cfg))
        st["traj"].metadata["mode"] = mode
        states.append(st)
    trajs = run_sync(arun_states(ctx, states))
    for t in trajs:
        for turn in t.turns:
            if mode == PARAMETRIC and turn.action == "search":
                turn.action, turn.query, turn.error = "invalid", None, "a search in parametric mode (no tool)"
    return trajs


def correct(traj: Trajectory) -> bool:
    """Whether an episode's answer is right (the judge's exact match)."""
    return float(traj.verdict.get("em", 0.0)) > 0.0


def em_rate(trajs: list[Trajectory]) -> float:
    """The exact-match rate of ``trajs`` (0 for none)."""
    return sum(map(correct, trajs)) / len(trajs) if trajs else 0.0


def stage1_groups(worker: Any, questions: list[QAExample], group_size: int,
                  opts: AdaSearchOptions) -> tuple[list[Trajectory], dict[str, float]]:
    """Stage 1 (see the module docstring): per question ``i``, its search-mode episodes (group ``i``) and its
    parametric-mode episodes (group ``Q + i``), :func:`training.algos.knowledge_boundary.adasearch_split` of
    ``group_size``. Returns ``(trajectories, stats)`` with ``adasearch/stage`` (1), the episodes of each mode
    (``adasearch/parametric_episodes``, ``adasearch/search_episodes``), ``adasearch/parametric_em`` and
    ``adasearch/search_em`` (the modes' exact-match rates, 0 for a mode without episodes)."""
    n_par, n_search = adasearch_split(group_size, opts.parametric_share)
    Q = len(questions)
    search = worker.episodes(questions, n_search) if n_search else []
    for t in search:
        t.metadata["mode"] = SEARCH
    par = one_turn_episodes(worker, [(q, Q + i) for i, q in enumerate(questions) for _ in range(n_par)], PARAMETRIC)
    stats = {"adasearch/stage": 1.0, "adasearch/parametric_episodes": float(len(par)),
             "adasearch/search_episodes": float(len(search)), "adasearch/parametric_em": em_rate(par),
             "adasearch/search_em": em_rate(search)}
    return search + par, stats


def score_decisions(decs: list[Trajectory], known: torch.Tensor, format_penalty: float) -> list[str | None]:
    """Score decision episodes in place against ``known`` (``[Q]`` bool, indexed by each episode's group):
    reward :func:`training.algos.knowledge_boundary.decision_rewards`, verdict ``decision``, ``known``,
    ``format_ok``; the turn's action becomes ``decision`` (its error: no parseable decision). Failed episodes
    (``stop_reason="error"``) keep their failure. Returns each episode's decision (``None``: unparseable)."""
    decisions = [parse_decision(t.turns[-1].text) if t.turns else None for t in decs]
    labels = known[[t.group for t in decs]] if decs else torch.zeros(0, dtype=torch.bool)
    rewards = decision_rewards(decisions, labels, format_penalty).tolist()
    for t, d, k, r in zip(decs, decisions, labels.tolist(), rewards, strict=True):
        if t.stop_reason == "error":
            continue
        t.reward = r
        t.verdict = {"decision": d, "known": k, "format_ok": d is not None}
        if t.turns:
            t.turns[-1].action, t.turns[-1].error = "decision", None if d is not None else NO_DECISION
        if d is not None:
            t.stop_reason = DECISION
    return decisions


def stage2_groups(worker: Any, questions: list[QAExample], group_size: int,
                  opts: AdaSearchOptions) -> tuple[list[Trajectory], dict[str, float]]:
    """Stage 2 (see the module docstring): ``K`` parametric-mode episodes per question label it, then its
    ``group_size`` decision episodes (group ``i``) are scored against the label. Returns ``(trajectories,
    stats)``: the decision episodes (and the parametric ones, group ``Q + i``, with ``train_label_rollouts``);
    stats ``adasearch/stage`` (2), ``adasearch/parametric_episodes`` and ``adasearch/decisions`` (episodes run),
    ``adasearch/known_share`` (of the questions), ``adasearch/parametric_em``
    (of the label rollouts), ``adasearch/answer_share`` (decisions saying ``answer``),
    ``adasearch/decision_format_ok``, ``adasearch/decision_reward`` (mean) and ``adasearch/f1_aware``
    (:func:`training.algos.knowledge_boundary.f1_aware` of the decisions against their questions' labels).
    A failed parametric episode counts as a wrong answer."""
    Q, K = len(questions), opts.label_rollouts
    par = one_turn_episodes(worker, [(q, Q + i) for i, q in enumerate(questions) for _ in range(K)], PARAMETRIC)
    right = torch.tensor([correct(t) for t in par], dtype=torch.float32).view(Q, K)
    known = known_questions(right, opts.known_threshold)
    decs = one_turn_episodes(worker, [(q, i) for i, q in enumerate(questions) for _ in range(group_size)], DECISION)
    decisions = score_decisions(decs, known, opts.format_penalty)
    labels = [bool(known[t.group]) for t in decs]
    n = max(len(decs), 1)
    stats = {"adasearch/stage": 2.0, "adasearch/parametric_episodes": float(len(par)),
             "adasearch/decisions": float(len(decs)), "adasearch/known_share": float(known.float().mean()),
             "adasearch/parametric_em": float(right.mean()),
             "adasearch/answer_share": sum(d == "answer" for d in decisions) / n,
             "adasearch/decision_format_ok": sum(d is not None for d in decisions) / n,
             "adasearch/decision_reward": sum(t.reward for t in decs) / n,
             "adasearch/f1_aware": f1_aware(decisions, labels)}
    return decs + (par if opts.train_label_rollouts else []), stats


def adasearch_groups(worker: Any, questions: list[QAExample], group_size: int, opts: AdaSearchOptions,
                     rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    """The step's groups of the stage ``opts.stage`` (:func:`stage1_groups` or :func:`stage2_groups`).
    Raises ``ValueError`` for an external agent (the modes are prompts of the built-in loop)."""
    if worker.external is not None:
        raise ValueError("train.rollout.strategy=adasearch runs its modes in the built-in agent loop: set "
                         "agent.kind=builtin")
    fn = stage1_groups if opts.stage == 1 else stage2_groups
    return fn(worker, questions, group_size, opts)


def adaptive_episodes(worker: Any, questions: list[QAExample]) -> list[Trajectory]:
    """AdaSearch at inference: per question one decision episode, then a parametric-mode episode where it
    said ``answer`` and a search-mode episode otherwise (``search`` or an unparseable decision), in the order
    of ``questions``, each with ``metadata["decision"]`` (``None``: unparseable). Sampling follows
    ``worker.agent`` (``temperature=0`` for greedy)."""
    decs = one_turn_episodes(worker, [(q, i) for i, q in enumerate(questions)], DECISION)
    decisions = {t.group: parse_decision(t.turns[-1].text) if t.turns else None for t in decs}
    answer = [i for i in range(len(questions)) if decisions.get(i) == "answer"]
    rest = [i for i in range(len(questions)) if decisions.get(i) != "answer"]
    par = one_turn_episodes(worker, [(questions[i], i) for i in answer], PARAMETRIC)
    search = worker.episodes([questions[i] for i in rest], 1) if rest else []
    for t in search:
        t.group = rest[t.group]
        t.metadata["mode"] = SEARCH
    out = sorted(par + search, key=lambda t: t.group)
    for t in out:
        t.metadata["decision"] = decisions.get(t.group)
    return out
