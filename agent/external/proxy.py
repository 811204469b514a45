"""The training proxy: an OpenAI-compatible API in front of a rollout backend that records every token.

External agents (LangChain's ``create_agent`` with ``ChatOpenAI``, any code that speaks the OpenAI
API) run unchanged against it, pointed at its base URL; the proxy renders each conversation with the policy's
own chat template (Sleuth's ChatML one, :mod:`agent.external.chat_template`, for a tokenizer without one),
samples through the project's backend interface (:class:`agent.llm.LLM`: transformers, vLLM or an OpenAI-compatible
server, batched across concurrent calls by :class:`agent.loop.scheduler.Scheduler`) and keeps, per call, the
exact prompt ids and the sampled ids with their log-probabilities (:mod:`agent.external.stitch`), grouped by
episode. As in AReaL's, Agent Lightning's and ART's proxies, the episode of a call is named by the URL
(``/ep/<episode>/v1/...``: a base URL is all an unchanged agent lets one set), an ``X-Sleuth-Episode`` header
or the request's ``user`` field, in that order; calls with none are served and counted but not recorded. The
trainer takes an episode's record with :meth:`Proxy.take`.

Routes (also under ``/ep/<episode>``):

* ``POST /v1/chat/completions``: ``messages``, ``tools`` (OpenAI's function tools; Anthropic's
  ``input_schema`` form is converted, any other form refused naming the field: :mod:`agent.external.tool_schema`,
  which also refuses the legacy ``functions`` / ``function_call``), ``tool_choice`` (``"auto"``, or ``"none"``,
  which turns tool-call parsing off; one forcing a call is refused), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``,
  ``logprobs``, ``stream`` (+ ``stream_options.include_usage``). The reply's ``tool_calls`` are parsed from
  the sampled text (:func:`agent.external.stitch.parse_tool_calls`), ``finish_reason`` is ``tool_calls``,
  ``stop`` or ``length``. A streamed reply sends the finished turn as OpenAI's chunks (role, content, one
  chunk per tool call, the finish, usage when asked, ``[DONE]``): the turn is sampled whole before the first
  chunk.
* ``POST /v1/completions``: ``prompt`` as token ids or text, with vLLM's ``return_tokens_as_token_ids`` and
  ``include_stop_str_in_output``: the endpoint :class:`agent.backends.openai.OpenAICompatibleLLM` speaks, so
  the built-in loop itself can run through the proxy.
* ``GET /v1/models``, ``GET /health`` (with the recording counters: calls, episodes, splits).

With ``ProxySettings.temperature`` / ``top_p`` set (training), every call samples with them whatever the
request says: the trainer scores the distribution the rollout was drawn from; ``Proxy.sampling`` sets them
per episode (``sleuth serve``'s requests, an evaluation at its own temperature). Each call's new tokens are
capped by ``max_new_tokens`` and by what is left of ``max_total_tokens`` (one training sequence); a prompt
that already fills it is refused with 400 ``context_length_exceeded``, as vLLM refuses one over its context.
Limits (the API key, the body's size and its JSON checked by the shared
:class:`retrieval.http_guard.RequestGuard`): bodies over ``max_body_bytes`` 413, bad JSON 400 (also nested too
deeply or an over-long integer), a wrong key 401, bad fields 422 (named), a chat template failing
on the messages 422, ``n`` other than 1 422, a call for an episode that has ended (:meth:`Proxy.end`: its agent
returned or ran out of time) 409, a backend failure 502, a call over ``request_timeout_s`` 504;
OpenAI's ``{"error": {"message", "type", "code"}}`` body. Binds 127.0.0.1 (:class:`ProxyServer`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Self

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent.external.chat_template import CHATML_TOOLS
from agent.external.stitch import Call, EpisodeLog, parse_tool_calls, render_prompt, turn_action
from agent.external.tool_schema import ToolSchemaError, check_legacy_fields, normalize_tools
from agent.llm import LLM, SamplingParams, decode, encode
from agent.loop.scheduler import Scheduler
from retrieval.http_guard import GuardError, RequestGuard

EPISODE_HEADER = "x-sleuth-episode"


@dataclass
class ProxySettings:
    """Sampling of every call: ``max_new_tokens`` caps a call's tokens, ``max_total_tokens`` one training
    sequence (prompt + output); ``temperature`` / ``top_p``, when set, replace the request's (``None``: the
    request's, else 1.0); ``stop`` strings are added to the request's; ``search_tool`` names the tool whose
    calls are recorded as searches (``Turn.action == "search"``); ``chat_template`` renders the conversations
    (``None``: the tokenizer's own, else :data:`agent.external.chat_template.CHATML_TOOLS` for a tokenizer
    without one)."""

    max_new_tokens: int = 1024
    max_total_tokens: int = 32_768
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    search_tool: str = "search"
    chat_template: str | None = None


@dataclass
class ProxyLimits:
    """Bytes of a request body, messages of a conversation, episode records kept (the oldest untaken one is
    dropped past it, and counted), seconds per call."""

    max_body_bytes: int = 8_000_000
    max_messages: int = 2_000
    max_episodes: int = 100_000
    request_timeout_s: float = 600.0


class ProxyError(Exception):
    """An error reply: HTTP ``status``, ``message``, OpenAI error ``kind`` and ``code``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


