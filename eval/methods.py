"""The methods of the search-agent results table, runnable on any :class:`agent.llm.LLM` backend.

* ``direct``: answer from parametric knowledge, no retrieval (Search-R1's "Direct Inference").
* ``rag``: retrieve the top-k passages for the question once, then read and answer (Lewis et al. 2020;
  FlashRAG's standard RAG).
* ``ircot``: interleave retrieval with chain-of-thought (Trivedi et al., ACL 2023): retrieve for the
  question, then repeatedly generate one reasoning sentence over everything retrieved so far and retrieve
  with that sentence, until the model answers (or writes "answer is") or ``max_steps`` runs out. A sentence
  ends at a newline, a closing tag or a "." that is no abbreviation, initial or decimal point ("St. Louis",
  "U.S. Army" and "1.5 km" stay whole).
* ``search_o1``: Search-o1 (Li et al. 2025): the model reasons and issues ``<search>`` queries itself; a
  separate "Reason-in-Documents" call of the same backend condenses each query's retrieved documents into
  the helpful information, and only that is inserted into the reasoning chain.
* ``agent``: the Sleuth agent (:func:`agent.loop.run_episodes`): the policy decides when and what to search.

All methods speak the agent's Search-R1 tag protocol and use its prompt (:func:`agent.protocol.prompt_ids`), so
the same checkpoint is compared fairly: ``direct`` forces ``<answer>`` right after the prompt; ``rag`` writes
the agent's first turn for it (``<search> question </search>`` and the ``<information>`` block) and forces
``<answer>``; ``ircot`` puts all retrieved passages in one ``<information>`` block and lets the model reason
inside ``<think>``, one sentence per step (a ``<search>`` query it writes counts as its reasoning step);
``search_o1`` continues the agent's own turns and shows the refined information in ``<information>``.

Each method maps a batch of :class:`corpora.formats.QAExample` to one prediction record per question, in
order: ``{"id", "prediction" (str or None), "golden_answers", "retrieved_ids" (in retrieval order),
"search_calls", "turns" (LLM calls), "generated_tokens", "wall_s"}`` plus ``"raw"`` (the last model output,
for inspection). ``wall_s`` is the batch's wall time divided by its size (seconds per question, amortised
over the batched backend calls).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from agent import search_r1
from agent.config import AgentConfig
from agent.llm import LLM, Generation, SamplingParams, decode, encode, generate_requests
from agent.protocol import format_docs
from corpora.formats import QAExample
from retrieval.base import Hit, Retriever

Method = Callable[[list[QAExample]], list[dict[str, Any]]]
RAW_CHARS = 500


def _prompt(llm: LLM, question: str, cfg: AgentConfig) -> list[int]:
    from agent.protocol import prompt_ids  # the agent's own prompt (chat template or Search-R1 instruction)

    return prompt_ids(llm.tokenizer, question, cfg)


def _params(cfg: AgentConfig, temperature: float, seed: int | None, stop: tuple[str, ...], max_new: int | None = None) -> SamplingParams:
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


def _check_tags_protocol(method: str, cfg: AgentConfig) -> None:
    """Raise ``ValueError`` when ``cfg`` makes the policy call tools natively (``agent.protocol:
    function_call``): ``method`` reads the model's ``<search>`` tags and would never see its tool calls."""
    if getattr(cfg, "protocol", "search_r1") != "search_r1":
        raise ValueError(f"method {method!r} reads Search-R1 <search> tags; it cannot run with "
                         f"agent.protocol={cfg.protocol} (use agent.protocol=search_r1, or the 'agent' method)")


def _record(ex: QAExample, prediction: str | None, **kw: Any) -> dict[str, Any]:
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


