"""What the routes of ``sleuth serve`` share (:mod:`agent.serve.app`, :mod:`agent.serve.chat_api`): the
:class:`AgentService` (the backend, the evidence-recording retriever, one scheduler for every request, the
request checks and the episode runs in slots of ``max_inflight``), the request limits (:class:`ServeLimits`)
and the error replies (:class:`HTTPError`)."""
from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from agent.external.runner import merged
from agent.judges import Judge, rule_judge
from agent.llm import LLM
from agent.loop.episode import EventSink, run_episode
from agent.loop.nodes import make_context
from agent.protocols.build import prompt_ids
from agent.serve.chat_params import MAX_N, ChatParams
from agent.trajectory import Trajectory
from corpora.formats import QAExample
from retrieval.base import Hit, Retriever
from retrieval.http_guard import GuardError, RequestGuard


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


class EvidenceRetriever:
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


def check_unicode(s: str, what: str) -> None:
    """Raise a 422 :class:`HTTPError` when ``s`` holds a lone surrogate (``"\\ud800"`` is valid JSON but no
    Unicode text: tokenizers and UTF-8 output cannot take it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(422, f"{what} holds a lone surrogate (\\u{ord(s[e.start]):04x}) at character {e.start}; "
                             "send valid Unicode text") from None


class SlotStream(StreamingResponse):
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


def int_in(v: Any, lo: int, hi: int) -> bool:
    """Whether ``v`` is an integer (a JSON bool is not) in ``[lo, hi]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def error_reply(status: int, message: str, kind: str = "invalid_request_error", retry_after: int | None = None,
           param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class AgentService:
    """What the routes share: the policy backend, the evidence-recording retriever, the agent's context (one
    scheduler for every request), the limits, and the request checks and episode runs every route uses.
    ``state`` is the app's ``state`` (``inflight``: episode slots taken; ``served``: episodes answered)."""

    def __init__(self, state: Any, llm: LLM, retriever: Retriever, agent_cfg: Any, *, top_k: int, temperature: float,
                 api_key: str | None, model_name: str, limits: ServeLimits, judge: Judge | None, external: Any):
        self.state, self.llm, self.agent_cfg, self.limits = state, llm, agent_cfg, limits
        self.temperature, self.api_key, self.model_name, self.external = temperature, api_key, model_name, external
        self.guard = RequestGuard(api_key, limits.max_body_bytes)
        self.evidence = EvidenceRetriever(retriever)
        self.ctx = make_context(llm, self.evidence, agent_cfg, temperature=temperature, top_k=top_k, judge=judge)
        state.ctx, state.inflight, state.served = self.ctx, 0, 0

    # -- request checks -------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        """A 401 :class:`HTTPError` without ``Authorization: Bearer <api_key>`` (none or empty key: open, as
        ``sleuth serve --api-key ""`` documents); the shared :class:`retrieval.http_guard.RequestGuard`."""
        try:
            self.guard.check_auth(request.headers.get("authorization"))
        except GuardError as e:
            raise HTTPError(e.status, e.message, e.kind) from None

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, read within ``max_body_bytes`` (413), or a 400 :class:`HTTPError` (not JSON,
        nested too deeply, an over-long integer, not an object): the shared
        :class:`retrieval.http_guard.RequestGuard`."""
        try:
            return await self.guard.read_json(request)
        except GuardError as e:
            raise HTTPError(e.status, e.message, e.kind) from None

    def check_question(self, q: Any) -> str:
        """The stripped question, or a 422 :class:`HTTPError` (not text, empty, too long, a lone surrogate, or
        a prompt that fills the episode's token budget)."""
        if not isinstance(q, str):
            raise HTTPError(422, "the question must be a string")
        q = q.strip()
        if not q:
            raise HTTPError(422, "the question is empty")
        check_unicode(q, "the question")
        if len(q) > self.limits.max_question_chars:
            raise HTTPError(422, f"the question has {len(q)} characters; the limit is {self.limits.max_question_chars}")
        # a short question can still be many tokens (CJK): a prompt that fills the episode's token budget
        # would end at once with no answer (stop_reason max_tokens), so it is refused with the numbers
        n, budget = len(prompt_ids(self.ctx.tokenizer, q, self.agent_cfg)), self.agent_cfg.max_total_tokens
        if n >= budget:
            raise HTTPError(422, f"the prompt of this question is {n} tokens, {n - budget + 1} more than fit "
                                 f"agent.max_total_tokens={budget} with one token left to generate")
        return q

    def episode_options(self, obj: dict[str, Any]) -> tuple[list[str], int | None, int | None]:
        """A request's ``golden_answers`` (``[]`` when left out), ``top_k`` and ``max_turns`` (``None`` when
        left out: the server's own), or a 422 :class:`HTTPError` naming the field and its range (for an
        external agent, any value but the server's own: it would not apply)."""
        golds = obj.get("golden_answers")
        golds = [] if golds is None else golds
        if not isinstance(golds, list) or not all(isinstance(g, str) for g in golds):
            raise HTTPError(422, "golden_answers must be a list of strings")
        for g in golds:
            check_unicode(g, "a golden answer")
        k, turns = obj.get("top_k"), obj.get("max_turns")
        if k is not None and not int_in(k, 1, self.limits.max_top_k):
            raise HTTPError(422, f"top_k must be an integer in [1, {self.limits.max_top_k}]")
        if turns is not None and not int_in(turns, 1, self.agent_cfg.max_turns):
            raise HTTPError(422, f"max_turns must be an integer in [1, {self.agent_cfg.max_turns}] "
                                 "(the server's agent.max_turns)")
        if self.external is not None:  # its own tools search: a value other than the server's would be ignored
            for name, got, own in (("top_k", k, self.ctx.top_k), ("max_turns", turns, self.agent_cfg.max_turns)):
                if got is not None and got != own:
                    raise HTTPError(422, f"{name}={got} does not apply to this server's agent (agent.kind=external "
                                         f"searches with its own tools): leave it out or send {own}", param=name)
        return golds, k, turns

    def sampling_update(self, question: str, p: ChatParams) -> dict[str, Any]:
        """The ``agent_cfg`` fields a chat request sets: ``top_p``, and for ``max_tokens`` the episode's token
        budget cut to the prompt plus ``max_tokens`` (never above ``agent.max_total_tokens``). For an external
        agent, whose own code decides how many model calls it makes, ``max_tokens`` has no meaning the server
        could keep: a 400 :class:`HTTPError` naming it."""
        if self.external is not None and p.max_tokens is not None:
            raise HTTPError(400, "max_tokens (max_completion_tokens) does not apply to this server's agent "
                                 "(agent.kind=external: its own code decides how many model calls it makes, each "
                                 f"of at most agent.max_new_tokens={self.agent_cfg.max_new_tokens} tokens); leave "
                                 "it out", param="max_tokens", code="unsupported_parameter")
        update: dict[str, Any] = {}
        if p.top_p is not None:
            update["top_p"] = p.top_p
        if p.max_tokens is not None:
            n_prompt = len(prompt_ids(self.ctx.tokenizer, question, self.agent_cfg))
            update["max_total_tokens"] = min(self.agent_cfg.max_total_tokens, n_prompt + p.max_tokens)
        return update

    # -- episode slots and runs -----------------------------------------------------------------------
    def take_slot(self) -> Callable[[], None]:
        """Take one of the ``max_inflight`` episode slots, or raise a 503 :class:`HTTPError` when all are
        taken (with ``Retry-After:`` :data:`BUSY_RETRY_AFTER_S`). The check and the taking are one step (no
        ``await`` between them: two requests cannot both pass a full server). Returns the slot's release,
        which frees it once however often it is called."""
        state = self.state
        if state.inflight >= self.limits.max_inflight:
            raise HTTPError(503, f"server busy: {self.limits.max_inflight} episodes in flight", "server_error",
                            retry_after=BUSY_RETRY_AFTER_S)
        state.inflight += 1
        taken = True

        def release() -> None:
            nonlocal taken
            if taken:
                taken = False
                state.inflight -= 1

        return release

    def take_slots(self, n: int) -> list[Callable[[], None]]:
        """:meth:`take_slot` ``n`` times, all or none (a 503 :class:`HTTPError` frees those taken)."""
        releases: list[Callable[[], None]] = []
        try:
            for _ in range(n):
                releases.append(self.take_slot())
        except HTTPError:
            for r in releases:
                r()
            raise
        return releases

    def episode_context(self, k: int | None, turns: int | None, temp: float | None,
                        cfg_update: dict[str, Any] | None, plain: bool):
        """The agent context of one episode: the server's own, or one over the same scheduler with the
        request's ``k``, ``turns``, temperature and config fields (``plain``: the rule judge)."""
        ctx, agent_cfg = self.ctx, self.agent_cfg
        update = dict(cfg_update or {})
        if turns not in (None, agent_cfg.max_turns):
            update["max_turns"] = turns
        cfg = agent_cfg.model_copy(update=update) if update else agent_cfg
        t = self.temperature if temp is None else temp
        if (k is None or k == ctx.top_k) and cfg is agent_cfg and t == self.temperature and not plain:
            return ctx
        return make_context(self.llm, self.evidence, cfg, temperature=t, top_k=k or ctx.top_k,
                            judge=rule_judge() if plain else ctx.judge, scheduler=ctx.scheduler)

    async def episode(self, question: str, golds: list[str], k: int | None, on_event: EventSink | None = None,
                      release: Callable[[], None] | None = None, turns: int | None = None,
                      temp: float | None = None, cfg_update: dict[str, Any] | None = None) -> Trajectory:
        """Run one episode (``k`` documents per search, at most ``turns`` turns, sampled at ``temp``, with
        ``cfg_update`` over ``agent_cfg``; ``None``: the server's own) in a slot of ``max_inflight``
        (``release``: one the caller took with :meth:`take_slot`; by default it is taken here) and free the
        slot when it ends, however it ends.
        Raises :class:`HTTPError` 503 (no slot), 504 (over ``request_timeout_s``) or 502 (backend failure)."""
        release = release or self.take_slot()
        timeout = self.limits.request_timeout_s
        try:
            ex = QAExample(id=f"req-{uuid.uuid4().hex[:12]}", question=question, golden_answers=golds or [""])
            # no gold: nothing to judge, and no verdict is returned, so an LLM judge would only cost a generation
            plain = not golds and getattr(self.agent_cfg, "judge", "rule") == "llm"
            run_ctx = self.episode_context(k, turns, temp, cfg_update, plain)
            if self.external is not None:  # the external agent's episode, one record however the template split it
                sampling = self.external.sampling_at(self.temperature if temp is None else temp,
                                                     (cfg_update or {}).get("top_p"))
                seqs = await asyncio.wait_for(self.external.run_episode(ex, judge=rule_judge() if plain else None,
                                                                        sampling=sampling), timeout)
                traj = merged(seqs)
            else:
                traj = await asyncio.wait_for(run_episode(run_ctx, ex, on_event=on_event), timeout)
        except TimeoutError:
            raise HTTPError(504, f"the episode took longer than {timeout} s", "timeout") from None
        finally:
            release()
        if traj.stop_reason == "error":
            raise HTTPError(502, f"the episode failed: {traj.metadata.get('error')}", "backend_error")
        self.state.served += 1
        return traj

    async def episodes(self, run: Callable[..., Awaitable[Trajectory]], n: int) -> list[Trajectory]:
        """``n`` episodes ``run(release=...)`` at once, each in a slot taken here (all or none: 503); the
        first failure fails the request and cancels the others; every slot is freed however it ends."""
        releases = self.take_slots(n)
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

    @staticmethod
    async def unless_hung_up(request: Request, coro: Awaitable[Any]) -> Any:
        """Await ``coro`` (an :meth:`episode`) unless the client disconnects first: then the episode is
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

    def evidence_of(self, traj: Trajectory) -> list[dict[str, Any]]:
        """The distinct documents the episode retrieved, in order, as the evidence of its answer."""
        seen, out = set(), []
        for i in traj.retrieved_ids:
            if i in seen:
                continue
            seen.add(i)
            h = self.evidence.hits.get(i)
            out.append(h.to_json() if h else {"id": i})
        return out
