"""Evaluation metrics: answer scores, retrieval recall, efficiency, and their aggregation.

The answer scores (EM, F1, cover-EM after SQuAD normalisation, max over golden answers) live in
:mod:`agent.judges`, because training rewards use them too; they are re-exported here so evaluation code
has one import. Training never imports :mod:`eval`.

A *prediction record* (one per question, written by :mod:`eval.methods` and cached by :mod:`eval.cache`) is
a dict with at least ``id``, ``prediction`` (str or None), ``golden_answers`` (list[str]),
``retrieved_ids`` (list[str], in retrieval order), ``search_calls``, ``turns``, ``generated_tokens`` (ints)
and ``wall_s`` (float, seconds); the runner adds ``supporting_ids`` (list[str] or None) and ``hops``
(int or None) from the example's metadata. A record judged by an LLM (:func:`eval.run.judge_records`,
:func:`agent.judges.judge_answers`) also has ``llm_correct`` (float), ``llm_verdict`` and ``llm_raw``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from agent.metrics import (  # noqa: F401  (re-exported)
    METRICS,
    cover_exact_match,
    exact_match,
    f1_score,
    normalize_answer,
    rule_verdict,
)

EFFICIENCY_FIELDS = ("search_calls", "turns", "generated_tokens", "wall_s")


def recall_at_k(retrieved_ids: Sequence[str], supporting_ids: Iterable[str] | None, k: int | None = None) -> float | None:
    """Fraction of the supporting paragraphs found among the first ``k`` distinct retrieved ids.

    ``retrieved_ids`` is in retrieval order and may repeat (an agent retrieves the same paragraph in two
    turns); duplicates are dropped before cutting at ``k``. ``k=None`` uses everything retrieved (the
    recall of the supporting paragraphs among everything the agent retrieved). Returns
    ``None`` when the question has no supporting ids (the dataset does not provide them), so callers
    average only over questions where recall is defined. Raises ``ValueError`` for ``k < 1``.
    """
    if k is not None and k < 1:
        raise ValueError(f"recall@k needs k >= 1, got {k}")
    gold = {str(s) for s in (supporting_ids or [])}
    if not gold:
        return None
    seen: dict[str, None] = {}
    for r in retrieved_ids:
        seen.setdefault(str(r), None)
    top = list(seen)[:k] if k is not None else list(seen)
    return len(gold.intersection(top)) / len(gold)


def score_record(record: dict[str, Any], recall_k: Sequence[int] = ()) -> dict[str, float | None]:
    """Per-question scores of one prediction record: ``em``, ``f1``, ``cover_em`` (in [0, 1]), ``recall``
    (over everything retrieved; ``None`` without supporting ids) and ``recall@k`` for each ``k`` in
    ``recall_k``. Raises ``KeyError`` naming a missing record field."""
    for key in ("prediction", "golden_answers"):
        if key not in record:
            raise KeyError(f"prediction record {record.get('id')!r} has no field {key!r}")
    out: dict[str, float | None] = dict(rule_verdict(record["prediction"], list(record["golden_answers"])))
    retrieved = record.get("retrieved_ids") or []
    support = record.get("supporting_ids")
    out["recall"] = recall_at_k(retrieved, support)
    for k in recall_k:
        out[f"recall@{k}"] = recall_at_k(retrieved, support, k)
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


JUDGED = ("correct", "incorrect", "unparseable", "error")  # verdicts of answers that were sent to the judge


def judge_score(record: dict[str, Any]) -> float | None:
    """The LLM-judge score of a record: its ``llm_correct``, else the agent loop's ``verdict["llm_correct"]``
    (an agent run with ``agent.judge: llm``), else ``None`` (not judged)."""
    v = record.get("llm_correct")
    if v is None and isinstance(record.get("verdict"), dict):
        v = record["verdict"].get("llm_correct")
    return None if v is None else float(v)


def _judge_verdict(record: dict[str, Any]) -> str | None:
    if record.get("llm_correct") is not None:
        return record.get("llm_verdict")
    return record["verdict"].get("llm_verdict") if isinstance(record.get("verdict"), dict) else None


def aggregate(records: Sequence[dict[str, Any]], recall_k: Sequence[int] = (), by_hops: bool = True) -> dict[str, Any]:
    """Means over a benchmark's prediction records.

    Returns ``{"n", "em", "f1", "cover_em", "recall", "n_recall", "recall@k"..., "search_calls", "turns",
    "generated_tokens", "wall_s", "judge_acc", "n_judged", "judge_unparseable"}``: answer scores are means
    in [0, 1]; ``recall`` averages only over the ``n_recall`` questions that have supporting ids (``None``
    if none do); efficiency fields are means per question (``wall_s`` in seconds; a missing field counts
    as absent, not as 0). ``judge_acc`` is the mean LLM-judge score (:func:`judge_score`) over the
    ``n_judged`` records that have one (``None`` if none do; unanswered questions count as 0);
    ``judge_unparseable`` is the fraction of the answers sent to the judge whose verdict was unparseable
    or a backend error (``None`` if none were sent). With ``by_hops`` it also returns ``"by_hops": {hops:
    {"n", "em", "f1", "cover_em"}}`` over records whose ``hops`` is known (keys
    are strings, for JSON). An empty input gives ``n == 0`` and ``None`` means.
    """
    scores = [score_record(r, recall_k) for r in records]
    out: dict[str, Any] = {"n": len(records)}
    for name in ("em", "f1", "cover_em"):
        out[name] = _mean([s[name] for s in scores])  # type: ignore[misc]
    rec = [s["recall"] for s in scores if s["recall"] is not None]
    out["recall"] = _mean(rec)  # type: ignore[arg-type]
    out["n_recall"] = len(rec)
    for k in recall_k:
        out[f"recall@{k}"] = _mean([s[f"recall@{k}"] for s in scores if s[f"recall@{k}"] is not None])  # type: ignore[misc]
    for f in EFFICIENCY_FIELDS:
        vals = [float(r[f]) for r in records if r.get(f) is not None and not math.isnan(float(r[f]))]
        out[f] = _mean(vals)
    judged = [(j, _judge_verdict(r)) for r in records if (j := judge_score(r)) is not None]
    out["judge_acc"] = _mean([j for j, _ in judged])
    out["n_judged"] = len(judged)
    sent = [v for _, v in judged if v in JUDGED]
    out["judge_unparseable"] = _mean([float(v in ("unparseable", "error")) for v in sent])
    if by_hops:
        groups: dict[int, list[dict[str, float | None]]] = defaultdict(list)
        for r, s in zip(records, scores):
            if r.get("hops") is not None:
                groups[int(r["hops"])].append(s)
        out["by_hops"] = {
            str(h): {"n": len(g), **{m: _mean([s[m] for s in g]) for m in ("em", "f1", "cover_em")}}  # type: ignore[misc]
            for h, g in sorted(groups.items())
        }
    return out
