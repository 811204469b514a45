"""What the evaluation methods share: the one signature of a method (``method(examples, ctx) -> records``, its
:class:`MethodContext`), their registry (:data:`EVAL_METHODS`, the choices of ``sleuth eval --method``), the
agent's task prompt, sampling settings, token budgets and the prediction record every method returns (see
:mod:`eval.methods`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.config import AgentConfig
from agent.llm import LLM, SamplingParams, encode
from agent.protocols.base import format_docs
from agent.protocols.build import prompt_ids, speaks_tags
from corpora.formats import QAExample
from corpora.registry import Registry
from retrieval.base import Hit, Retriever

Method = Callable[[list[QAExample]], list[dict[str, Any]]]


@dataclass(frozen=True)
class MethodContext:
    """Everything an evaluation method is run with besides its questions: the backend ``llm``, the
    ``retriever`` (``None`` for a method that retrieves nothing), the agent config ``cfg`` (prompt, budgets,
    protocol), ``top_k`` passages per search, the decoding ``temperature`` (0 = greedy) and sampling ``seed``;
    then the settings of particular methods: ``max_steps`` (reasoning steps of IRCoT and Search-o1; ``None``:
    ``cfg.max_turns``), ``max_docs`` (IRCoT's cap on paragraphs), ``max_extract_tokens`` (Search-o1's
    Reason-in-Documents budget; ``None``: ``cfg.max_new_tokens``), and the agent's ``run_episodes`` (the loop
    to run; default :func:`agent.loop.batch.run_episodes`), ``judge`` and ``on_trajectories`` (called with each
    batch's trajectories); ``options`` holds a plugin method's own settings."""

    llm: LLM
    retriever: Retriever | None = None
    cfg: AgentConfig = field(default_factory=AgentConfig)
    top_k: int = 3
    temperature: float = 0.0
    seed: int | None = 0
    max_steps: int | None = None
    max_docs: int = 10
    max_extract_tokens: int | None = None
    run_episodes: Callable[..., list[Any]] | None = None
    judge: Callable | None = None
    on_trajectories: Callable[[list[Any]], None] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


#: ``method(examples, ctx) -> one prediction record per example, in order``
MethodFn = Callable[[list[QAExample], MethodContext], list[dict[str, Any]]]


@dataclass(frozen=True)
class EvalMethod:
    """One evaluation method: ``run(examples, ctx)``; ``retrieves``: it searches (it needs a retriever, an
    index); ``tags``: it reads the policy's Search-R1 ``<search>`` tags, so a tool protocol without them is
    refused; ``episodes``: it runs agent episodes (an external agent may run them, and their trajectories are
    kept beside the predictions); ``description`` for help texts."""

    run: MethodFn
    retrieves: bool = True
    tags: bool = False
    episodes: bool = False
    description: str = ""


EVAL_METHODS: Registry[EvalMethod] = Registry("evaluation method", "sleuth eval --method")


def register_eval_method(name: str, *, retrieves: bool = True, tags: bool = False, episodes: bool = False,
                         description: str = "", replace: bool = False):
    """Register the decorated ``method(examples, ctx: MethodContext) -> records`` as evaluation method
    ``name`` (see :class:`EvalMethod` for the flags). Raises ``ValueError`` for a name already registered,
    unless ``replace``."""

    def wrap(fn: MethodFn) -> MethodFn:
        EVAL_METHODS.add(name, EvalMethod(fn, retrieves, tags, episodes, description), replace=replace)
        return fn

    return wrap

RAW_CHARS = 500
TAGS = re.compile(r"</?(think|search|answer|information)>")


def task_prompt(llm: LLM, question: str, cfg: AgentConfig) -> list[int]:
    # the agent's own prompt (chat template or Search-R1 instruction)
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
    """Raise ``ValueError`` when ``cfg``'s tool protocol has the policy search without Search-R1's tags
    (``agent.protocol: function_call``: native tool calls): ``method`` reads the model's ``<search>`` tags and
    would never see its tool calls."""
    if not speaks_tags(cfg):
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