def _set_wall(records: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    per = (time.perf_counter() - t0) / max(len(records), 1)
    for r in records:
        r["wall_s"] = per
    return records


def _fit(llm: LLM, body: str, room: int) -> list[int]:
    """Token ids of ``body`` cut to ``room`` tokens (at least 0)."""
    return encode(llm.tokenizer, body)[: max(room, 0)]


def _info_ids(llm: LLM, docs: list[Hit], cfg: AgentConfig, room: int) -> list[int]:
    """``<information>`` block of ``docs`` (Search-R1 rendering) whose body fits ``room`` tokens."""
    head, tail = encode(llm.tokenizer, "\n\n<information>"), encode(llm.tokenizer, "</information>\n\n")
    body = _fit(llm, format_docs(docs, cfg.max_doc_chars), room - len(head) - len(tail))
    return head + body + tail


# -- direct ---------------------------------------------------------------------------------------------
def direct(
    examples: list[QAExample],
    llm: LLM,
    retriever: Retriever | None = None,
    cfg: AgentConfig | None = None,
    *,
    temperature: float = 0.0,
    seed: int | None = 0,
    **_: Any,
) -> list[dict[str, Any]]:
    """Answer without retrieval: prompt, then a forced ``<answer>``; one batched LLM call."""
    cfg = cfg or AgentConfig()
    t0 = time.perf_counter()
    ans = encode(llm.tokenizer, "<answer>")
    prompts = [_prompt(llm, ex.question, cfg) + ans for ex in examples]
    gens = llm.generate(prompts, _params(cfg, temperature, seed, ("</answer>",))) if prompts else []
    recs = [
        _record(ex, extract_answer(g.text), turns=1, generated_tokens=len(g.token_ids), raw=g.text)
        for ex, g in zip(examples, gens, strict=True)
    ]
    return _set_wall(recs, t0)


# -- rag ------------------------------------------------------------------------------------------------
def rag(
    examples: list[QAExample],
    llm: LLM,
    retriever: Retriever,
    cfg: AgentConfig | None = None,
    *,
    top_k: int = 3,
    temperature: float = 0.0,
    seed: int | None = 0,
    **_: Any,
) -> list[dict[str, Any]]:
    """Retrieve ``top_k`` passages for the question once, then answer; one batched search and one batched
    LLM call. The passages are shown as the agent's first search turn would show them (cut to
    ``cfg.max_obs_tokens`` and to the episode budget ``cfg.max_total_tokens``)."""
    cfg = cfg or AgentConfig()
    t0 = time.perf_counter()
    if not examples:
        return []
    hits = retriever.search([ex.question for ex in examples], top_k)
    ans = encode(llm.tokenizer, "<answer>")
    prompts = []
    for ex, hs in zip(examples, hits, strict=True):
        p = _prompt(llm, ex.question, cfg) + encode(llm.tokenizer, f"<search> {ex.question} </search>")
        room = min(cfg.max_obs_tokens, cfg.max_total_tokens - len(p) - len(ans) - cfg.max_new_tokens)
        prompts.append(p + _info_ids(llm, hs, cfg, room) + ans)
    gens = llm.generate(prompts, _params(cfg, temperature, seed, ("</answer>",)))
    recs = [
        _record(ex, extract_answer(g.text), retrieved_ids=[h.id for h in hs], search_calls=1, turns=1,
                generated_tokens=len(g.token_ids), raw=g.text)
        for ex, hs, g in zip(examples, hits, gens, strict=True)
    ]
    return _set_wall(recs, t0)


# -- ircot ----------------------------------------------------------------------------------------------
_SEARCH = re.compile(r"<search>(.*?)(?:</search>|$)", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_ANSWER_IS = re.compile(r"answer is:?\s*(.+)", re.IGNORECASE | re.DOTALL)
_TAGS = re.compile(r"</?(think|search|answer|information)>")
IRCOT_STOP = (".", "\n", "</think>", "</search>", "</answer>")
# a "." that ends no sentence: an abbreviation, a single-letter initial or a dotted acronym's letter (U.S.)
_ABBREV = re.compile(
    r"\b(?:Mr|Mrs|Ms|Dr|Jr|Sr|St|Mt|Ft|Inc|Co|Corp|Ltd|Bros|Gen|Col|Maj|Lt|Sgt|Capt|Adm|Prof|Rev|Gov|Sen|Rep|"
    r"Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec|vs|etc|approx|[A-Za-z])\.$"
)
# "1." may go on as "1.5", "No." as "No. 5"; not a year ("in 1990.") nor a name ("hop1.")
_NUMBER = re.compile(r"(?:(?<![\w.,])\d{1,3}|\bNo)\.$")
_ANY = re.compile("")
_NUMBER_NEXT = re.compile(r" ?\d")
# after "St." / "Inc." / "I." a word that usually opens a sentence ("World War I. It ended ...", "Apple Inc.
# The company ...") says the "." ended one (Punkt's orthographic cue, with a fixed list); "A." stays an initial
_STARTER = (
    r"It|Its|The|This|That|These|Those|There|Then|Thus|Therefore|Hence|So|He|She|They|We|His|Her|Their|In|On|"
    r"At|After|Before|A|An|But|And|However|Also|Since|As|Because|Now|Next|Finally|Both|Which|Who|What|When|Where"
)
_AFTER_ABBREV = re.compile(rf"\s*(?!(?:{_STARTER})\b(?!\.))\S")


def _sentence_open(text: str) -> re.Pattern[str] | None:
    """Whether an IRCoT step ``text`` that stopped at a ``"."`` (its last one) goes on: ``None`` when the "."
    ends the sentence; else the pattern the continuation must start with to belong to the sentence (any text
    after a "." inside a token such as ``"U.S"``; after an abbreviation or an initial, any word but one that
    usually opens a sentence, so that "World War I. It ended" ends at "I."; a digit after a number of up to
    three digits or "No.", so that "scored 21." followed by a new sentence still ends at "21.")."""
    dot = text.rfind(".")
    if dot < 0:
        return None
    head, rest = text[: dot + 1], text[dot + 1 :]
    if rest[:1].isalnum():  # the stop token runs on past the ".": "1.5", "U.S"
        return _ANY
    if rest:  # '."', '.)', ". ": closed
        return None
    if _ABBREV.search(head):
        return _AFTER_ABBREV
    return _NUMBER_NEXT if _NUMBER.search(head) else None


def _stopped_at_period(llm: LLM, g: Generation, so_far: str) -> tuple[str, list[int], bool]:
    """``(text, token_ids, at_period)`` of one IRCoT generation that follows ``so_far`` (the step's text
    before it): ``at_period`` when it stopped at the ``"."`` stop. The transformers and vLLM backends keep
    the stop string in the text (with the rest of its token), as does an OpenAI-compatible server that
    honours ``include_stop_str_in_output`` or names the stop it matched; a text-only server that names none
    leaves it out, and then a "." is put back (text and ids) where the text ends like an abbreviation or a
    number (a "\\n" or end-of-sequence stop there is taken for a ".")."""
    text, ids = g.text, list(g.token_ids)
    if g.finish_reason != "stop" or any(s in text for s in IRCOT_STOP if s != "."):
        return text, ids, False
    if "." in text:
        return text, ids, True
    if g.meta.get("exact") is False and _sentence_open(so_far + text + ".") is not None:
        return text + ".", ids + encode(llm.tokenizer, "."), True
    return text, ids, False


def _continued_text(llm: LLM, before: list[int], new: list[int], text: str) -> str:
    """``text`` (the decoding of ``new`` alone) as it reads after the ids ``before``: with the whitespace in
    front that a decoding of ``new`` alone drops (a SentencePiece tokenizer with a dummy prefix, Llama 2 or
    Mistral, decodes "▁Louis" alone as "Louis" but as " Louis" after "St."); else ``text`` unchanged."""
    head, both = decode(llm.tokenizer, before), decode(llm.tokenizer, before + new)
    tail = both[len(head):] if both.startswith(head) else ""
    k = tail.find(text) if text else -1
    return tail[:k] + text if k > 0 and tail[:k].isspace() else text


def _ircot_steps(llm: LLM, prompts: list[list[int]], cfg: AgentConfig, temperature: float,
                 seed: int | None) -> list[tuple[str, int, int]]:
    """One IRCoT reasoning step per prompt: ``(text, generated tokens, LLM calls)``.

    Generation stops at :data:`IRCOT_STOP`; a step that stopped at a "." which ends no sentence
    (:func:`_sentence_open`: "St.", "U.S.", "1.") is continued from its text so far, in one batched call
    per round over the steps that need one, until a sentence end or another stop. The step's tokens over
    all rounds stay within ``cfg.max_new_tokens`` (each round gets what is left; a round that produces
    nothing ends the step), so the rounds end. A continuation that does not start as required (no digit
    after "21.") is dropped from the text but its tokens are counted: the model generated them.
    """
    n = len(prompts)
    texts, ids, used, calls = [""] * n, [[] for _ in range(n)], [0] * n, [0] * n
    todo: dict[int, re.Pattern[str]] = {j: _ANY for j in range(n)}
    while todo:
        js = [j for j in todo if used[j] < cfg.max_new_tokens]
        if not js:
            break
        # each step asks for what it has left (one call for the round; agent.llm.generate_requests)
        gens = generate_requests(llm, [(prompts[j] + ids[j], _params(cfg, temperature, seed, IRCOT_STOP,
                                                                      cfg.max_new_tokens - used[j])) for j in js])
        nxt: dict[int, re.Pattern[str]] = {}
        for j, g in zip(js, gens, strict=True):
            calls[j] += 1
            used[j] += len(g.token_ids)
            text, new, at_period = _stopped_at_period(llm, g, texts[j])
            if not g.token_ids or not todo[j].match(text):
                continue
            used[j] += len(new) - len(g.token_ids)  # a "." put back
            if ids[j]:
                text = _continued_text(llm, ids[j], new, text)
            texts[j], ids[j] = texts[j] + text, ids[j] + new
            if at_period and (more := _sentence_open(texts[j])) is not None:
                nxt[j] = more
        todo = nxt
    return list(zip(texts, used, calls, strict=True))


def _ircot_step(text: str) -> tuple[str, str]:
    """Classify one IRCoT generation: ``("answer", answer)``, ``("done", "")`` (reasoning ended without an
    answer) or ``("sentence", retrieval query)``."""
    m = _ANSWER.search(text)
    if m and m.group(1).strip():
        return "answer", m.group(1).strip()
    m = _ANSWER_IS.search(_TAGS.sub(" ", text))
    if m and m.group(1).strip(" .\n"):
        return "answer", m.group(1).strip(" .\n")
    m = _SEARCH.search(text)
    sentence = m.group(1).strip() if m else _TAGS.sub(" ", text).strip()
    if ("</think>" in text and not m) or not sentence:
        return "done", ""
    return "sentence", " ".join(sentence.split())


def ircot(
    examples: list[QAExample],
    llm: LLM,
    retriever: Retriever,
    cfg: AgentConfig | None = None,
    *,
    top_k: int = 3,
    max_steps: int | None = None,
    max_docs: int = 10,
    temperature: float = 0.0,
    seed: int | None = 0,
    **_: Any,
) -> list[dict[str, Any]]:
    """IRCoT (Trivedi et al. 2023, Alg. 1) in the tag protocol, batched across questions.

    Retrieve ``top_k`` for the question; then for up to ``max_steps`` (default ``cfg.max_turns``) steps:
    generate one sentence inside ``<think>`` given all passages so far (deduplicated, first ``max_docs``
    kept, IRCoT's cap on paragraphs), stop if it answers (an ``<answer>`` tag or "answer is ..."), else
    retrieve ``top_k`` more with the sentence. Finally, unanswered questions get ``</think>`` and a forced
    ``<answer>``. Every step is one batched search and one batched LLM call over the questions still
    running, plus one batched call per round of continuing the steps that stopped at a "." which ends no
    sentence ("St.", "U.S.", "1."; :func:`_ircot_steps`), all of a step's rounds within
    ``cfg.max_new_tokens``. ``turns`` counts every LLM call, ``generated_tokens`` every token generated
    within the budgets.
    """
    cfg = cfg or AgentConfig()
    max_steps = cfg.max_turns if max_steps is None else max_steps
    t0 = time.perf_counter()
    n = len(examples)
    if n == 0:
        return []
    tok = llm.tokenizer
    base = [_prompt(llm, ex.question, cfg) for ex in examples]
    docs: list[dict[str, Hit]] = [{} for _ in range(n)]
    retrieved: list[list[str]] = [[] for _ in range(n)]
    cot: list[list[str]] = [[] for _ in range(n)]
    answer: list[str | None] = [None] * n
    calls, turns, gen_tokens = [0] * n, [0] * n, [0] * n
    raw = [""] * n

    def add(i: int, hits: list[Hit]) -> None:
        calls[i] += 1
        for h in hits:
            retrieved[i].append(h.id)
            if h.id not in docs[i] and len(docs[i]) < max_docs:
                docs[i][h.id] = h

    def context(i: int, tail: str) -> list[int]:
        think = encode(tok, "<think> " + " ".join(cot[i]) + tail)
        room = cfg.max_total_tokens - len(base[i]) - len(think) - cfg.max_new_tokens
        return base[i] + _info_ids(llm, list(docs[i].values()), cfg, room) + think

    def record(i: int, g: Generation) -> None:
        turns[i] += 1
        gen_tokens[i] += len(g.token_ids)
        raw[i] = g.text

    for i, hits in enumerate(retriever.search([ex.question for ex in examples], top_k)):
        add(i, hits)
    active = list(range(n))
    for _step in range(max_steps):
        if not active:
            break
        steps = _ircot_steps(llm, [context(i, "") for i in active], cfg, temperature, seed)
        queries: list[tuple[int, str]] = []
        for i, (text, n_tokens, n_calls) in zip(active, steps, strict=True):
            turns[i] += n_calls
            gen_tokens[i] += n_tokens
            raw[i] = text
            kind, content = _ircot_step(text)
            if kind == "answer":
                answer[i] = content
            elif kind == "sentence":
                cot[i].append(content if content.endswith(".") else content + ".")
                queries.append((i, content))
        active = [i for i, _ in queries]
        if queries:
            for (i, _), hits in zip(queries, retriever.search([q for _, q in queries], top_k), strict=True):
                add(i, hits)
    pending = [i for i in range(n) if answer[i] is None]
    if pending:
        gens = llm.generate([context(i, " </think>\n<answer>") for i in pending],
                            _params(cfg, temperature, seed, ("</answer>",)))
        for i, g in zip(pending, gens, strict=True):
            record(i, g)
            answer[i] = extract_answer(g.text)
    recs = [
        _record(ex, answer[i], retrieved_ids=retrieved[i], search_calls=calls[i], turns=turns[i],
                generated_tokens=gen_tokens[i], raw=raw[i], reasoning=" ".join(cot[i]))
        for i, ex in enumerate(examples)
    ]
    return _set_wall(recs, t0)


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
    uses one (:func:`agent.protocol.user_message_ids`, as :func:`agent.protocol.prompt_ids`)."""
    from agent.protocol import user_message_ids

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
            query=query, documents=decode(tok, _fit(llm, body, doc_room)), none=NO_INFO)
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
    out = " ".join(_TAGS.sub(" ", text).split())
    return out or NO_INFO


def search_o1(
    examples: list[QAExample],
    llm: LLM,
    retriever: Retriever,
    cfg: AgentConfig | None = None,
    *,
    top_k: int = 3,
    max_steps: int | None = None,
    max_extract_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int | None = 0,
    **_: Any,
) -> list[dict[str, Any]]:
    """Search-o1 (Li et al. 2025, "Search-o1: Agentic Search-Enhanced Large Reasoning Models",
    arXiv:2501.05366) in the tag protocol, batched across questions.

    Agentic retrieval-augmented reasoning with the Reason-in-Documents module. For up to ``max_steps``
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
    chain is cut to the episode budget ``cfg.max_total_tokens``. ``max_extract_tokens`` (default
    ``cfg.max_new_tokens``; at least 1) bounds each extraction.

    Raises ``ValueError`` with ``agent.protocol: function_call``: the policy's tool calls are not
    ``<search>`` tags, so it would never search; and for ``max_extract_tokens < 1``.

    Record fields: those of every method, with ``turns`` counting every LLM call for the question
    (reasoning steps, Reason-in-Documents calls and the forced answer), ``generated_tokens`` all their
    tokens, plus ``refined`` (the inserted extractions, in order).
    """
    cfg = cfg or AgentConfig()
    _check_tags_protocol("search_o1", cfg)
    max_steps = cfg.max_turns if max_steps is None else max_steps
    if max_extract_tokens is not None and max_extract_tokens < 1:  # before any generation
        raise ValueError(f"max_extract_tokens must be at least 1 token, got {max_extract_tokens}")
    extract_new = cfg.max_new_tokens if max_extract_tokens is None else max_extract_tokens
    t0 = time.perf_counter()
    n = len(examples)
    if n == 0:
        return []
    tok = llm.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    ctx = [_prompt(llm, ex.question, cfg) for ex in examples]
    start = [len(c) for c in ctx]
    head, tail = encode(tok, "\n\n<information>"), encode(tok, "</information>\n\n")
    force_room = len(encode(tok, " </think>\n<answer>"))
    # one more step and its <information> tags (added even when no extraction fits), then the forced answer
    reserve = cfg.max_new_tokens + len(head) + len(tail) + force_room + cfg.max_new_tokens
    answer: list[str | None] = [None] * n
    retrieved: list[list[str]] = [[] for _ in range(n)]
    refined: list[list[str]] = [[] for _ in range(n)]
    calls, turns, gen_tokens = [0] * n, [0] * n, [0] * n
    raw = [""] * n

    def record(i: int, g: Generation) -> None:
        turns[i] += 1
        gen_tokens[i] += len(g.token_ids)

    active = list(range(n))
    for _step in range(max_steps):
        active = [i for i in active if len(ctx[i]) + reserve <= cfg.max_total_tokens]
        if not active:
            break
        gens = llm.generate([ctx[i] for i in active], _params(cfg, temperature, seed, search_r1.STOP_STRINGS))
        queries: list[tuple[int, str]] = []
        going: list[int] = []
        for i, g in zip(active, gens, strict=True):
            record(i, g)
            raw[i] = g.text
            ids = list(g.token_ids)
            if ids and eos is not None and ids[-1] == eos:
                ids = ids[:-1]
            ctx[i] += ids
            act = search_r1.parse_action(g.text, cfg.max_query_chars)
            if act.kind == "answer":
                answer[i] = act.content
            elif act.kind == "search":
                queries.append((i, act.content))
            elif g.finish_reason == "length" and not _ACTION_OR_INFO.search(g.text):
                going.append(i)  # reasoning (in or out of <think>) cut by the turn budget: continue it next step
        if queries:
            hits = retriever.search([q for _, q in queries], top_k)
            prompts = []
            for (i, q), hs in zip(queries, hits, strict=True):
                calls[i] += 1
                retrieved[i].extend(h.id for h in hs)
                prompts.append(reason_in_documents_prompt(llm, decode(tok, ctx[i][start[i]:]), q, hs, cfg, extract_new))
            asked = [p for p in prompts if p is not None]  # nothing to read: no call, NO_INFO
            rid = iter(llm.generate(asked, _params(cfg, temperature, seed, RID_STOP, extract_new)) if asked else [])
            for (i, _), p in zip(queries, prompts, strict=True):
                g = next(rid) if p is not None else None
                if g is not None:
                    record(i, g)
                info = _refined(g.text) if g is not None else NO_INFO
                refined[i].append(info[:RAW_CHARS])
                room = cfg.max_total_tokens - len(ctx[i]) - reserve - len(head) - len(tail)
                ctx[i] += head + _fit(llm, info, room) + tail
                going.append(i)
        active = sorted(going)
    pending = [i for i in range(n) if answer[i] is None]
    if pending:
        prompts = []
        for i in pending:
            chain = decode(tok, ctx[i][start[i]:]).rsplit("</information>", 1)[-1]
            close = " </think>\n" if chain.rfind("<think>") > chain.rfind("</think>") else ""
            prompts.append(ctx[i] + encode(tok, close + "<answer>"))
        gens = llm.generate(prompts, _params(cfg, temperature, seed, ("</answer>",)))
        for i, g in zip(pending, gens, strict=True):
            record(i, g)
            raw[i] = g.text
            answer[i] = extract_answer(g.text)
    recs = [
        _record(ex, answer[i], retrieved_ids=retrieved[i], search_calls=calls[i], turns=turns[i],
                generated_tokens=gen_tokens[i], raw=raw[i], refined=refined[i])
        for i, ex in enumerate(examples)
    ]
    return _set_wall(recs, t0)


# -- agent ----------------------------------------------------------------------------------------------
def agent(
    examples: list[QAExample],
    llm: LLM,
    retriever: Retriever,
    cfg: AgentConfig | None = None,
    *,
    top_k: int = 3,
    temperature: float = 0.0,
    seed: int | None = 0,
    run_episodes: Callable[..., list[Any]] | None = None,
    **_: Any,
) -> list[dict[str, Any]]:
    """The Sleuth agent: one episode per question through ``run_episodes`` (default
    :func:`agent.loop.run_episodes`; any callable with its signature works, e.g. a remote agent).

    Records come from the trajectories: ``prediction = traj.answer``, ``retrieved_ids``,
    ``search_calls = traj.num_search_calls``, ``turns = traj.num_turns``, ``generated_tokens`` = policy
    tokens, plus ``stop_reason`` and the loop's ``verdict`` (which may hold an LLM judge's score).
    """
    cfg = cfg or AgentConfig()
    if run_episodes is None:
        from agent.loop import run_episodes
    t0 = time.perf_counter()
    if not examples:
        return []
    trajs = run_episodes(examples, llm, retriever, cfg, n_samples=1, temperature=temperature, top_k=top_k, seed=seed)
    if len(trajs) != len(examples):
        raise RuntimeError(f"run_episodes returned {len(trajs)} trajectories for {len(examples)} questions")
    recs = []
    for ex, tr in zip(examples, trajs, strict=True):
        if tr.question_id != ex.id:
            raise RuntimeError(f"run_episodes returned trajectory {tr.question_id!r} where {ex.id!r} was expected")
        recs.append(_record(ex, tr.answer, **trajectory_fields(tr)))
    return _set_wall(recs, t0)


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
    return _record(ex, tr.answer, **trajectory_fields(tr), question=tr.question,
                   supporting_ids=tr.metadata.get("supporting_ids"), hops=tr.metadata.get("hops"))


METHODS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "direct": direct, "rag": rag, "ircot": ircot, "agent": agent, "search_o1": search_o1,
}


def get_method(name: str) -> Callable[..., list[dict[str, Any]]]:
    """The method function called ``name``; ``ValueError`` lists the known methods."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


def make_method(name: str, llm: LLM, retriever: Retriever | None, cfg: AgentConfig | None = None, **kw: Any) -> Method:
    """Bind a method to its backend, retriever, config and options (``top_k``, ``temperature``, ``seed``,
    ``max_steps``, ``max_docs``, ``max_extract_tokens``, ``run_episodes``): returns ``examples -> records``. Raises ``ValueError``
    for an unknown method, a retrieval method without a retriever, or ``search_o1`` with
    ``agent.protocol: function_call`` (it parses the model's ``<search>`` tags)."""
    fn = get_method(name)
    if name != "direct" and retriever is None:
        raise ValueError(f"method {name!r} needs a retriever (an index); only 'direct' runs without one")
    if name == "search_o1":
        _check_tags_protocol(name, cfg or AgentConfig())
    return partial(fn, llm=llm, retriever=retriever, cfg=cfg or AgentConfig(), **kw)
