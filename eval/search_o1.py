"""Search-o1 (Li et al. 2025, "Search-o1: Agentic Search-Enhanced Large Reasoning Models",
arXiv:2501.05366) as an evaluation method, in the agent's Search-R1 tag protocol: the model reasons and
issues ``<search>`` queries itself, and a separate Reason-in-Documents call of the same backend condenses
each query's documents into the helpful information, which alone enters the reasoning chain."""

from __future__ import annotations

import re
import time
from typing import Any

from agent.config import AgentConfig
from agent.llm import LLM, Generation, decode, encode
from agent.protocols import search_r1
from agent.protocols.base import format_docs, user_message_ids
from corpora.formats import QAExample
from eval.prompting import (
    RAW_CHARS,
    TAGS,
    MethodContext,
    check_tags_protocol,
    extract_answer,
    fit_tokens,
    prediction_record,
    sampling,
    set_wall,
    task_prompt,
)
from retrieval.base import Hit

# -- search_o1 ------------------------------------------------------------------------------------------
REASON_IN_DOCUMENTS = (
    "Task: read the searched documents and extract the information that helps answer the current search "
    "query, given the previous reasoning. Keep only facts stated in the documents.\n"
    "Previous reasoning: {reasoning}\n"
    "Current search query: {query}\n"
    "Searched documents:\n{documents}\n"
    "If the documents contain helpful information, write it concisely; otherwise write: {none}\n"
    "Helpful information:"
)
NO_INFO = "No helpful information found."
RID_STOP = ("\n\n", "</information>")
_ACTION_OR_INFO = re.compile(r"</?(search|answer|information)>")  # <think> may run on over several steps


def _user_ids(llm: LLM, text: str, cfg: AgentConfig) -> list[int]:
    """Token ids of a one-message user prompt, through the chat template exactly when the agent prompt
    uses one (:func:`agent.protocols.base.user_message_ids`, as :func:`agent.protocols.build.prompt_ids`)."""
    return user_message_ids(llm.tokenizer, text, cfg)


def reason_in_documents_prompt(llm: LLM, reasoning: str, query: str, docs: list[Hit], cfg: AgentConfig,
                               max_new: int) -> list[int] | None:
    """Token ids of Search-o1's Reason-in-Documents prompt (our wording of the paper's instruction): the
    previous reasoning, the current query and the documents (Search-R1 rendering). Documents get at most
    ``cfg.max_obs_tokens`` tokens, the reasoning keeps its most recent tokens, and the prompt fits
    ``cfg.max_total_tokens - max_new`` tokens when its fixed parts do. ``None`` when there is nothing to read:
    no hits, or no room for a single document token (the caller then inserts :data:`NO_INFO` without a call)."""
    tok = llm.tokenizer
    limit = cfg.max_total_tokens - max_new

    def build(doc_room: int, reason_room: int) -> list[int]:
        body = format_docs(docs, cfg.max_doc_chars)
        reason = encode(tok, " ".join(reasoning.split()))
        text = REASON_IN_DOCUMENTS.format(
            reasoning=decode(tok, reason[max(len(reason) - reason_room, 0):] if reason_room > 0 else []) or "(none)",
            query=query, documents=decode(tok, fit_tokens(llm, body, doc_room)), none=NO_INFO)
        return _user_ids(llm, text, cfg)

    fixed = len(build(0, 0))
    doc_room = min(cfg.max_obs_tokens, limit - fixed)
    if not docs or doc_room < 1:
        return None
    reason_room = limit - fixed - max(doc_room, 0)
    ids = build(doc_room, reason_room)
    for _ in range(3):  # re-tokenising the cut pieces can shift a few tokens: shrink until it fits
        over = len(ids) - limit
        if over <= 0:
            break
        cut = min(over, reason_room)
        reason_room, doc_room = reason_room - cut, doc_room - (over - cut)
        ids = build(doc_room, reason_room)
    return ids


def _refined(text: str) -> str:
    """The Reason-in-Documents output as inserted into the chain: tags removed, whitespace collapsed,
    :data:`NO_INFO` when empty."""
    out = " ".join(TAGS.sub(" ", text).split())
    return out or NO_INFO


