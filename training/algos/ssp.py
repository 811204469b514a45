"""Search self-play, SSP (Lu et al., 2025, "Search Self-play: Pushing the Frontier of Agent Capability without
Supervision", arXiv 2510.18821): one policy proposes questions and solves them, both by RL.

* **Proposer**: given an answer ``a*`` (from the corpus: no human question), it searches for facts that lead to
  it and writes a question whose answer is ``a*`` in its ``<answer>`` (:func:`proposer_prompt`,
  :func:`extract_question`).
* **Filter**: the question must be a real search question (length bounds, ``a*`` not in it, at least two
  distinct searches, some retrieved material; :func:`proposal_rejection`) and pass *RAG verification*: the
  policy, given all the documents the proposer retrieved (optionally shuffled with documents of other
  proposals) and no search tool, must answer it with ``a*`` (:func:`rag_materials`, :func:`rag_prompt`,
  :func:`mix_noisy_materials`, :func:`rag_verified`). A question that fails is worth ``format_penalty`` (-1)
  to its proposer and is not given to the solver.
* **Solver**: ``n`` searching episodes per valid question, rewarded by EM (the ordinary judge; GRPO).
* **Proposer reward** (:func:`proposer_rewards`): ``1 - s`` with ``s`` the solver's success rate (``1-acc``, a
  zero-sum game), or ``4 (l + s)(r - s)`` for ``0 < s < 1`` and 0 otherwise (``intermediate_difficulty``);
  the proposer's advantages are REINFORCE++'s over the batch.

Reference implementation followed (Alibaba-Quark/SSP): ``SearchProblemExtractor._is_valid_search_question``
and ``_validate_with_external_llm`` in ``quarl/utils/problem_extraction.py`` (10 to 1000 characters, at least
10 words, the answer not in the question, more than one search, no repeated query; the answer-in-queries
filter off by default; RAG verification by EM, falling back to an LLM judge) and
``SSPRayTrainer._compute_proposer_rewards`` in ``quarl/trainer/ppo/ssp_ray_trainer.py`` (success rate
``mean(solver_reward > 0)``, defaults of ``quarl/config/rl_config.yaml``: ``reward_type = "1-acc"``,
``format_penalty = -1``, ``left = 0``, ``right = 1``, ``noisy_RAG_materials = 0``). The prompts' wording is
Sleuth's. The 10-word minimum suits real questions; the synthetic task's questions have 4 to 8 words.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent.metrics import exact_match
from training.algos.options import check_range, parse_options

REWARD_TYPES = ("1-acc", "intermediate_difficulty")

PROPOSER_PROMPT = (
    "You are given an answer. Search for facts that lead to it, then write one question whose only correct "
    "answer is the given answer and that needs those searches to be solved; the question must not contain the "
    "answer. Reason inside <think> and </think>, search with <search> query </search> (the results appear "
    "between <information> and </information>), and write the question inside <answer> and </answer>. "
    "Answer: {answer}\n"
)
PROPOSER_SHORT_PROMPT = "Answer: {answer}\n"
RAG_PROMPT = (
    "Answer the question using only the documents below, without searching. Give the answer inside <answer> "
    "and </answer>.\nDocuments:\n{materials}\nQuestion: {question}\n"
)


@dataclass(frozen=True)
class SSPOptions:
    """SSP's options (see the module docstring): the proposer's ``reward_type``, ``left`` / ``right`` of
    ``intermediate_difficulty``, ``format_penalty`` of a rejected question, the question's length bounds
    (``min_question_chars``, ``max_question_chars``, ``min_question_words``), ``min_searches`` (distinct queries
    the proposer must have made), ``forbid_answer_in_queries`` and ``noisy_materials`` (other proposals'
    documents mixed into the RAG verification). Raises ``ValueError`` for an unknown reward type,
    ``left >= right``, a positive penalty, negative counts or ``max_question_chars < min_question_chars``."""

    reward_type: str = "1-acc"
    left: float = 0.0
    right: float = 1.0
    format_penalty: float = -1.0
    min_question_chars: int = 10
    max_question_chars: int = 1000
    min_question_words: int = 10
    min_searches: int = 2
    forbid_answer_in_queries: bool = False
    noisy_materials: int = 0

    def __post_init__(self) -> None:
        if self.reward_type not in REWARD_TYPES:
            raise ValueError(f"SSP's reward_type must be one of {REWARD_TYPES}, got {self.reward_type!r}")
        if not self.left < self.right:
            raise ValueError(f"SSP needs left < right, got left={self.left}, right={self.right}")
        check_range("SSP's format_penalty", self.format_penalty, None, 0.0)
        for name in ("min_question_chars", "min_question_words", "min_searches", "noisy_materials"):
            if getattr(self, name) < 0:
                raise ValueError(f"SSP's {name} must be >= 0, got {getattr(self, name)}")
        if self.max_question_chars < self.min_question_chars:
            raise ValueError(f"SSP's max_question_chars ({self.max_question_chars}) is below min_question_chars "
                             f"({self.min_question_chars})")


def ssp_options(values: dict[str, Any] | None = None) -> SSPOptions:
    """:class:`SSPOptions` from a mapping; ``ValueError`` for an unknown name or a value out of range."""
    return parse_options(SSPOptions, values, "SSP")


def proposer_prompt(answer: str, short: bool = False) -> str:
    """The proposer's prompt for the answer ``answer`` (``short``: the one-line prompt of the tiny policy)."""
    return (PROPOSER_SHORT_PROMPT if short else PROPOSER_PROMPT).format(answer=" ".join(answer.split()))