class Proxy:
    """The recording state and the FastAPI app (:attr:`app`) over one backend ``llm``.

    ``stats``: ``calls`` (recorded), ``untagged_calls``, ``episodes`` (opened), ``splits`` (calls that
    started a new training sequence), ``dropped_episodes`` (evicted past ``max_episodes`` untaken).
    Thread-safe: the app runs in the server's thread, :meth:`take` in the trainer's."""

    def __init__(self, llm: LLM, settings: ProxySettings | None = None, limits: ProxyLimits | None = None,
                 api_key: str | None = None, model_name: str = "sleuth-policy", max_batch: int = 256):
        self.llm, self.tokenizer = llm, llm.tokenizer
        self.settings, self.limits = settings or ProxySettings(), limits or ProxyLimits()
        self.api_key, self.model_name = api_key, model_name
        self.guard = RequestGuard(api_key, self.limits.max_body_bytes)
        self.scheduler = Scheduler(llm, None, max_batch=max_batch)
        self.episodes: OrderedDict[str, EpisodeLog] = OrderedDict()
        self.locks: dict[str, asyncio.Lock] = {}
        self.sampling: dict[str, tuple[float, float]] = {}  # episode -> (temperature, top_p) of its calls
        self.ended: OrderedDict[str, None] = OrderedDict()  # episodes whose agent returned or timed out
        self.stats = {"calls": 0, "untagged_calls": 0, "episodes": 0, "splits": 0, "dropped_episodes": 0}
        self._lock = threading.Lock()
        self.app = self._build_app()

    # -- records --------------------------------------------------------------------------------------
    def _log(self, episode: str) -> EpisodeLog:
        with self._lock:
            if episode in self.ended:
                raise ProxyError(409, f"episode {episode!r} has ended (its agent returned or ran out of time): this "
                                      "call is not served", code="episode_ended")
            log = self.episodes.get(episode)
            if log is None:
                log = self.episodes[episode] = EpisodeLog(episode)
                self.stats["episodes"] += 1
                while len(self.episodes) > self.limits.max_episodes:
                    old, _ = self.episodes.popitem(last=False)
                    self.locks.pop(old, None)
                    self.stats["dropped_episodes"] += 1
            return log

    def take(self, episode: str) -> EpisodeLog:
        """Remove and return the record of ``episode`` (an empty one when it made no call)."""
        with self._lock:
            self.locks.pop(episode, None)
            self.sampling.pop(episode, None)
            return self.episodes.pop(episode, None) or EpisodeLog(episode)

    def end(self, episode: str) -> None:
        """Mark ``episode`` ended: a call for it from now on gets 409 ``episode_ended`` (an agent that ran out of
        time and goes on calling is told so, and its calls are neither sampled nor recorded). The last
        ``max_episodes`` ended ids are remembered."""
        with self._lock:
            self.ended[episode] = None
            while len(self.ended) > self.limits.max_episodes:
                self.ended.popitem(last=False)

    def _record(self, log: EpisodeLog, call: Call) -> None:
        with self._lock:
            before = log.splits
            log.add(call)
            self.stats["calls"] += 1
            self.stats["splits"] += log.splits - before

    # -- sampling -------------------------------------------------------------------------------------
    def _params(self, body: dict[str, Any], n_prompt: int, episode: str | None = None) -> SamplingParams:
        s = self.settings
        forced_temp, forced_top_p = self.sampling.get(episode, (s.temperature, s.top_p))
        room = s.max_total_tokens - n_prompt
        if room <= 0:
            raise ProxyError(400, f"the prompt is {n_prompt} tokens; this proxy's sequences hold "
                                  f"{s.max_total_tokens} (max_total_tokens) with one token left to generate",
                             code="context_length_exceeded")
        want = body.get("max_completion_tokens", body.get("max_tokens"))
        if want is not None and (isinstance(want, bool) or not isinstance(want, int) or want < 1):
            raise ProxyError(422, "max_tokens must be a positive integer")
        temp = forced_temp if forced_temp is not None else _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = forced_top_p if forced_top_p is not None else _number(body, "top_p", 1.0, 0.0, 1.0)
        top_k = body.get("top_k", -1)
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise ProxyError(422, "top_k must be an integer")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ProxyError(422, "seed must be an integer")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise ProxyError(422, "stop must be a string or a list of non-empty strings")
        return SamplingParams(max_new_tokens=min(want or s.max_new_tokens, s.max_new_tokens, room),
                              temperature=temp, top_p=top_p, top_k=max(top_k, 0),
                              stop=tuple(dict.fromkeys([*stop, *s.stop])), seed=seed)

    async def _generate(self, prompt: list[int], params: SamplingParams):
        try:
            async with self.scheduler.episode():
                return await asyncio.wait_for(self.scheduler.generate(prompt, params),
                                              self.limits.request_timeout_s)
        except TimeoutError:
            raise ProxyError(504, f"the call took longer than {self.limits.request_timeout_s} s", "timeout") from None
        except ProxyError:
            raise
        except Exception as e:  # noqa: BLE001 - the backend failed this call
            raise ProxyError(502, f"the backend failed: {type(e).__name__}: {e}", "backend_error") from None

    # -- app ------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Sleuth training proxy", version="0.1")
        router = APIRouter()
        proxy = self

        @app.exception_handler(ProxyError)
        async def _proxy_error(request: Request, exc: ProxyError):
            return _error(exc.status, exc.message, exc.kind, exc.code)

        @app.exception_handler(GuardError)
        async def _guard_error(request: Request, exc: GuardError):
            return _error(exc.status, exc.message, exc.kind)

        @app.exception_handler(StarletteHTTPException)
        async def _route_error(request: Request, exc: StarletteHTTPException):
            return _error(exc.status_code, str(exc.detail))

        @app.exception_handler(Exception)
        async def _internal_error(request: Request, exc: Exception):
            return _error(500, f"internal server error ({type(exc).__name__}: {exc})", "server_error")

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": proxy.model_name, **proxy.stats, "open_episodes": len(proxy.episodes)}

        @router.get("/v1/models")
        async def models(request: Request):
            proxy._check_auth(request)
            return {"object": "list", "data": [{"id": proxy.model_name, "object": "model", "owned_by": "sleuth"}]}

        @router.post("/v1/chat/completions")
        async def chat(request: Request):
            proxy._check_auth(request)
            body = await proxy._read_json(request)
            return await proxy._chat(body, proxy._episode_of(request, body))

        @router.post("/v1/completions")
        async def completions(request: Request):
            proxy._check_auth(request)
            body = await proxy._read_json(request)
            return await proxy._completion(body, proxy._episode_of(request, body))

        app.include_router(router)
        app.include_router(router, prefix="/ep/{episode}")
        return app

    def _check_auth(self, request: Request) -> None:
        self.guard.check_auth(request.headers.get("authorization"))

    async def _read_json(self, request: Request) -> dict[str, Any]:
        obj = await self.guard.read_json(request)  # bounded body, JSON within the nesting and digit limits
        if obj.get("n", 1) != 1:
            raise ProxyError(422, "n must be 1 (one completion per call)")
        return obj

    def _episode_of(self, request: Request, body: dict[str, Any]) -> str | None:
        ep = request.path_params.get("episode") or request.headers.get(EPISODE_HEADER) or body.get("user")
        if ep is not None and (not isinstance(ep, str) or not 0 < len(ep) <= 256):
            raise ProxyError(422, "the episode id (path, X-Sleuth-Episode or user) must be 1-256 characters")
        return ep

    async def _locked(self, episode: str | None):
        if episode is None:
            return _NoLock()
        return self.locks.setdefault(episode, asyncio.Lock())

    async def _chat(self, body: dict[str, Any], episode: str | None):
        msgs, tools = body.get("messages"), body.get("tools")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                            for m in msgs):
            raise ProxyError(422, "messages must be a non-empty list of objects with a role")
        if len(msgs) > self.limits.max_messages:
            raise ProxyError(422, f"{len(msgs)} messages exceed the limit of {self.limits.max_messages}")
        try:  # another schema is converted or refused naming the field, never dropped
            tools = normalize_tools(tools)
            check_legacy_fields(body)
        except ToolSchemaError as e:
            raise ProxyError(422, e.message, code="invalid_value") from None
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise ProxyError(422, "stream must be true or false")
        parse_calls = bool(tools) and body.get("tool_choice") != "none"
        async with await self._locked(episode):
            log = self._log(episode) if episode is not None else None
            try:
                template = self.settings.chat_template or (
                    None if getattr(self.tokenizer, "chat_template", None) else CHATML_TOOLS)
                prompt, text = render_prompt(self.tokenizer, log, msgs, tools, template)
            except Exception as e:  # noqa: BLE001 - jinja errors, a template that raises on these messages
                raise ProxyError(422, f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
            params = replace(self._params(body, len(prompt), episode), episode=episode)  # one engine per episode
            gen = await self._generate(prompt, params)
            content, calls, error = parse_tool_calls(gen.text) if parse_calls else (gen.text, [], None)
            action, query = turn_action(content, calls, error, self.settings.search_tool)
            call = Call(prompt, list(gen.token_ids), gen.logprobs, gen.text, gen.finish_reason, text, len(msgs),
                        action, query, error)
            self._count(log, call)
        finish = "tool_calls" if calls else gen.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(gen.token_ids),
                 "total_tokens": len(prompt) + len(gen.token_ids)}
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        lp = self._chat_logprobs(gen) if body.get("logprobs") else None
        if not stream:
            return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}],
                    "usage": usage}
        usage_chunk = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
        return StreamingResponse(_chat_chunks(cid, created, model, message, finish, lp, usage if usage_chunk else None),
                                 media_type="text/event-stream")

    def _count(self, log: EpisodeLog | None, call: Call) -> None:
        if log is None:
            with self._lock:
                self.stats["untagged_calls"] += 1
        else:
            self._record(log, call)

    def _chat_logprobs(self, gen: Any) -> dict[str, Any]:
        lps = gen.logprobs or [0.0] * len(gen.token_ids)
        return {"content": [{"token": decode(self.tokenizer, [t]), "logprob": lp, "top_logprobs": []}
                            for t, lp in zip(gen.token_ids, lps, strict=False)]}

    async def _completion(self, body: dict[str, Any], episode: str | None):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = encode(self.tokenizer, prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        vocab = len(self.tokenizer)
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ProxyError(422, f"prompt must be a string or a non-empty list of token ids in [0, {vocab})")
        if body.get("stream"):
            raise ProxyError(422, "stream is not supported on /v1/completions")
        async with await self._locked(episode):
            log = self._log(episode) if episode is not None else None
            params = replace(self._params(body, len(prompt), episode), episode=episode)  # one engine per episode
            gen = await self._generate(prompt, params)
            self._count(log, Call(list(prompt), list(gen.token_ids), gen.logprobs, gen.text, gen.finish_reason,
                                  action="completion"))
        matched = next((s for s in params.stop if gen.text.endswith(s)), None) if gen.finish_reason == "stop" else None
        text = gen.text
        if matched and body.get("include_stop_str_in_output") is not True:
            text = text[: -len(matched)]
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": gen.finish_reason, "stop_reason": matched}
        if body.get("logprobs") is not None:
            ids = gen.token_ids
            toks = [f"token_id:{t}" for t in ids] if body.get("return_tokens_as_token_ids") else \
                [decode(self.tokenizer, [t]) for t in ids]
            choice["logprobs"] = {"tokens": toks, "token_logprobs": list(gen.logprobs or [0.0] * len(ids))}
        n_out = len(gen.token_ids)
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") if isinstance(body.get("model"), str) else self.model_name,
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out}}