def search_o1(examples: list[QAExample], ctx: MethodContext) -> list[dict[str, Any]]:
    """Search-o1 (Li et al. 2025, "Search-o1: Agentic Search-Enhanced Large Reasoning Models",
    arXiv:2501.05366) in the tag protocol, batched across questions.

    Agentic retrieval-augmented reasoning with the Reason-in-Documents module. For up to ``ctx.max_steps``
    steps (default ``cfg.max_turns``) over the questions still running: (1) one batched generation
    continues each reasoning chain (the agent prompt, then the model's own turns) until ``</search>`` or
    ``</answer>``; an answer ends the question. (2) One batched search with the queries written. (3) One
    batched Reason-in-Documents generation: for each query, the same backend is given the previous
    reasoning, the query and the ``top_k`` documents (:func:`reason_in_documents_prompt`) and writes the
    helpful information (or :data:`NO_INFO`); that text, not the documents, is appended to the chain as
    ``<information> ... </information>``. A turn cut by the token budget (``finish_reason == "length"``)
    with no ``<search>``/``<answer>``/``<information>`` tag (``<think>`` may be open) continues at the next
    step; any other turn without a valid action ends the reasoning.
    Finally, unanswered questions get a forced ``<answer>`` (closing an open ``<think>``).

    Differences from the original: the Search-R1 tags (``<search>``, ``<information>``, ``<answer>``)
    replace Search-o1's special tokens (``<|begin_search_query|>``, ``<|begin_search_result|>``,
    ``\\boxed{}``); the prompts are the agent's task prompt and our short wording of the
    Reason-in-Documents instruction (no few-shot examples, no "**Final Information**" marker: the whole
    continuation up to a blank line is the extraction); the search limit is ``max_steps`` reasoning steps
    (the paper caps searches at 10); documents are passages of the local corpus, not web pages; the
    chain is cut to the episode budget ``cfg.max_total_tokens``. ``ctx.max_extract_tokens`` (default
    ``cfg.max_new_tokens``; at least 1) bounds each extraction.

    Raises ``ValueError`` with ``agent.protocol: function_call``: the policy's tool calls are not
    ``<search>`` tags, so it would never search; and for ``max_extract_tokens < 1``.

    Record fields: those of every method, with ``turns`` counting every LLM call for the question
    (reasoning steps, Reason-in-Documents calls and the forced answer), ``generated_tokens`` all their
    tokens, plus ``refined`` (the inserted extractions, in order).
    """
    llm, retriever, cfg, top_k, temperature, seed = ctx.llm, ctx.retriever, ctx.cfg, ctx.top_k, ctx.temperature, ctx.seed
    check_tags_protocol("search_o1", cfg)
    max_steps = cfg.max_turns if ctx.max_steps is None else ctx.max_steps
    max_extract_tokens = ctx.max_extract_tokens
    if max_extract_tokens is not None and max_extract_tokens < 1:  # before any generation
        raise ValueError(f"max_extract_tokens must be at least 1 token, got {max_extract_tokens}")
    extract_new = cfg.max_new_tokens if max_extract_tokens is None else max_extract_tokens
    t0 = time.perf_counter()
    if not examples:
        return []
    ch = _Chains(llm, cfg, [task_prompt(llm, ex.question, cfg) for ex in examples])
    active = list(range(len(examples)))
    for _step in range(max_steps):
        active = [i for i in active if len(ch.ctx[i]) + ch.reserve <= cfg.max_total_tokens]
        if not active:
            break
        queries, going = ch.reason(active, sampling(cfg, temperature, seed, search_r1.STOP_STRINGS))
        if queries:
            hits = retriever.search([q for _, q in queries], top_k)
            ch.read(queries, hits, sampling(cfg, temperature, seed, RID_STOP, extract_new), extract_new)
            going += [i for i, _ in queries]
        active = sorted(going)
    ch.force_answers(sampling(cfg, temperature, seed, ("</answer>",)))
    recs = [
        prediction_record(ex, ch.answer[i], retrieved_ids=ch.retrieved[i], search_calls=ch.calls[i],
                          turns=ch.turns[i], generated_tokens=ch.gen_tokens[i], raw=ch.raw[i], refined=ch.refined[i])
        for i, ex in enumerate(examples)
    ]
    return set_wall(recs, t0)


