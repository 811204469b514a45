"""SSRL (Fan et al., 2025, "SSRL: Self-Search Reinforcement Learning", arXiv 2508.10874): the policy plays the
search engine itself, answering its own queries from its parametric knowledge, trained with format and rule
rewards; the same policy is then run against a real retriever (sim-to-real).

Self-search is one generation pass: the prompt (:func:`self_search_prompt`) asks the policy to reason in
``<think>``, query in ``<search>`` and *write the search results itself* in ``<information>``, then answer in
``<answer>``; generation stops only at ``</answer>`` (:data:`STOP_STRINGS`). The self-written information is
context, not a target: its tokens are left out of the loss (:func:`information_spans`,
:func:`information_token_mask`), as the retrieved documents of an ordinary episode are. The reward is
``0.9 * EM + 0.1 * format`` (:func:`ssrl_reward`), with the format score of :func:`ssrl_format_score`: 0 unless
the response is ``<think>`` ... ``</answer>`` with every ``<search>`` followed by its ``<information>`` and no
empty or placeholder block, then ``min(n_think / max_turn, 1)``, scaled down when the thinks do not number one
more than the searches. Sim-to-real: the trained policy, with the same prompt, runs the ordinary agent loop
against the real index (generation stops at ``</search>`` and the retriever writes the information;
:func:`split_at_search` cuts a self-search response at its first query for the same substitution).

Reference implementation followed (TsinghuaC3I/SSRL): ``format_reward`` and ``NaiveRewardManager.__call__``
in ``verl/workers/reward_manager/naive.py`` (``all_score = em_score * 0.9 + format_score * 0.1``;
``max_turn = 2``, ``upper_bound = 8``), ``create_information_loss_mask`` in ``verl/trainer/ppo/ray_trainer.py``
and the sim-to-real branch of ``llm_agent/generation.py``; the prompt's wording here is Sleuth's.
``require_think=False`` is Sleuth's relaxation for a policy that writes no reasoning (the tiny benchmark
policy): the ``<think>`` checks are dropped and a well-formed response scores 1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.algos.options import check_range, parse_options
from training.registry import Options

SELF_SEARCH_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can search by writing "
    "<search> query </search>; you then act as the search engine yourself and write the top results for that "
    "query from your own knowledge between <information> and </information>. You can search as many times as "
    "you want. If you find no further knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
SHORT_PROMPT = "Question: {question}\n"
#: a self-search episode is one pass that ends at the answer
STOP_STRINGS = ("</answer>",)
_INFO_OPEN, _INFO_CLOSE = "<information>", "</information>"
_ALLOWED = {"think", "search", "information", "answer"}
_PLACEHOLDERS = {"think": "your thoughts", "search": "your query", "information": "your information",
                 "answer": "your answer"}


@dataclass(frozen=True)
class SSRLOptions(Options):
    """SSRL's reward options: ``em_weight`` and ``format_weight`` (``0.9 * EM + 0.1 * format``), ``max_turn``
    (thinks for a full format score), ``upper_bound`` (more thinks score 0) and ``require_think``. Raises
    ``ValueError`` for negative weights, weights that do not sum to 1, ``max_turn < 1`` or
    ``upper_bound < max_turn``."""

    em_weight: float = 0.9
    format_weight: float = 0.1
    max_turn: int = 2
    upper_bound: int = 8
    require_think: bool = True

    def __post_init__(self) -> None:
        check_range("SSRL's em_weight", self.em_weight, 0.0)
        check_range("SSRL's format_weight", self.format_weight, 0.0)
        if abs(self.em_weight + self.format_weight - 1.0) > 1e-9:
            raise ValueError(f"SSRL's em_weight + format_weight must be 1, got {self.em_weight} + {self.format_weight}")
        if self.max_turn < 1 or self.upper_bound < self.max_turn:
            raise ValueError(f"SSRL needs 1 <= max_turn <= upper_bound, got {self.max_turn} and {self.upper_bound}")


def ssrl_options(values: dict[str, Any] | None = None) -> SSRLOptions:
    """:class:`SSRLOptions` from a mapping; ``ValueError`` for an unknown name or a value out of range."""
    return parse_options(SSRLOptions, values, "SSRL")


def self_search_prompt(question: str, short: bool = False) -> str:
    """The self-search prompt (``short``: the one-line prompt of the tiny benchmark policy)."""
    q = " ".join(question.split())
    return (SHORT_PROMPT if short else SELF_SEARCH_PROMPT).format(question=q)


def information_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the ``<information> ... </information>`` blocks of ``text``, tags
    included; an unclosed last block runs to the end of the text."""
    out = []
    pos = 0
    while (start := text.find(_INFO_OPEN, pos)) >= 0:
        close = text.find(_INFO_CLOSE, start + len(_INFO_OPEN))
        end = len(text) if close < 0 else close + len(_INFO_CLOSE)
        out.append((start, end))
        pos = end
    return out


