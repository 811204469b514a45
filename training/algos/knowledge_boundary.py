"""Knowledge-boundary rewards: answer from parametric knowledge when it suffices, search when it does not.

**IKEA** (Huang et al., 2025, "Reinforced Internal-External Knowledge Synergistic Reasoning for Efficient
Adaptive Search Agent", arXiv 2505.07596). One reward (:func:`ikea_rewards`) over ``RT``, the episode's search
calls:

* ``-1`` when the format is invalid;
* ``1 + r_kb+ * (1 - min(RT, RT_max) / RT_max)`` for a correct answer (fewer searches, more reward);
* ``r_kb-`` for a wrong answer that searched at least once, 0 for a wrong answer without search (a question
  beyond the model's knowledge is better met with a search than with a guess);

defaults ``r_kb+ = 0.6``, ``r_kb- = 0.05``, ``RT_max = 3`` (so 1.6 / 1.4 / 1.2 / 1.0 for 0 / 1 / 2 / 3+
searches). Its training set mixes questions the model knows and does not know in equal shares
(:func:`boundary_mix`, with :func:`known_questions` from answers sampled without search). Reference
implementation followed: ``compute_score_em`` in ``verl/utils/reward_score/qa_em.py`` of the authors'
repository (hzy312/knowledge-r1).

**AdaSearch** (Lin et al., 2025, "AdaSearch: Balancing Parametric Knowledge and Search in Large Language
Models via Reinforcement Learning", arXiv 2512.16883). Problem solving and the decision to search are two
stages: stage 1 trains the policy to answer in a parametric mode (:func:`parametric_prompt`, no tools) and in
the search mode (the ordinary agent), each with the outcome reward; stage 2 trains an explicit, readable
decision (:func:`decision_prompt`, ``<decision> answer </decision>`` or ``<decision> search </decision>``,
:func:`parse_decision`) with an outcome-derived reward: the decision is right when it says ``answer`` for a
question the policy can answer without search and ``search`` otherwise (:func:`decision_rewards`). Whether
the policy "can answer without search" is read from the parametric-mode rollouts of the same question
(:func:`known_questions`: their EM rate at least ``known_threshold``). The paper's metric of self-knowledge
awareness is :func:`f1_aware` (F1 of the ``answer`` decisions against that label). The authors' code was
released as a SkyRL submodule that could not be read here; the prompts, tags and the 0.5 threshold are
Sleuth's reading of the paper, not its released code.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from training.algos.options import check_range, parse_options
from training.registry import Options


# -- IKEA --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IKEAOptions(Options):
    """IKEA's reward constants: ``r_kb_pos`` (``r_kb+``), ``r_kb_neg`` (``r_kb-``), ``rt_max`` and the
    ``format_penalty``. Raises ``ValueError`` for a negative ``r_kb+``, ``r_kb-`` outside [0, 1) (a wrong answer
    must score below a correct one), ``rt_max < 1`` or a positive format penalty."""

    r_kb_pos: float = 0.6
    r_kb_neg: float = 0.05
    rt_max: int = 3
    format_penalty: float = -1.0

    def __post_init__(self) -> None:
        check_range("IKEA's r_kb_pos", self.r_kb_pos, 0.0)
        check_range("IKEA's r_kb_neg", self.r_kb_neg, 0.0, 1.0, hi_open=True)
        if self.rt_max < 1:
            raise ValueError(f"IKEA's rt_max must be >= 1 search, got {self.rt_max}")
        check_range("IKEA's format_penalty", self.format_penalty, None, 0.0)


def ikea_options(values: dict[str, Any] | None = None) -> IKEAOptions:
    """:class:`IKEAOptions` from a mapping; ``ValueError`` for an unknown name or a value out of range."""
    return parse_options(IKEAOptions, values, "IKEA")


def ikea_rewards(correct: torch.Tensor, format_ok: torch.Tensor, searches: torch.Tensor,
                 opts: IKEAOptions) -> torch.Tensor:
    """IKEA's knowledge-boundary aware reward, ``[N]`` float32 (see the module docstring). ``correct``,
    ``format_ok``: ``[N]`` bool or 0/1; ``searches``: ``[N]`` int, the search calls of each episode."""
    rt = searches.float().clamp(min=0.0)
    right = 1.0 + opts.r_kb_pos * (1.0 - rt.clamp(max=float(opts.rt_max)) / opts.rt_max)
    wrong = torch.where(rt > 0, torch.full_like(rt, opts.r_kb_neg), torch.zeros_like(rt))
    r = torch.where(correct.bool(), right, wrong)
    return torch.where(format_ok.bool(), r, torch.full_like(r, opts.format_penalty))


def known_questions(correct: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """``[Q]`` bool: the questions the policy knows, from ``correct`` ``[Q, K]`` (0/1 EM of ``K`` answers
    sampled per question without search): EM rate ``>= threshold``. Raises ``ValueError`` for a threshold
    outside (0, 1] or a tensor that is not ``[Q, K]`` with ``K >= 1``."""
    check_range("the known-question threshold", threshold, 0.0, 1.0, lo_open=True)
    if correct.dim() != 2 or correct.shape[1] < 1:
        raise ValueError(f"correct must be [Q, K] with K >= 1 answers per question, got {tuple(correct.shape)}")
    return correct.float().mean(-1) >= threshold


def boundary_mix(known: Sequence[bool], n: int, rng: random.Random, known_share: float = 0.5) -> list[int]:
    """IKEA's knowledge-boundary aware training set: the indices of ``n`` questions, ``round(n * known_share)``
    drawn from the known ones and the rest from the unknown ones (each without replacement, then shuffled
    together). Raises ``ValueError`` when either side has too few questions."""
    check_range("known_share", known_share, 0.0, 1.0)
    yes = [i for i, k in enumerate(known) if k]
    no = [i for i, k in enumerate(known) if not k]
    n_yes = round(n * known_share)
    if n_yes > len(yes) or n - n_yes > len(no):
        raise ValueError(f"a mix of {n_yes} known and {n - n_yes} unknown questions needs more than the "
                         f"{len(yes)} known and {len(no)} unknown ones available")
    out = rng.sample(yes, n_yes) + rng.sample(no, n - n_yes)
    rng.shuffle(out)
    return out


# -- AdaSearch ---------------------------------------------------------------------------------------------
STAGES = (1, 2)


@dataclass(frozen=True)
class AdaSearchOptions(Options):
    """AdaSearch's two-stage recipe as one rollout strategy (``train.rollout.strategy=adasearch``), one stage
    per run; stage 2 is a new run (its own ``out_dir``) from stage 1's weights (``policy.model=<stage-1
    out_dir>/<run>/checkpoints/latest``).

    * ``stage``: 1 (problem solving: parametric-mode and search-mode episodes, outcome reward) or 2 (the
      decision: decision episodes rewarded by :func:`decision_rewards`);
    * ``parametric_share``: stage 1, the share of each question's ``group_size`` rollouts run in parametric
      mode (``round(group_size * share)``, halves up; the rest search), in [0, 1];
    * ``label_rollouts`` ``K``: stage 2, parametric-mode rollouts per question that label it known, >= 1;
    * ``known_threshold``: stage 2, a question is known when at least this share of its ``K`` parametric
      rollouts is right (EM), in (0, 1];
    * ``format_penalty``: stage 2, the reward of a decision without exactly one ``<decision> answer|search
      </decision>``, <= 0;
    * ``train_label_rollouts``: stage 2, whether the ``K`` parametric rollouts are trained too (their own
      group per question, outcome reward) or only label the question (the default: stage 2 trains the
      decision alone, as the paper's second stage).

    Raises ``ValueError`` for a value out of range (and ``parametric_share`` against ``group_size`` when the
    rollout section is validated: :func:`adasearch_split`)."""

    stage: int = 1
    parametric_share: float = 0.5
    label_rollouts: int = 4
    known_threshold: float = 0.5
    format_penalty: float = 0.0
    train_label_rollouts: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ValueError(f"AdaSearch's stage must be 1 (problem solving) or 2 (the search decision), got "
                             f"{self.stage!r}")
        check_range("AdaSearch's parametric_share", self.parametric_share, 0.0, 1.0)
        if isinstance(self.label_rollouts, bool) or self.label_rollouts < 1:
            raise ValueError(f"AdaSearch's label_rollouts K must be >= 1 parametric rollout per question, got "
                             f"{self.label_rollouts!r}")
        check_range("AdaSearch's known_threshold", self.known_threshold, 0.0, 1.0, lo_open=True)
        check_range("AdaSearch's format_penalty", self.format_penalty, None, 0.0)


def adasearch_options(values: dict[str, Any] | None = None) -> AdaSearchOptions:
    """:class:`AdaSearchOptions` from a mapping; ``ValueError`` for an unknown name or a value out of range."""
    return parse_options(AdaSearchOptions, values, "AdaSearch")


def adasearch_split(group_size: int, parametric_share: float) -> tuple[int, int]:
    """Stage 1's ``(parametric, search)`` rollouts of a question's ``group_size``: ``floor(group_size * share
    + 1/2)`` parametric, the rest search. Raises ``ValueError`` when a share strictly between 0 and 1 leaves
    either mode without a rollout (``group_size`` too small for the share)."""
    n_par = int(group_size * parametric_share + 0.5)
    n_par = min(max(n_par, 0), group_size)
    if 0.0 < parametric_share < 1.0 and not 0 < n_par < group_size:
        raise ValueError(f"AdaSearch's parametric_share={parametric_share} of group_size={group_size} rollouts "
                         f"gives {n_par} parametric and {group_size - n_par} search rollouts: both modes need one; "
                         "raise train.rollout.group_size or set the share to 0 or 1")
    return n_par, group_size - n_par


PARAMETRIC_PROMPT = (
    "Answer the given question from your own knowledge, without any search. Reason inside <think> and "
    "</think>, then give the answer inside <answer> and </answer>, for example <answer> Beijing </answer>. "
    "Question: {question}\n"
)
DECISION_PROMPT = (
    "Decide whether your own knowledge is enough to answer the given question or whether you need to search. "
    "Explain your reasons briefly inside <think> and </think>, then write <decision> answer </decision> if you "
    "can answer from your own knowledge or <decision> search </decision> if you need a search engine. "
    "Question: {question}\n"
)
# the one-line prompts of the tiny from-scratch policy (``agent.short_prompt``), as the search mode's
# ``Question: ...`` line with the mode named in front of it
PARAMETRIC_SHORT_PROMPT = "Without search. Question: {question}\n"
DECISION_SHORT_PROMPT = "Answer or search? Question: {question}\n"
DECISIONS = ("answer", "search")
DECISION_STOP = "</decision>"
_DECISION_RE = re.compile(r"<decision>(.*?)</decision>", re.DOTALL)


def parametric_prompt(question: str, short: bool = False) -> str:
    """AdaSearch's parametric-mode prompt (no tools; the episode is one turn ending with ``<answer>``).
    ``short``: the one-line prompt of the tiny policy."""
    return (PARAMETRIC_SHORT_PROMPT if short else PARAMETRIC_PROMPT).format(question=" ".join(question.split()))


def decision_prompt(question: str, short: bool = False) -> str:
    """AdaSearch's decision-stage prompt (one turn ending with ``<decision>``). ``short``: the one-line prompt
    of the tiny policy."""
    return (DECISION_SHORT_PROMPT if short else DECISION_PROMPT).format(question=" ".join(question.split()))


def parse_decision(text: str) -> str | None:
    """``"answer"``, ``"search"`` or ``None``: the content of the only ``<decision>`` tag of ``text``
    (whitespace and case ignored); ``None`` when there is no tag, more than one, or another word in it."""
    found = _DECISION_RE.findall(text or "")
    if len(found) != 1:
        return None
    word = " ".join(found[0].lower().split())
    return word if word in DECISIONS else None


def decision_rewards(decisions: Sequence[str | None], known: torch.Tensor, format_penalty: float = 0.0) -> torch.Tensor:
    """AdaSearch's decision reward, ``[N]`` float32: 1 for ``answer`` on a known question or ``search`` on an
    unknown one, 0 for the other way round, ``format_penalty`` for an unparseable decision (``None``).
    ``known``: ``[N]`` bool (:func:`known_questions` of each decision's question). Raises ``ValueError`` for
    lists of different lengths or a decision that is not one of :data:`DECISIONS`."""
    if len(decisions) != len(known):
        raise ValueError(f"{len(decisions)} decisions for {len(known)} labels")
    out = []
    for d, k in zip(decisions, known.bool().tolist(), strict=True):
        if d is None:
            out.append(format_penalty)
        elif d not in DECISIONS:
            raise ValueError(f"a decision must be one of {DECISIONS} or None, got {d!r}")
        else:
            out.append(float((d == "answer") == k))
    return torch.tensor(out, dtype=torch.float32)


def f1_aware(decisions: Sequence[str | None], known: Sequence[bool]) -> float:
    """AdaSearch's F1_aware: the F1 of deciding ``answer`` (no search) against the questions the policy knows.
    Precision over the ``answer`` decisions, recall over the known questions; an unparseable decision counts
    as no ``answer``. 0.0 when there is neither an ``answer`` decision nor a known question."""
    if len(decisions) != len(known):
        raise ValueError(f"{len(decisions)} decisions for {len(known)} labels")
    pred = [d == "answer" for d in decisions]
    tp = sum(p and k for p, k in zip(pred, known, strict=True))
    fp = sum(p and not k for p, k in zip(pred, known, strict=True))
    fn = sum(k and not p for p, k in zip(pred, known, strict=True))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
