"""Search self-play's rollout (Lu et al., 2025, "Search Self-play", arXiv 2510.18821): one shared policy in two
roles, told apart by their prompts, as in the paper's setting (one model plays proposer and solver).

Per step, each question of the stream gives only its *answer* (the seed; its question is never shown):

1. **proposer**: ``P`` episodes per seed with the normal agent loop and retriever, whose task text is the
   proposer's instruction with the answer (:func:`training.algos.ssp.proposer_prompt`); its final answer is
   the proposed question (:func:`training.algos.ssp.extract_question`);
2. **filter**: :func:`training.algos.ssp.proposal_rejection` (length, the answer not in the question, enough
   distinct searches, some retrieved material), then **RAG verification**: the policy, greedy and without
   search, answers the question from all the documents the proposer retrieved
   (:func:`training.algos.ssp.rag_prompt`, optionally mixed with other proposals' documents); only an exact
   match with the seed answer makes the question valid (:func:`training.algos.ssp.rag_verified`);
3. **solver**: ``group_size`` searching episodes per valid question (the normal agent and judge, gold = the
   seed answer), one group per question;
4. **rewards**: the solver's are the judge's; a proposer's is
   :func:`training.algos.ssp.proposer_rewards` of its question's validity and the solver's success rate
   (the share of its attempts with exact match; the reference counts ``reward > 0``, which a format reward
   would make true for wrong answers).

Both roles' trajectories go into the same update, each marked ``metadata["role"]`` (``"proposer"`` /
``"solver"``). Their advantages come from the run's estimator over their groups: a seed's ``P`` proposals
form one group (so GRPO compares proposals of the same answer) and a question's solver attempts another.
The reference trains the proposer with REINFORCE++ over the batch and alternates the roles' updates; here
the roles share one update and the configured estimator (GRPO by default). Followed: ``SSPRayTrainer.
_compute_proposer_rewards`` (``quarl/trainer/ppo/ssp_ray_trainer.py``) and ``SearchProblemExtractor``
(``quarl/utils/problem_extraction.py``) of Alibaba-Quark/SSP.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import torch

from agent.llm import SamplingParams, generate_requests
from agent.protocols.build import make_protocol
from agent.trajectory import Trajectory
from corpora.formats import QAExample
from training.algos.ssp import (
    SSPOptions,
    extract_question,
    mix_noisy_materials,
    proposal_rejection,
    proposer_prompt,
    proposer_rewards,
    rag_materials,
    rag_prompt,
    rag_verified,
    success_rates,
)


def seed_answer(q: QAExample) -> str:
    """The seed of a training question: its first gold answer (the question itself is not used)."""
    return q.golden_answers[0] if q.golden_answers else ""


def search_turns(traj: Trajectory) -> tuple[list[str], list[str | None]]:
    """A proposer's search queries and the observations they returned, in order."""
    turns = [t for t in traj.turns if t.action == "search"]
    return [t.query or "" for t in turns], [t.observation for t in turns]


def rag_answers(worker: Any, questions: list[str], materials: list[str]) -> list[str | None]:
    """The policy's greedy answers to each question given its materials, one turn, no search (the agent's
    protocol prompt and parser). A prompt that leaves no room in ``agent.max_total_tokens`` for a turn gets
    ``None`` (not verified)."""
    cfg, llm = worker.agent, worker.llm
    proto = make_protocol(llm.tokenizer, cfg)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, top_p=1.0, stop=proto.stop_strings)
    reqs, where = [], []
    for i, (q, m) in enumerate(zip(questions, materials, strict=True)):
        ids = proto.prompt_ids(rag_prompt(q, m))
        room = cfg.max_total_tokens - len(ids)
        if room > 0:
            reqs.append((ids, replace(params, max_new_tokens=min(cfg.max_new_tokens, room))))
            where.append(i)
    out: list[str | None] = [None] * len(questions)
    for i, gen in zip(where, generate_requests(llm, reqs) if reqs else [], strict=True):
        action = proto.parse(gen.text, gen.finish_reason)
        out[i] = action.content if action.kind == "answer" else None
    return out


def ssp_groups(worker: Any, questions: list[QAExample], group_size: int, proposals: int, opts: SSPOptions,
               rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    """One SSP round on the seeds of ``questions`` (see the module docstring): ``proposals`` proposer episodes
    per seed (group = the seed's index), then ``group_size`` solver episodes per valid question (groups after
    the seeds'). Returns ``(trajectories, stats)`` with ``ssp/proposals``, ``ssp/valid_rate`` (valid
    questions per proposal), ``ssp/filter_pass_rate`` (questions that passed the filter), ``ssp/rag_pass_rate``
    (of those, verified by RAG), ``ssp/solver_em`` and ``ssp/proposer_reward``. Raises ``ValueError`` for an
    external agent."""
    if worker.external is not None:
        raise ValueError("train.rollout.strategy=ssp runs the built-in agent loop: set agent.kind=builtin")
    short = bool(getattr(worker.agent, "short_prompt", False))
    seeds = [seed_answer(q) for q in questions]
    tasks = [QAExample(f"ssp-propose-{q.id}", proposer_prompt(s, short), [s], {"dataset": "ssp"})
             for q, s in zip(questions, seeds, strict=True)]
    props = worker.episodes(tasks, proposals)
    asked = [extract_question(t.answer) if t.stop_reason == "answer" else None for t in props]
    searched = [search_turns(t) for t in props]
    passed = [proposal_rejection(q, seeds[t.group], qs, obs, opts) is None
              for q, t, (qs, obs) in zip(asked, props, searched, strict=True)]
    mats = [rag_materials(obs) for _, obs in searched]
    cand = [i for i, ok in enumerate(passed) if ok]
    noisy = [mix_noisy_materials(mats[i], [mats[j] for j in cand if j != i], opts.noisy_materials, rng) for i in cand]
    answers = rag_answers(worker, [asked[i] for i in cand], noisy)
    valid = [False] * len(props)
    for i, a in zip(cand, answers, strict=True):
        valid[i] = rag_verified(a, seeds[props[i].group])
    solve_rows = [i for i, ok in enumerate(valid) if ok]
    solve_tasks = [QAExample(f"ssp-solve-{props[i].question_id}-{k}", asked[i], [seeds[props[i].group]],
                             {"dataset": "ssp"}) for k, i in enumerate(solve_rows)]
    solvers = worker.episodes(solve_tasks, group_size) if solve_tasks else []
    for t in solvers:
        t.group += len(questions)
        t.metadata["role"] = "solver"
    em = torch.tensor([float(t.verdict.get("em", 0.0)) for t in solvers])
    success = torch.zeros(len(props))
    if solve_rows:  # the solver's episodes come back grouped by question, in order
        success[solve_rows] = success_rates(em, group_size)
    rewards = proposer_rewards(torch.tensor(valid), success, opts)
    for t, r, q, ok, p in zip(props, rewards.tolist(), asked, valid, passed, strict=True):
        t.reward = r
        t.verdict = {"format_ok": t.verdict.get("format_ok", False), "ssp_filter": p, "ssp_valid": ok}
        t.metadata.update(role="proposer", proposed_question=q)
    n_cand = max(len(cand), 1)
    stats = {"ssp/proposals": float(len(props)), "ssp/valid_rate": len(solve_rows) / max(len(props), 1),
             "ssp/filter_pass_rate": len(cand) / max(len(props), 1), "ssp/rag_pass_rate": len(solve_rows) / n_cand,
             "ssp/solver_em": float(em.mean()) if len(em) else 0.0, "ssp/proposer_reward": float(rewards.mean())}
    return props + solvers, stats