def information_token_mask(token_texts: Sequence[str]) -> list[bool]:
    """``[T]``: ``True`` for each token that overlaps a self-written information block (to leave out of the
    loss). ``token_texts``: the text of each generated token such that their concatenation is the response
    (e.g. ``decode(ids[:i+1])`` minus ``decode(ids[:i])``)."""
    spans = information_spans("".join(token_texts))
    out, pos = [], 0
    for piece in token_texts:
        lo, hi = pos, pos + len(piece)
        out.append(any(lo < e and s < hi for s, e in spans) if hi > lo else any(s <= lo < e for s, e in spans))
        pos = hi
    return out


def _blocks_ok(response: str) -> bool:
    for tag in _ALLOWED:
        for content in re.findall(rf"<{tag}>(.*?)</{tag}>", response, re.DOTALL):
            if not content.strip() or _PLACEHOLDERS[tag] in content.lower():
                return False
            if tag == "search" and len(content.split("\n")) != 1:
                return False
    return True


def _searches_paired(middle: list[str]) -> bool:
    i = 0
    while i < len(middle):
        if middle[i] == "search":
            if middle[i + 1 : i + 4] != ["/search", "information", "/information"]:
                return False
            i += 4
        else:
            i += 1
    return True


def ssrl_format_score(response: str, opts: SSRLOptions | None = None) -> float:
    """SSRL's format score of a self-search response, in [0, 1] (see the module docstring): 0 for another tag
    than think / search / information / answer, a response that does not start with ``<think>`` (when
    ``require_think``) and end with ``</answer>``, fewer than 4 tags (2 without thinks), an empty or placeholder
    block or a multi-line query, a ``<search>`` not followed by ``</search><information></information>``, or
    unequal search and information counts; else ``min(n_think / max_turn, 1) * ratio`` with
    ``ratio = min(n_think, n_search + 1) / max(n_think, n_search + 1)``, and 0 past ``upper_bound`` thinks."""
    opts = opts or SSRLOptions()
    r = response.strip()
    if any(t.lstrip("/") not in _ALLOWED for t in re.findall(r"<([^>]+)>", r)):
        return 0.0
    if not r.endswith("</answer>") or (opts.require_think and not r.startswith("<think>")):
        return 0.0
    tags = re.findall(r"<(/?(?:think|search|information|answer))>", r)
    if len(tags) < (4 if opts.require_think else 2) or not _blocks_ok(r) or tags[-2:] != ["answer", "/answer"]:
        return 0.0
    if opts.require_think and tags[:2] != ["think", "/think"]:
        return 0.0
    if not _searches_paired(tags[2:-2] if opts.require_think else tags[:-2]):
        return 0.0
    n_think, n_search = r.count("<think>"), r.count("<search>")
    if n_search != r.count("<information>"):
        return 0.0
    if not opts.require_think:
        return 1.0
    if n_think > opts.upper_bound:
        return 0.0
    ratio = min(n_think, n_search + 1) / max(n_think, n_search + 1)
    return min(n_think / opts.max_turn, 1.0) * ratio


def ssrl_reward(em: float, format_score: float, opts: SSRLOptions | None = None) -> float:
    """``em_weight * EM + format_weight * format`` (SSRL's 0.9 / 0.1)."""
    opts = opts or SSRLOptions()
    return opts.em_weight * em + opts.format_weight * format_score


def split_at_search(response: str) -> tuple[str, str] | None:
    """``(prefix, query)``: a self-search response cut right after its first ``</search>`` (dropping the
    self-written information and all that follows) and the query, for a real retriever to answer; ``None``
    when the response never searched (or its first ``<search>`` is not closed)."""
    m = re.search(r"<search>(.*?)</search>", response, re.DOTALL)
    if m is None:
        return None
    return response[: m.end()], m.group(1).strip()
