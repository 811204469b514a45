"""What the evaluation methods share: the agent's task prompt, sampling settings, token budgets and the
prediction record every method returns (see :mod:`eval.methods`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from agent.config import AgentConfig
from agent.llm import LLM, SamplingParams, encode
from agent.protocols.base import format_docs
from corpora.formats import QAExample
from retrieval.base import Hit

Method = Callable[[list[QAExample]], list[dict[str, Any]]]
RAW_CHARS = 500
TAGS = re.compile(r"</?(think|search|answer|information)>")


def task_prompt(llm: LLM, question: str, cfg: AgentConfig) -> list[int]:
    # the agent's own prompt (chat template or Search-R1 instruction)
    from agent.protocols.build import prompt_ids

    return prompt_ids(llm.tokenizer, question, cfg)


def sampling(cfg: AgentConfig, temperature: float, seed: int | None, stop: tuple[str, ...], max_new: int | None = None) -> SamplingParams:
    """Sampling settings of one call: ``max_new`` new tokens per prompt (``None``: ``cfg.max_new_tokens``).
    Raises ``ValueError`` for ``max_new < 1`` (asking for no tokens is a caller's bug, not the whole budget)."""
    if max_new is not None and max_new < 1:
        raise ValueError(f"max_new must be at least 1 token, got {max_new}")
    return SamplingParams(
        max_new_tokens=cfg.max_new_tokens if max_new is None else max_new, temperature=temperature,
        top_p=cfg.top_p, stop=stop, seed=seed
    )


def extract_answer(text: str) -> str | None:
    """The answer in a continuation that started right after a forced ``<answer>`` tag: the text before
    ``</answer>`` (or all of it when the budget ran out first), stripped; ``None`` if empty."""
    ans = text.split("</answer>", 1)[0].replace("<answer>", "").strip()
    return ans or None


def check_tags_protocol(method: str, cfg: AgentConfig) -> None:
    """Raise ``ValueError`` when ``cfg`` makes the policy call tools natively (``agent.protocol:
    function_call``): ``method`` reads the model's ``<search>`` tags and would never see its tool calls."""
    if getattr(cfg, "protocol", "search_r1") != "search_r1":
        raise ValueError(f"method {method!r} reads Search-R1 <search> tags; it cannot run with "
                         f"agent.protocol={cfg.protocol} (use agent.protocol=search_r1, or the 'agent' method)")


def prediction_record(ex: QAExample, prediction: str | None, **kw: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": ex.id,
        "prediction": prediction,
        "golden_answers": list(ex.golden_answers),
        "retrieved_ids": [],
        "search_calls": 0,
        "turns": 0,
        "generated_tokens": 0,
        "wall_s": 0.0,
    }
    rec.update(kw)
    if isinstance(rec.get("raw"), str):
        rec["raw"] = rec["raw"][:RAW_CHARS]
    return rec


def set_wall(records: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    per = (time.perf_counter() - t0) / max(len(records), 1)
    for r in records:
        r["wall_s"] = per
    return records


def fit_tokens(llm: LLM, body: str, room: int) -> list[int]:
    """Token ids of ``body`` cut to ``room`` tokens (at least 0)."""
    return encode(llm.tokenizer, body)[: max(room, 0)]


def information_ids(llm: LLM, docs: list[Hit], cfg: AgentConfig, room: int) -> list[int]:
    """``<information>`` block of ``docs`` (Search-R1 rendering) whose body fits ``room`` tokens."""
    head, tail = encode(llm.tokenizer, "\n\n<information>"), encode(llm.tokenizer, "</information>\n\n")
    body = fit_tokens(llm, format_docs(docs, cfg.max_doc_chars), room - len(head) - len(tail))
    return head + body + tail


def trajectory_fields(tr: Any) -> dict[str, Any]:
    """The prediction-record fields of one agent episode (an :class:`agent.trajectory.Trajectory`):
    retrieved ids, search calls, turns, generated (policy) tokens, stop reason, the judge's verdict, the
    last turn's raw text and, for a failed episode, its error."""
    fields: dict[str, Any] = {
        "retrieved_ids": list(tr.retrieved_ids), "search_calls": tr.num_search_calls, "turns": tr.num_turns,
        "generated_tokens": tr.num_policy_tokens, "stop_reason": tr.stop_reason, "verdict": dict(tr.verdict),
        "raw": tr.turns[-1].text if tr.turns else "",
    }
    if tr.metadata.get("error"):
        fields["error"] = tr.metadata["error"]
    return fields


def trajectory_record(tr: Any) -> dict[str, Any]:
    """The prediction record of one agent episode, scored by :mod:`eval.metrics` (``id``, ``prediction``,
    ``golden_answers`` plus :func:`trajectory_fields`, ``supporting_ids`` and ``hops`` from its metadata)."""
    ex = QAExample(tr.question_id, tr.question, list(tr.golden_answers), tr.metadata)
    return prediction_record(ex, tr.answer, **trajectory_fields(tr), question=tr.question,
                   supporting_ids=tr.metadata.get("supporting_ids"), hops=tr.metadata.get("hops"))