def extract_question(answer_text: str | None) -> str | None:
    """The proposed question: the proposer's final answer with stray answer tags removed and whitespace
    collapsed; ``None`` when nothing is left."""
    if answer_text is None:
        return None
    q = re.sub(r"</?\s*answer\s*>?", " ", answer_text)
    q = " ".join(q.split())
    return q or None


def _golds(gold: str | Sequence[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else [g for g in gold]


def proposal_rejection(question: str | None, gold: str | Sequence[str], queries: Sequence[str],
                       observations: Sequence[str | None], opts: SSPOptions) -> str | None:
    """Why a proposed question is not a valid search question (``None``: it passes, and goes on to RAG
    verification): no question, too short or long (characters), too few words, a gold answer in it (case
    ignored), no retrieved material, fewer than ``min_searches`` queries, a repeated query, or (with
    ``forbid_answer_in_queries``) a gold answer in a query. ``queries``: the proposer's search queries in
    order; ``observations``: the retrieved text of its turns (``None`` or empty for none)."""
    if not question:
        return "no question"
    n = len(question.strip())
    if n < opts.min_question_chars or n > opts.max_question_chars:
        return f"question of {n} characters (allowed {opts.min_question_chars}-{opts.max_question_chars})"
    if len(question.split()) < opts.min_question_words:
        return f"question of {len(question.split())} words (at least {opts.min_question_words})"
    golds = [g.lower() for g in _golds(gold) if g.strip()]
    if any(g in question.lower() for g in golds):
        return "the answer is in the question"
    if not rag_materials(observations):
        return "no retrieved material"
    qs = [q.strip() for q in queries if q and q.strip()]
    if len(qs) < opts.min_searches:
        return f"{len(qs)} searches (at least {opts.min_searches})"
    if len(qs) != len(set(qs)):
        return "a repeated query"
    if opts.forbid_answer_in_queries and any(g in q.lower() for g in golds for q in qs):
        return "the answer is in a query"
    return None


def rag_materials(observations: Sequence[str | None]) -> str:
    """The proposer's retrieved documents as one text: each non-empty observation (``<information>`` tags
    stripped when present), in order, separated by blank lines."""
    parts = []
    for o in observations:
        if not o:
            continue
        body = re.sub(r"</?information>", "", o).strip()
        if body:
            parts.append(body)
    return "\n\n".join(parts)


def mix_noisy_materials(materials: str, others: Sequence[str], n: int, rng: random.Random) -> str:
    """SSP's noisy RAG: ``materials`` and ``n`` materials drawn from ``others`` (other proposals' documents;
    all of them when fewer), shuffled together and joined by blank lines. ``n = 0``: ``materials`` itself."""
    if n <= 0 or not others:
        return materials
    parts = [materials, *rng.sample(list(others), min(n, len(others)))]
    rng.shuffle(parts)
    return "\n\n".join(parts)


def rag_prompt(question: str, materials: str) -> str:
    """The RAG verification prompt: the question with all the proposer's documents and no search tool."""
    return RAG_PROMPT.format(materials=materials.strip(), question=" ".join(question.split()))


def rag_verified(prediction: str | None, gold: str | Sequence[str]) -> bool:
    """Whether the RAG answer ``prediction`` is the gold answer (EM after SQuAD normalisation)."""
    return exact_match(prediction, _golds(gold)) == 1.0


def success_rates(solver_rewards: torch.Tensor, n: int) -> torch.Tensor:
    """``[P]``: each valid question's solver success rate ``mean(reward > 0)`` over its ``n`` attempts, from
    ``[P * n]`` rewards laid out question by question. Raises ``ValueError`` when the length is not a
    multiple of ``n``."""
    if n < 1 or solver_rewards.numel() % n:
        raise ValueError(f"{solver_rewards.numel()} solver rewards are not {n} attempts per question")
    return (solver_rewards.float().view(-1, n) > 0).float().mean(-1)


def proposer_rewards(valid: torch.Tensor, success: torch.Tensor, opts: SSPOptions) -> torch.Tensor:
    """The proposer's rewards ``[P]`` float32: ``format_penalty`` for a rejected question (``valid`` false);
    else ``1 - s`` (``1-acc``) or ``4 (l + s)(r - s)`` for ``0 < s < 1`` and 0 at ``s`` = 0 or 1
    (``intermediate_difficulty``). ``success``: ``[P]`` solver success rates (any value at invalid rows)."""
    s = success.float()
    if opts.reward_type == "1-acc":
        r = 1.0 - s
    else:
        mid = (s > 0) & (s < 1)
        r = torch.where(mid, 4.0 * (opts.left + s) * (opts.right - s), torch.zeros_like(s))
    return torch.where(valid.bool(), r, torch.full_like(r, opts.format_penalty))