class _Chains:
    """The reasoning chains of one :func:`search_o1` batch: each question's token context, answer and
    bookkeeping (retrieved ids, refined extractions, search calls, LLM calls, generated tokens, last output)."""

    def __init__(self, llm: LLM, cfg: AgentConfig, prompts: list[list[int]]):
        n = len(prompts)
        self.llm, self.cfg, self.tok = llm, cfg, llm.tokenizer
        self.ctx, self.start = prompts, [len(c) for c in prompts]
        self.head, self.tail = encode(self.tok, "\n\n<information>"), encode(self.tok, "</information>\n\n")
        force_room = len(encode(self.tok, " </think>\n<answer>"))
        # one more step and its <information> tags (added even when no extraction fits), then the forced answer
        self.reserve = cfg.max_new_tokens + len(self.head) + len(self.tail) + force_room + cfg.max_new_tokens
        self.answer: list[str | None] = [None] * n
        self.retrieved: list[list[str]] = [[] for _ in range(n)]
        self.refined: list[list[str]] = [[] for _ in range(n)]
        self.calls, self.turns, self.gen_tokens, self.raw = [0] * n, [0] * n, [0] * n, [""] * n

    def count(self, i: int, g: Generation) -> None:
        self.turns[i] += 1
        self.gen_tokens[i] += len(g.token_ids)

    def reason(self, active: list[int], params: Any) -> tuple[list[tuple[int, str]], list[int]]:
        """One batched reasoning step of the ``active`` chains: an answer ends a chain; returns the queries
        written ``(i, query)`` and the chains cut by the turn budget that go on reasoning."""
        eos = getattr(self.tok, "eos_token_id", None)
        queries: list[tuple[int, str]] = []
        going: list[int] = []
        for i, g in zip(active, self.llm.generate([self.ctx[i] for i in active], params), strict=True):
            self.count(i, g)
            self.raw[i] = g.text
            ids = list(g.token_ids)
            if ids and eos is not None and ids[-1] == eos:
                ids = ids[:-1]
            self.ctx[i] += ids
            act = search_r1.parse_action(g.text, self.cfg.max_query_chars)
            if act.kind == "answer":
                self.answer[i] = act.content
            elif act.kind == "search":
                queries.append((i, act.content))
            elif g.finish_reason == "length" and not _ACTION_OR_INFO.search(g.text):
                going.append(i)  # reasoning (in or out of <think>) cut by the turn budget: continue it next step
        return queries, going

    def read(self, queries: list[tuple[int, str]], hits: list[list[Hit]], params: Any, extract_new: int) -> None:
        """One batched Reason-in-Documents call over each query's documents; the extraction (or
        :data:`NO_INFO`) is appended to its chain as an ``<information>`` block."""
        prompts = []
        for (i, q), hs in zip(queries, hits, strict=True):
            self.calls[i] += 1
            self.retrieved[i].extend(h.id for h in hs)
            reasoning = decode(self.tok, self.ctx[i][self.start[i]:])
            prompts.append(reason_in_documents_prompt(self.llm, reasoning, q, hs, self.cfg, extract_new))
        asked = [p for p in prompts if p is not None]  # nothing to read: no call, NO_INFO
        rid = iter(self.llm.generate(asked, params) if asked else [])
        for (i, _), p in zip(queries, prompts, strict=True):
            g = next(rid) if p is not None else None
            if g is not None:
                self.count(i, g)
            info = _refined(g.text) if g is not None else NO_INFO
            self.refined[i].append(info[:RAW_CHARS])
            room = self.cfg.max_total_tokens - len(self.ctx[i]) - self.reserve - len(self.head) - len(self.tail)
            self.ctx[i] += self.head + fit_tokens(self.llm, info, room) + self.tail

    def force_answers(self, params: Any) -> None:
        """Unanswered chains get a forced ``<answer>`` (closing an open ``<think>``)."""
        pending = [i for i in range(len(self.ctx)) if self.answer[i] is None]
        if not pending:
            return
        prompts = []
        for i in pending:
            chain = decode(self.tok, self.ctx[i][self.start[i]:]).rsplit("</information>", 1)[-1]
            close = " </think>\n" if chain.rfind("<think>") > chain.rfind("</think>") else ""
            prompts.append(self.ctx[i] + encode(self.tok, close + "<answer>"))
        for i, g in zip(pending, self.llm.generate(prompts, params), strict=True):
            self.count(i, g)
            self.raw[i] = g.text
            self.answer[i] = extract_answer(g.text)
