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
* ``agent``: the Sleuth agent (:func:`agent.loop.batch.run_episodes`): the policy decides when and what to
  search.

All methods speak the agent's Search-R1 tag protocol and use its prompt
(:func:`agent.protocols.build.prompt_ids`), so the same checkpoint is compared fairly: ``direct`` forces
``<answer>`` right after the prompt; ``rag`` writes the agent's first turn for it
(``<search> question </search>`` and the ``<information>`` block) and forces ``<answer>``; ``ircot`` puts all
retrieved passages in one ``<information>`` block and lets the model reason inside ``<think>``, one sentence
per step (a ``<search>`` query it writes counts as its reasoning step); ``search_o1`` continues the agent's
own turns and shows the refined information in ``<information>``.

Each method maps a batch of :class:`corpora.formats.QAExample` to one prediction record per question, in
order: ``{"id", "prediction" (str or None), "golden_answers", "retrieved_ids" (in retrieval order),
"search_calls", "turns" (LLM calls), "generated_tokens", "wall_s"}`` plus ``"raw"`` (the last model output,
for inspection). ``wall_s`` is the batch's wall time divided by its size (seconds per question, amortised
over the batched backend calls).
"""

from __future__ import annotations

import re
import time
from functools import partial
from typing import Any

from agent.config import AgentConfig
from agent.llm import LLM, Generation, decode, encode, generate_requests
from corpora.formats import QAExample
from eval.prompting import (
    EVAL_METHODS,
    TAGS,
    EvalMethod,
    Method,
    MethodContext,
    check_tags_protocol,
    extract_answer,
    information_ids,
    prediction_record,
    register_eval_method,
    sampling,
    set_wall,
    task_prompt,
    trajectory_fields,
)
from eval.search_o1 import search_o1
from retrieval.base import Hit, Retriever

__all__ = ["EVAL_METHODS", "EvalMethod", "Method", "MethodContext", "agent", "direct", "extract_answer", "get_method",
           "ircot", "make_method", "rag", "register_eval_method", "search_o1"]


# -- direct ---------------------------------------------------------------------------------------------
@register_eval_method("direct", retrieves=False, description="answer from parametric knowledge, no retrieval")
def direct(examples: list[QAExample], ctx: MethodContext) -> list[dict[str, Any]]:
    """Answer without retrieval: prompt, then a forced ``<answer>``; one batched LLM call."""
    llm, cfg, temperature, seed = ctx.llm, ctx.cfg, ctx.temperature, ctx.seed
    t0 = time.perf_counter()
    ans = encode(llm.tokenizer, "<answer>")
    prompts = [task_prompt(llm, ex.question, cfg) + ans for ex in examples]
    gens = llm.generate(prompts, sampling(cfg, temperature, seed, ("</answer>",))) if prompts else []
    recs = [
        prediction_record(ex, extract_answer(g.text), turns=1, generated_tokens=len(g.token_ids), raw=g.text)
        for ex, g in zip(examples, gens, strict=True)
    ]
    return set_wall(recs, t0)


# -- rag ------------------------------------------------------------------------------------------------
@register_eval_method("rag", description="retrieve top-k for the question once, then answer")
def rag(examples: list[QAExample], ctx: MethodContext) -> list[dict[str, Any]]:
    """Retrieve ``ctx.top_k`` passages for the question once, then answer; one batched search and one batched
    LLM call. The passages are shown as the agent's first search turn would show them (cut to
    ``cfg.max_obs_tokens`` and to the episode budget ``cfg.max_total_tokens``)."""
    llm, retriever, cfg, top_k, temperature, seed = ctx.llm, ctx.retriever, ctx.cfg, ctx.top_k, ctx.temperature, ctx.seed
    t0 = time.perf_counter()
    if not examples:
        return []
    hits = retriever.search([ex.question for ex in examples], top_k)
    ans = encode(llm.tokenizer, "<answer>")
    prompts = []
    for ex, hs in zip(examples, hits, strict=True):
        p = task_prompt(llm, ex.question, cfg) + encode(llm.tokenizer, f"<search> {ex.question} </search>")
        room = min(cfg.max_obs_tokens, cfg.max_total_tokens - len(p) - len(ans) - cfg.max_new_tokens)
        prompts.append(p + information_ids(llm, hs, cfg, room) + ans)
    gens = llm.generate(prompts, sampling(cfg, temperature, seed, ("</answer>",)))
    recs = [
        prediction_record(ex, extract_answer(g.text), retrieved_ids=[h.id for h in hs], search_calls=1, turns=1,
                generated_tokens=len(g.token_ids), raw=g.text)
        for ex, hs, g in zip(examples, hits, gens, strict=True)
    ]
    return set_wall(recs, t0)


# -- ircot ----------------------------------------------------------------------------------------------
_SEARCH = re.compile(r"<search>(.*?)(?:</search>|$)", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_ANSWER_IS = re.compile(r"answer is:?\s*(.+)", re.IGNORECASE | re.DOTALL)
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
        gens = generate_requests(llm, [(prompts[j] + ids[j], sampling(cfg, temperature, seed, IRCOT_STOP,
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
    m = _ANSWER_IS.search(TAGS.sub(" ", text))
    if m and m.group(1).strip(" .\n"):
        return "answer", m.group(1).strip(" .\n")
    m = _SEARCH.search(text)
    sentence = m.group(1).strip() if m else TAGS.sub(" ", text).strip()
    if ("</think>" in text and not m) or not sentence:
        return "done", ""
    return "sentence", " ".join(sentence.split())


@register_eval_method("ircot", description="interleave retrieval with chain-of-thought (IRCoT)")
def ircot(examples: list[QAExample], ctx: MethodContext) -> list[dict[str, Any]]:
    """IRCoT (Trivedi et al. 2023, Alg. 1) in the tag protocol, batched across questions.

    Retrieve ``ctx.top_k`` for the question; then for up to ``ctx.max_steps`` (default ``cfg.max_turns``)
    steps: generate one sentence inside ``<think>`` given all passages so far (deduplicated, first
    ``ctx.max_docs`` kept, IRCoT's cap on paragraphs), stop if it answers (an ``<answer>`` tag or "answer is
    ..."), else retrieve ``top_k`` more with the sentence. Finally, unanswered questions get ``</think>`` and a forced
    ``<answer>``. Every step is one batched search and one batched LLM call over the questions still
    running, plus one batched call per round of continuing the steps that stopped at a "." which ends no
    sentence ("St.", "U.S.", "1."; :func:`_ircot_steps`), all of a step's rounds within
    ``cfg.max_new_tokens``. ``turns`` counts every LLM call, ``generated_tokens`` every token generated
    within the budgets.
    """
    llm, retriever, cfg, top_k, temperature, seed = ctx.llm, ctx.retriever, ctx.cfg, ctx.top_k, ctx.temperature, ctx.seed
    max_steps, max_docs = cfg.max_turns if ctx.max_steps is None else ctx.max_steps, ctx.max_docs
    t0 = time.perf_counter()
    n = len(examples)
    if n == 0:
        return []
    tok = llm.tokenizer
    base = [task_prompt(llm, ex.question, cfg) for ex in examples]
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
        return base[i] + information_ids(llm, list(docs[i].values()), cfg, room) + think

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
                            sampling(cfg, temperature, seed, ("</answer>",)))
        for i, g in zip(pending, gens, strict=True):
            record(i, g)
            answer[i] = extract_answer(g.text)
    recs = [
        prediction_record(ex, answer[i], retrieved_ids=retrieved[i], search_calls=calls[i], turns=turns[i],
                generated_tokens=gen_tokens[i], raw=raw[i], reasoning=" ".join(cot[i]))
        for i, ex in enumerate(examples)
    ]
    return set_wall(recs, t0)


# -- agent ----------------------------------------------------------------------------------------------
@register_eval_method("agent", episodes=True, description="the Sleuth agent: the policy decides when and what to search")
def agent(examples: list[QAExample], ctx: MethodContext) -> list[dict[str, Any]]:
    """The Sleuth agent: one episode per question through ``ctx.run_episodes`` (default
    :func:`agent.loop.batch.run_episodes`; any callable with its signature works, e.g. a remote agent), judged
    by ``ctx.judge`` (default: the agent config's own; rule metrics score the records either way).
    ``ctx.on_trajectories`` gets each batch's trajectories (e.g. to save them beside the predictions).

    Records come from the trajectories: ``prediction = traj.answer``, ``retrieved_ids``,
    ``search_calls = traj.num_search_calls``, ``turns = traj.num_turns``, ``generated_tokens`` = policy
    tokens, plus ``stop_reason`` and the loop's ``verdict`` (which may hold an LLM judge's score).
    """
    run_episodes = ctx.run_episodes
    if run_episodes is None:
        from agent.loop.batch import run_episodes
    t0 = time.perf_counter()
    if not examples:
        return []
    kw = {"judge": ctx.judge} if ctx.judge is not None else {}
    trajs = run_episodes(examples, ctx.llm, ctx.retriever, ctx.cfg, n_samples=1, temperature=ctx.temperature,
                         top_k=ctx.top_k, seed=ctx.seed, **kw)
    if ctx.on_trajectories is not None:
        ctx.on_trajectories(trajs)
    if len(trajs) != len(examples):
        raise RuntimeError(f"run_episodes returned {len(trajs)} trajectories for {len(examples)} questions")
    recs = []
    for ex, tr in zip(examples, trajs, strict=True):
        if tr.question_id != ex.id:
            raise RuntimeError(f"run_episodes returned trajectory {tr.question_id!r} where {ex.id!r} was expected")
        recs.append(prediction_record(ex, tr.answer, **trajectory_fields(tr)))
    return set_wall(recs, t0)


register_eval_method("search_o1", tags=True,  # (its own module: eval/search_o1.py)
                     description="Search-o1: the model searches, Reason-in-Documents condenses what it finds")(search_o1)


def get_method(name: str) -> EvalMethod:
    """The registered method called ``name`` (:data:`EVAL_METHODS`); ``ValueError`` names the registered ones
    and the closest."""
    return EVAL_METHODS.get(name)


def make_method(name: str, llm: LLM, retriever: Retriever | None, cfg: AgentConfig | None = None, **kw: Any) -> Method:
    """Bind a method to its backend, retriever, config and settings (:class:`MethodContext`'s fields:
    ``top_k``, ``temperature``, ``seed``, ``max_steps``, ``max_docs``, ``max_extract_tokens``, ``run_episodes``,
    ``on_trajectories``, ``options``...): returns ``examples -> records``. Raises ``ValueError`` for an unknown
    method or setting, a method that retrieves without a retriever, or a method that reads the ``<search>``
    tags (``search_o1``) under a protocol without them (``agent.protocol: function_call``)."""
    entry = get_method(name)
    cfg = cfg or AgentConfig()
    if entry.retrieves and retriever is None:
        plain = [n for n in EVAL_METHODS if not EVAL_METHODS.get(n).retrieves]
        raise ValueError(f"method {name!r} needs a retriever (an index); only {' and '.join(map(repr, plain))} "
                         f"{'runs' if len(plain) == 1 else 'run'} without one")
    if entry.tags:
        check_tags_protocol(name, cfg)
    known = set(MethodContext.__dataclass_fields__) - {"llm", "retriever", "cfg"}
    if unknown := sorted(set(kw) - known):
        raise ValueError(f"unknown setting(s) {unknown} of method {name!r}; known: {', '.join(sorted(known))}")
    return partial(entry.run, ctx=MethodContext(llm, retriever, cfg, **kw))
