"""The agent served as a question-answering tool (FastAPI): ``/ask``, OpenAI-compatible chat, ``/health``.

* ``POST /ask`` ``{"question": str, "golden_answers"?: [str], "top_k"?: int, "max_turns"?: int}`` -> the
  answer, the evidence documents (ids, titles, contents, scores, in retrieval order) and the whole
  trajectory. ``top_k`` (documents per search) is at most ``max_top_k``, ``max_turns`` at most the server's
  ``agent.max_turns`` (422 otherwise); left out, the server's own settings are used.
* ``POST /v1/chat/completions`` (OpenAI-compatible): the last user message is the question; the reply's
  content is the agent's answer, and a ``sleuth`` field carries the evidence and stop reason. Existing
  clients (the ``openai`` package, LangChain's ``ChatOpenAI``) can use the agent as a model. The request
  may carry ``top_k``, ``max_turns`` and ``golden_answers`` as /ask takes them (``extra_body`` in the
  ``openai`` client); with golden answers the ``sleuth`` field has the judge's ``verdict``. With
  ``stream: true`` the server-sent events follow the episode turn by turn: a role chunk; each policy
  turn's generated text as ``delta: {"reasoning_content": text}`` (the field vLLM's and DeepSeek's
  reasoning models use; turns after the first start with a blank line) with
  ``sleuth: {"event": "turn", "turn", "action", "error"?, "judgement"?}`` (``error``: why an invalid action
  was invalid; ``judgement``: the turn's self-judge of the previous search, when it made one); each search
  as an empty delta with ``sleuth: {"event": "search", "turn", "query", "doc_ids", "hits"}`` (``hits``: the
  retrieved passages in order, each ``{"id", "title", "text", "score"}``, ``text`` without the title line,
  ``score`` this query's); then the answer as
  ``delta: {"content": answer}``, the finish chunk with the ``sleuth`` evidence, and ``data: [DONE]``. A
  request over ``max_inflight`` gets the plain 503 before any stream starts (so clients retry it); a
  failure of the episode (504, 502) arrives as one ``data: {"error": {...}}`` event; a client that
  disconnects cancels its episode. The OpenAI fields are honoured or refused with an error naming them
  (:mod:`agent.chat_params`): ``model`` must be the served name (404 ``model_not_found``); ``n`` runs that
  many episodes (at most ``max_n``; one choice each, with its own ``sleuth`` field; the top-level one is the
  first choice's; streamed, each event carries its choice's index); ``max_tokens`` (or
  ``max_completion_tokens``) caps the tokens the episode adds after the prompt; ``temperature`` and
  ``top_p`` sample every turn; ``stream_options.include_usage`` adds OpenAI's usage chunk; ``stop``,
  ``seed``, ``logprobs``, penalties, ``tools`` and JSON ``response_format`` get 400.
* ``GET /health``: status, counters (``inflight``: episode slots taken; ``running_episodes``: episodes the
  scheduler runs now; ``tasks``: the event loop's tasks, for spotting a leak) and the per-request ``limits``
  a client may choose within (``top_k``/``max_top_k``, ``max_turns``, ``max_question_chars``).
* ``GET /``: a browser page over the streaming endpoint (:mod:`agent.webui`; no key needed to load it).

All requests share one :class:`agent.scheduler.Scheduler` living in the server's event loop, so concurrent
requests are episodes whose generation and search calls are batched together. Limits: request bodies over
``max_body_bytes`` get 413, bodies that are not JSON (or nest too deeply to decode, or hold an integer of
over 4,300 digits) 400, empty or over-long questions 422 (over ``max_question_chars``, or a prompt that
leaves no token of the agent's ``max_total_tokens`` to generate: the message says by how many tokens),
text with a lone surrogate 422, more than ``max_inflight`` episodes 503 with ``Retry-After:``
:data:`BUSY_RETRY_AFTER_S` (streamed or not; the slot is taken in one step with the check and freed however
the episode ends; the ``openai`` client and httpx retry loops wait that long), an episode over
``request_timeout_s`` 504, a backend failure 502 (only the episodes whose own call failed: the scheduler
retries a failed batch's calls one by one), an unknown route 404 or method 405, anything unexpected 500 -
each with the reason in ``{"error": {"message", "type"}}``; the server keeps serving.
With ``api_key`` set (not empty), every route but ``/health`` and the page (``/``, ``/static/*``) needs
``Authorization: Bearer <key>`` (401 otherwise).
A client that disconnects before its answer (streamed or not) cancels its episode. Binds 127.0.0.1 by
default (see ``sleuth serve``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent.chat_params import MAX_N, ChatParams, ParamError, parse_chat_params
from agent.external import merged
from agent.judges import Judge, rule_judge
from agent.llm import LLM
from agent.loop import EventSink, make_context, run_episode
from agent.protocol import prompt_ids
from agent.trajectory import Trajectory
from agent.webui import add_page_routes
from corpora.formats import QAExample
from retrieval.base import Hit, Retriever


@dataclass
class ServeLimits:
    """Request limits: bytes of a request body, characters of a question, seconds per episode, episodes
    in flight at once, top-k documents per search, episodes (choices, ``n``) per chat request."""

    max_body_bytes: int = 64_000
    max_question_chars: int = 4_000
    request_timeout_s: float = 120.0
    max_inflight: int = 512
    max_top_k: int = 20
    max_n: int = MAX_N


BUSY_RETRY_AFTER_S = 1
"""Seconds a busy server's 503 (over ``max_inflight``) asks a client to wait (``Retry-After``) before retrying."""