class _NoLock:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ProxyError(422, f"{key} must be a number in [{lo}, {hi}]")
    return float(v)


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


async def _chat_chunks(cid: str, created: int, model: str, message: dict[str, Any], finish: str,
                       logprobs: dict[str, Any] | None, usage: dict[str, int] | None):
    """OpenAI's chat-completion chunks of one finished turn."""
    def chunk(delta: dict[str, Any], finish_reason: str | None = None, **more: Any) -> str:
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **more}]}
        return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]}, logprobs=logprobs)
    for i, tc in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **tc}]})
    yield chunk({}, finish)
    if usage is not None:
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
             "usage": usage}
        yield f"data: {json.dumps(c)}\n\n"
    yield "data: [DONE]\n\n"


class ProxyServer:
    """Serves a :class:`Proxy` with uvicorn on ``host`` (127.0.0.1) at a free port, in a daemon thread, as a
    context manager (or :meth:`start` / :meth:`stop`). ``url`` is its root; :meth:`base_url` the OpenAI base
    URL of one episode (``<url>/ep/<episode>/v1``). Raises ``RuntimeError`` when uvicorn does not start."""

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.proxy = proxy
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(proxy.app, log_level="warning", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    def base_url(self, episode: str) -> str:
        return f"{self.url}/ep/{episode}/v1"

    def start(self) -> ProxyServer:
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="sleuth-proxy")
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the training proxy's server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
