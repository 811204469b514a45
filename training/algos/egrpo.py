"""E-GRPO (Zhao et al., 2025, "Repurposing Synthetic Data for Fine-grained Search Agent Supervision", arXiv
2510.24694): entity-aware rewards that give a wrong answer partial credit for the gold entities its reasoning
found.

Entity-centric training questions are built from a chain of entities (the bridge entities a multi-hop
question hides); GRPO's 0/1 reward treats a "near miss" (every bridge entity found, wrong final answer) like a
rollout that understood nothing. E-GRPO's reward of rollout ``i`` of a group:

* ``gamma_i = |{e in E : e occurs in the rollout's own reasoning}| / |E|``, the entity match rate over the
  question's gold entities ``E`` (:func:`entity_match_rate`; the policy's turns only, not the retrieved
  documents: an entity counts when the policy wrote it, e.g. read it and searched it);
* ``gamma^_i = gamma_i / max_j gamma_j`` over the group (0 when no rollout matched any;
  :func:`normalized_match_rates`), so the partial credit is relative to what the group achieved;
* ``R_i = 1`` for a correct answer, ``alpha * gamma^_i`` for a wrong answer, 0 for a format error
  (:func:`egrpo_rewards`); the paper's ablation finds ``alpha`` about 0.3 best.

The authors published no code for it at the time of writing; this follows the paper's definitions. Fewer tool
calls are a reported side effect, not a term of the reward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent.metrics import normalize_answer
from agent.trajectory import Trajectory
from training.algos.options import check_range, parse_options
from training.registry import Options


@dataclass(frozen=True)
class EGRPOOptions(Options):
    """E-GRPO's options: ``alpha``, the weight of a wrong answer's normalised entity match rate (in [0, 1),
    so that a near miss never ties a correct answer). Raises ``ValueError`` outside it."""

    alpha: float = 0.3

    def __post_init__(self) -> None:
        check_range("E-GRPO's alpha", self.alpha, 0.0, 1.0, hi_open=True)


def egrpo_options(values: dict[str, Any] | None = None) -> EGRPOOptions:
    """:class:`EGRPOOptions` from a mapping; ``ValueError`` for an unknown name or a value out of range."""
    return parse_options(EGRPOOptions, values, "E-GRPO")


def _occurs(entity: str, padded_text: str) -> bool:
    e = normalize_answer(entity)
    return bool(e) and f" {e} " in padded_text


def entity_match_rate(text: str, entities: Sequence[str]) -> float:
    """``gamma``: the fraction of ``entities`` that occur in ``text`` after SQuAD normalisation, as whole word
    sequences (``"Rutevo"`` in ``"search Rutevo"``, not in ``"Rutevos"``). Duplicate entities count once; no
    entities (or only ones that normalise to nothing): 0.0."""
    uniq = list(dict.fromkeys(e for e in (normalize_answer(x) for x in entities) if e))
    if not uniq:
        return 0.0
    padded = f" {normalize_answer(text)} "
    return sum(_occurs(e, padded) for e in uniq) / len(uniq)


def reasoning_text(traj: Trajectory) -> str:
    """The policy's own text of an episode: every turn's generated text in order (queries and answers
    included), without the retrieved documents."""
    return "\n".join(t.text for t in sorted(traj.turns, key=lambda t: t.index))


def gold_entities(question: str, metadata: Mapping[str, Any],
                  titles_by_id: Mapping[str, str] | None = None) -> list[str]:
    """The gold entities ``E`` of a training question: ``metadata["entities"]`` when the data names them;
    else the entity chain of a synthetic question without its answer (``metadata["chain"][:-1]``); else the
    titles of its supporting passages (``titles_by_id`` maps ids to titles). Entities the question itself
    names are dropped (finding them is no progress). May be empty."""
    if "entities" in metadata:
        cands = list(metadata["entities"])
    elif "chain" in metadata:
        cands = list(metadata["chain"])[:-1]
    else:
        ids = metadata.get("supporting_ids") or []
        cands = [titles_by_id[i] for i in ids if titles_by_id and i in titles_by_id]
    padded_q = f" {normalize_answer(question)} "
    return [e for e in dict.fromkeys(cands) if normalize_answer(e) and not _occurs(e, padded_q)]


def normalized_match_rates(rates: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``gamma^_i = gamma_i / max_{j in group(i)} gamma_j``, ``[N]`` float32 (0 for a group whose best rate is
    0). ``rates``: ``[N]`` in [0, 1]; ``groups``: ``[N]`` int64."""
    rates = rates.float()
    uniq, inv = torch.unique(groups, return_inverse=True)
    best = torch.zeros(uniq.numel()).scatter_reduce(0, inv, rates, "amax", include_self=False)
    denom = best[inv]
    return torch.where(denom > 0, rates / denom.clamp(min=1e-12), torch.zeros_like(rates))


def egrpo_rewards(correct: torch.Tensor, format_ok: torch.Tensor, rates: torch.Tensor, groups: torch.Tensor,
                  opts: EGRPOOptions) -> torch.Tensor:
    """E-GRPO's rewards ``[N]`` float32: 1 where ``correct`` (and the format is valid), ``alpha * gamma^`` for
    a wrong answer in a valid format, 0 for a format error. ``correct``, ``format_ok``: ``[N]`` bool (or
    0/1); ``rates``: ``[N]`` entity match rates; ``groups``: ``[N]``. A correct answer in a broken format gets
    0, as the paper's error case."""
    ok = format_ok.bool()
    right = correct.bool() & ok
    partial = opts.alpha * normalized_match_rates(rates, groups)
    return torch.where(right, torch.ones_like(partial), torch.where(ok, partial, torch.zeros_like(partial)))