class HTTPError(Exception):
    """An error reply: HTTP ``status``, ``message`` and OpenAI error ``kind``; ``retry_after`` (seconds, or
    ``None``) becomes a ``Retry-After`` header; ``param`` and ``code`` are OpenAI's error fields (the request
    field at fault, ``model_not_found``...)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 retry_after: int | None = None, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.retry_after = status, message, kind, retry_after
        self.param, self.code = param, code


class _EvidenceRetriever:
    """Wraps the retriever and remembers the hits it returned (bounded LRU by id), to report evidence."""

    def __init__(self, inner: Retriever, capacity: int = 100_000):
        self.inner, self.capacity = inner, capacity
        self.hits: OrderedDict[str, Hit] = OrderedDict()

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        res = self.inner.search(queries, k)
        for hits in res:
            for h in hits:
                self.hits[h.id] = h
                self.hits.move_to_end(h.id)
        while len(self.hits) > self.capacity:
            self.hits.popitem(last=False)
        return res


def _check_unicode(s: str, what: str) -> None:
    """Raise a 422 :class:`HTTPError` when ``s`` holds a lone surrogate (``"\\ud800"`` is valid JSON but no
    Unicode text: tokenizers and UTF-8 output cannot take it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(422, f"{what} holds a lone surrogate (\\u{ord(s[e.start]):04x}) at character {e.start}; "
                             "send valid Unicode text") from None


class _SlotStream(StreamingResponse):
    """A streamed reply holding an episode slot: when the response ends, however it ends (streamed to the
    end, the client gone, a failure, or never iterated at all), the body generator is closed (its
    ``finally`` cancels a running episode) and ``release`` frees the slot."""

    def __init__(self, content: Any, release: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                if (aclose := getattr(self.body_iterator, "aclose", None)) is not None:
                    await aclose()
            finally:
                self.release()


def _int_in(v: Any, lo: int, hi: int) -> bool:
    """Whether ``v`` is an integer (a JSON bool is not) in ``[lo, hi]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _error(status: int, message: str, kind: str = "invalid_request_error", retry_after: int | None = None,
           param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def create_app(llm: LLM, retriever: Retriever, agent_cfg: Any, *, top_k: int = 3, temperature: float = 0.0,
               api_key: str | None = None, model_name: str = "sleuth-agent",
               limits: ServeLimits | None = None, judge: Judge | None = None, external: Any = None) -> FastAPI:
    """Build the app around one policy backend and one retriever (see the module docstring). ``judge``
    scores answers sent with golden answers (default: :func:`agent.loop.make_context`'s, from
    ``agent_cfg.judge``). ``external`` (an :class:`agent.external.ExternalRunner`, ``agent.kind: external``)
    answers with the external agent instead of the built-in loop: its own tools search, so a request's
    ``top_k``, ``max_turns`` and temperature do not apply, a stream carries no turn or search events, and the
    evidence is empty."""
    limits = limits or ServeLimits()
    evidence = _EvidenceRetriever(retriever)
    ctx = make_context(llm, evidence, agent_cfg, temperature=temperature, top_k=top_k, judge=judge)
    app = FastAPI(title="Sleuth agent", version="0.1")
    app.state.ctx = ctx
    app.state.inflight = 0
    app.state.served = 0

    # -- plumbing -------------------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if not api_key:  # None or "": no key, open (as `sleuth serve --api-key ""` documents)
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            raise HTTPError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error")

    async def read_json(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise HTTPError(413, f"request body of {declared} bytes exceeds {limits.max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limits.max_body_bytes:
                raise HTTPError(413, f"request body exceeds {limits.max_body_bytes} bytes")
        try:
            obj = json.loads(body)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past the int-string digit limit
            raise HTTPError(400, f"request body is not valid JSON ({e})") from None
        except RecursionError:  # valid JSON, but deeper than the decoder's recursion limit
            raise HTTPError(400, "request body is JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return obj

    def check_question(q: Any) -> str:
        if not isinstance(q, str):
            raise HTTPError(422, "the question must be a string")
        q = q.strip()
        if not q:
            raise HTTPError(422, "the question is empty")
        _check_unicode(q, "the question")
        if len(q) > limits.max_question_chars:
            raise HTTPError(422, f"the question has {len(q)} characters; the limit is {limits.max_question_chars}")
        # a short question can still be many tokens (CJK): a prompt that fills the episode's token budget
        # would end at once with no answer (stop_reason max_tokens), so it is refused with the numbers
        n, budget = len(prompt_ids(ctx.tokenizer, q, agent_cfg)), agent_cfg.max_total_tokens
        if n >= budget:
            raise HTTPError(422, f"the prompt of this question is {n} tokens, {n - budget + 1} more than fit "
                                 f"agent.max_total_tokens={budget} with one token left to generate")
        return q

    def episode_options(obj: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        """A request's ``golden_answers`` (``[]`` when left out), ``top_k`` and ``max_turns`` (``None`` when
        left out: the server's own), or a 422 :class:`HTTPError` naming the field and its range."""
        golds = obj.get("golden_answers")
        golds = [] if golds is None else golds
        if not isinstance(golds, list) or not all(isinstance(g, str) for g in golds):
            raise HTTPError(422, "golden_answers must be a list of strings")
        for g in golds:
            _check_unicode(g, "a golden answer")
        k, turns = obj.get("top_k"), obj.get("max_turns")
        if k is not None and not _int_in(k, 1, limits.max_top_k):
            raise HTTPError(422, f"top_k must be an integer in [1, {limits.max_top_k}]")
        if turns is not None and not _int_in(turns, 1, agent_cfg.max_turns):
            raise HTTPError(422, f"max_turns must be an integer in [1, {agent_cfg.max_turns}] "
                                 "(the server's agent.max_turns)")
        return golds, k, turns

    def sampling_update(question: str, p: ChatParams) -> dict[str, Any]:
        """The ``agent_cfg`` fields a chat request sets: ``top_p``, and for ``max_tokens`` the episode's token
        budget cut to the prompt plus ``max_tokens`` (never above ``agent.max_total_tokens``)."""
        update: dict[str, Any] = {}
        if p.top_p is not None:
            update["top_p"] = p.top_p
        if p.max_tokens is not None:
            n_prompt = len(prompt_ids(ctx.tokenizer, question, agent_cfg))
            update["max_total_tokens"] = min(agent_cfg.max_total_tokens, n_prompt + p.max_tokens)
        return update

    def take_slot() -> Callable[[], None]:
        """Take one of the ``max_inflight`` episode slots, or raise a 503 :class:`HTTPError` when all are
        taken (with ``Retry-After:`` :data:`BUSY_RETRY_AFTER_S`). The check and the taking are one step (no
        ``await`` between them: two requests cannot both pass a full server). Returns the slot's release,
        which frees it once however often it is called."""
        if app.state.inflight >= limits.max_inflight:
            raise HTTPError(503, f"server busy: {limits.max_inflight} episodes in flight", "server_error",
                            retry_after=BUSY_RETRY_AFTER_S)
        app.state.inflight += 1
        taken = True

        def release() -> None:
            nonlocal taken
            if taken:
                taken = False
                app.state.inflight -= 1

        return release

    async def episode(question: str, golds: list[str], k: int | None, on_event: EventSink | None = None,
                      release: Callable[[], None] | None = None, turns: int | None = None,
                      temp: float | None = None, cfg_update: dict[str, Any] | None = None) -> Trajectory:
        """Run one episode (``k`` documents per search, at most ``turns`` turns, sampled at ``temp``, with
        ``cfg_update`` over ``agent_cfg``; ``None``: the server's own) in a slot of ``max_inflight``
        (``release``: one the caller took with :func:`take_slot`; by default it is taken here) and free the
        slot when it ends, however it ends.
        Raises :class:`HTTPError` 503 (no slot), 504 (over ``request_timeout_s``) or 502 (backend failure)."""
        release = release or take_slot()
        try:
            ex = QAExample(id=f"req-{uuid.uuid4().hex[:12]}", question=question, golden_answers=golds or [""])
            # no gold: nothing to judge, and no verdict is returned, so an LLM judge would only cost a generation
            plain = not golds and getattr(agent_cfg, "judge", "rule") == "llm"
            update = dict(cfg_update or {})
            if turns not in (None, agent_cfg.max_turns):
                update["max_turns"] = turns
            cfg = agent_cfg.model_copy(update=update) if update else agent_cfg
            t = temperature if temp is None else temp
            same = (k is None or k == ctx.top_k) and cfg is agent_cfg and t == temperature and not plain
            run_ctx = ctx if same else make_context(llm, evidence, cfg, temperature=t, top_k=k or ctx.top_k,
                                                    judge=rule_judge() if plain else ctx.judge,
                                                    scheduler=ctx.scheduler)
            if external is not None:  # the external agent's episode, one record however the template split it
                seqs = await asyncio.wait_for(external.run_episode(ex, judge=rule_judge() if plain else None),
                                              limits.request_timeout_s)
                traj = merged(seqs)
            else:
                traj = await asyncio.wait_for(run_episode(run_ctx, ex, on_event=on_event), limits.request_timeout_s)
        except TimeoutError:
            raise HTTPError(504, f"the episode took longer than {limits.request_timeout_s} s", "timeout") from None
        finally:
            release()
        if traj.stop_reason == "error":
            raise HTTPError(502, f"the episode failed: {traj.metadata.get('error')}", "backend_error")
        app.state.served += 1
        return traj

    def take_slots(n: int) -> list[Callable[[], None]]:
        """:func:`take_slot` ``n`` times, all or none (a 503 :class:`HTTPError` frees those taken)."""
        releases: list[Callable[[], None]] = []
        try:
            for _ in range(n):
                releases.append(take_slot())
        except HTTPError:
            for r in releases:
                r()
            raise
        return releases

    async def episodes(run: Callable[..., Awaitable[Trajectory]], n: int) -> list[Trajectory]:
        """``n`` episodes ``run(release=...)`` at once, each in a slot taken here (all or none: 503); the
        first failure fails the request and cancels the others; every slot is freed however it ends."""
        releases = take_slots(n)
        tasks = [asyncio.ensure_future(run(release=r)) for r in releases]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in releases:
                r()

    async def unless_hung_up(request: Request, coro: Awaitable[Trajectory]) -> Trajectory:
        """Await ``coro`` (an :func:`episode`) unless the client disconnects first: then the episode is
        cancelled (its slot of ``max_inflight`` and its queued backend calls are freed) and a 499
        :class:`HTTPError` is raised (no one reads it). The request body must have been read."""
        task = asyncio.ensure_future(coro)

        async def hung_up() -> None:  # after the body, the server's next message is the disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
        if task.cancelled() or not task.done():
            await asyncio.gather(task, return_exceptions=True)  # let the episode unwind
            raise HTTPError(499, "the client closed the request", "client_closed_request")
        return task.result()

    def evidence_of(traj: Trajectory) -> list[dict[str, Any]]:
        seen, out = set(), []
        for i in traj.retrieved_ids:
            if i in seen:
                continue
            seen.add(i)
            h = evidence.hits.get(i)
            out.append(h.to_json() if h else {"id": i})
        return out

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return _error(exc.status, exc.message, exc.kind, exc.retry_after, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)  # an unknown route (404), a wrong method (405)
    async def _route_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(Exception)  # a bug: still a JSON 500 with the reason (the traceback is logged)
    async def _internal_error(request: Request, exc: Exception):
        return _error(500, f"internal server error ({type(exc).__name__}: {exc})", "server_error")

    # -- routes ---------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        s = ctx.scheduler
        return {"status": "ok", "model": model_name, "inflight": app.state.inflight, "served": app.state.served,
                "running_episodes": s.active, "tasks": len(asyncio.all_tasks()),
                "batches": s.stats["generate_batches"], "prompts": s.stats["generate_prompts"],
                "limits": {"top_k": ctx.top_k, "max_top_k": limits.max_top_k, "max_turns": agent_cfg.max_turns,
                           "max_question_chars": limits.max_question_chars}}

    add_page_routes(app)  # GET /: the browser page (no key needed to load it; it asks for the key)

    @app.post("/ask")
    async def ask(request: Request):
        check_auth(request)
        obj = await read_json(request)
        q = check_question(obj.get("question"))
        golds, k, turns = episode_options(obj)
        traj = await unless_hung_up(request, episode(q, golds, k, turns=turns))
        return {"answer": traj.answer, "stop_reason": traj.stop_reason, "evidence": evidence_of(traj),
                "searches": traj.num_search_calls, "verdict": traj.verdict if golds else None,
                "trajectory": traj.to_json()}

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "sleuth"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_auth(request)
        obj = await read_json(request)
        msgs = obj.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise HTTPError(422, "messages must be a non-empty list")
        user = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
        if not user:
            raise HTTPError(422, "no user message")
        content = user[-1].get("content")
        if isinstance(content, list):  # content parts: the text parts are the question
            if not all(isinstance(p, dict) and (p.get("type") != "text" or isinstance(p.get("text"), str))
                       for p in content):
                raise HTTPError(422, "message content parts must be objects; a text part needs a string 'text'")
            content = " ".join(p["text"] for p in content if p.get("type") == "text")
        elif not isinstance(content, str):
            raise HTTPError(422, "message content must be a string or a list of content parts")
        q = check_question(content)
        golds, k, turns = episode_options(obj)
        try:
            p = parse_chat_params(obj, model_name, limits.max_n)
        except ParamError as e:
            raise HTTPError(e.status, e.message, param=e.param, code=e.code) from None
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        run = functools.partial(episode, q, golds, k, turns=turns, temp=p.temperature,
                                cfg_update=sampling_update(q, p))

        def reply(traj: Trajectory) -> tuple[str, str, dict[str, Any]]:
            finish = "stop" if traj.answer is not None else "length"
            extra = {"stop_reason": traj.stop_reason, "searches": traj.num_search_calls,
                     "evidence": evidence_of(traj), "verdict": traj.verdict if golds else None}
            return traj.answer or "", finish, extra

        def usage(trajs: list[Trajectory]) -> dict[str, int]:  # the prompt once, the policy's tokens of every choice
            n_prompt, n_gen = trajs[0].prompt_len, sum(t.num_policy_tokens for t in trajs)
            return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}

        if not p.stream:
            trajs = await unless_hung_up(request, episodes(run, p.n))
            choices = []
            for i, traj in enumerate(trajs):
                text, finish, extra = reply(traj)
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": finish, "sleuth": extra})
            return {"id": cid, "object": "chat.completion", "created": created, "model": p.model,
                    "choices": choices, "usage": usage(trajs), "sleuth": choices[0]["sleuth"]}

        def chunk(i: int, delta: dict[str, Any], finish: str | None = None, **more: Any) -> str:
            c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": p.model,
                 "choices": [{"index": i, "delta": delta, "finish_reason": finish}], **more}
            if p.include_usage:
                c["usage"] = None
            return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

        def progress(i: int, event: dict[str, Any], first_turn: bool) -> str:
            if event["type"] == "turn":
                text = event["text"] if first_turn else "\n\n" + event["text"]
                more = {f: event[f] for f in ("error", "judgement") if event.get(f) is not None}
                return chunk(i, {"reasoning_content": text},
                             sleuth={"event": "turn", "turn": event["turn"], "action": event["action"], **more})
            hits = [{"id": h.id, "title": h.title, "text": h.text, "score": float(h.score)} for h in event["hits"]]
            return chunk(i, {}, sleuth={"event": "search", "turn": event["turn"], "query": event["query"],
                                        "doc_ids": event["doc_ids"], "hits": hits})

        # the slots are taken before the stream starts: a client over max_inflight gets a plain 503 (OpenAI
        # clients retry it), not a 200 whose stream then carries the error
        releases = take_slots(p.n)

        async def events():
            # each episode runs as its own task and hands its progress events over one queue, tagged with its
            # choice index; (i, None) = episode i ended
            queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()
            tasks = []
            for i, rel in enumerate(releases):
                async def sink(event: dict[str, Any], i: int = i) -> None:
                    await queue.put((i, event))

                tasks.append(asyncio.create_task(run(on_event=sink, release=rel)))
                tasks[-1].add_done_callback(lambda _, i=i: queue.put_nowait((i, None)))
            try:
                for i in range(p.n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                first_turn, running = [True] * p.n, p.n
                while running:
                    i, event = await queue.get()
                    if event is None:
                        running -= 1
                        if isinstance(e := tasks[i].exception(), HTTPError):
                            yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'code': e.status}})}\n\n"
                            return
                        continue
                    yield progress(i, event, first_turn[i])
                    first_turn[i] = first_turn[i] and event["type"] != "turn"
                trajs = [t.result() for t in tasks]
                for i, traj in enumerate(trajs):
                    text, finish, extra = reply(traj)
                    if text:
                        yield chunk(i, {"content": text})
                    yield chunk(i, {}, finish, sleuth=extra)
                if p.include_usage:  # as OpenAI: a last chunk without choices, carrying the request's usage
                    last = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": p.model,
                            "choices": [], "usage": usage(trajs)}
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or the stream ended): never leave an episode running
                for t in tasks:
                    if not t.done():
                        t.cancel()
                    elif not t.cancelled():
                        t.exception()  # retrieved: no "exception was never retrieved" after a disconnect

        return _SlotStream(events(), lambda: [r() for r in releases], media_type="text/event-stream")

    return app
