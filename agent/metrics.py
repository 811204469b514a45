"""Answer metrics: EM, F1 and cover-EM after SQuAD answer normalisation, max over golden answers.

Definitions follow the SQuAD v1.1 evaluation script (``normalize_answer``: lower-case, drop punctuation,
drop the articles a/an/the, collapse whitespace), as used by Search-R1 (``qa_em.py``) and FlashRAG.
cover-EM is Search-R1's "subEM": some normalised golden answer occurs inside the normalised prediction.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation, plus Unicode NFKC so that full-width and composed forms compare equal."""
    s = unicodedata.normalize("NFKC", s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str | None, golden_answers: list[str]) -> float:
    """1.0 if the normalised prediction equals some normalised golden answer, else 0.0."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golden_answers))


def cover_exact_match(prediction: str | None, golden_answers: list[str]) -> float:
    """1.0 if some non-empty normalised golden answer is a substring of the normalised prediction.

    A plain substring test, exactly as Search-R1's ``subem_check`` and FlashRAG's ``Sub_ExactMatch`` (so
    gold ``"1972"`` covers ``"19721"``); numbers stay comparable with published cover-EM/subEM. A golden
    answer that normalises to ``""`` (HotpotQA's ``"The The"``, NQ's ``"A+"``) matches only a prediction
    that also normalises to ``""``, as in :func:`exact_match` (so cover-EM >= EM), instead of matching
    everything.
    """
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(g in p if g else g == p for g in (normalize_answer(x) for x in golden_answers)))


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    # SQuAD/HotpotQA convention: yes/no/noanswer must match exactly
    if (normalize_answer(pred) in {"yes", "no", "noanswer"} or normalize_answer(gold) in {"yes", "no", "noanswer"}) and p != g:
        return 0.0
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golden_answers: list[str]) -> float:
    """Token-level F1 between normalised prediction and golden answer, max over golden answers."""
    if prediction is None:
        return 0.0
    return max((_f1(prediction, g) for g in golden_answers), default=0.0)


METRICS = {"em": exact_match, "f1": f1_score, "cover_em": cover_exact_match}


def rule_verdict(prediction: str | None, golden_answers: list[str]) -> dict[str, float]:
    """All three rule scores of one prediction: ``{"em", "f1", "cover_em"}`` in [0, 1]."""
    return {name: fn(prediction, golden_answers) for name, fn in METRICS.items()}
