"""``sleuth serve-engine``: a rollout engine server on transformers, OpenAI-compatible, with RL weight updates.

For CPU tests and small runs where ``vllm serve`` is not at hand; it answers the requests Sleuth's clients
send to ``vllm serve`` the way vLLM does, so :class:`agent.backends.openai.OpenAICompatibleLLM` and the
fleet client (:mod:`agent.backends.fleet`) work against either unchanged. Routes:

* ``POST /v1/completions``: ``prompt`` as token ids (or text), ``max_tokens``, ``temperature``, ``top_p``,
  ``top_k``, ``stop``, ``seed``, ``logprobs`` with vLLM's ``return_tokens_as_token_ids`` (each token
  ``"token_id:<id>"`` with its log-probability under the distribution it was sampled from),
  ``include_stop_str_in_output``, and vLLM's ``prompt_logprobs`` (each prompt token's log-probability at
  temperature 1, ``[null, {"<id>": {"logprob": ...}}, ...]``: the trainer's weight-sync probe). Concurrent
  requests are batched (:class:`agent.loop.scheduler.Scheduler` over :class:`agent.backends.hf.TransformersLLM`).
  The reply adds ``weight_version``: the weights that generated it.
* ``GET /v1/models``: the served name, ``max_model_len``, ``tokenizer_fingerprint``
  (:func:`agent.backends.engine_protocol.tokenizer_fingerprint`) and ``weight_version``. ``POST /tokenize``
  as vLLM's. ``GET /health``: status, weight version, requests in flight, whether an update runs.
* vLLM's RL routes (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config``):
  ``POST /init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``GET /weight_info``, ``GET /get_world_size``; see
  :mod:`agent.serve.engine_weights`.

Limits (the API key, the body and its JSON are checked by the shared request guard,
:mod:`retrieval.http_guard`): bodies over ``max_body_bytes`` 413, bad JSON 400 (also nested over 64 levels or
an integer of over 100 digits), bad fields 422 (named), a model name other than the served one 404 (as
vLLM), a prompt plus ``max_tokens`` over the model's context 400, more than
``max_inflight`` requests 503 with ``Retry-After``, a request over ``request_timeout_s`` 504, weights being
replaced past the lock timeout or mixed (an abandoned update) 503. Binds 127.0.0.1 unless told otherwise;
with an API key every route but ``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agent.backends.engine_protocol import tokenizer_fingerprint
from agent.backends.hf import TransformersLLM, sequence_logprobs
from agent.llm import BackendUnavailable, Generation, SamplingParams, decode, encode
from agent.loop.scheduler import Scheduler
from agent.serve.engine_weights import EngineWeights, PartialWeights, UpdateError
from retrieval.http_guard import GuardError, RequestGuard


@dataclass
class EngineLimits:
    """Bytes of a request body, tokens one request may generate, stop strings (and characters each),
    requests in flight, seconds per request, prompts per generation batch."""

    max_body_bytes: int = 16_000_000
    max_new_tokens: int = 32_768
    max_stop: int = 16
    max_stop_chars: int = 256
    max_inflight: int = 1024
    request_timeout_s: float = 600.0
    max_batch: int = 64


class HTTPError(Exception):
    """An error reply: HTTP ``status``, ``message``, OpenAI error ``kind``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class GatedLLM:
    """The transformers backend under the engine's weights lock: each batch runs on one version of the
    weights (while an update is in progress it waits) and its generations carry that version in
    ``meta["weight_version"]``."""

    def __init__(self, llm: TransformersLLM, weights: EngineWeights):
        self.llm, self.weights, self.tokenizer, self.eos_ids = llm, weights, llm.tokenizer, llm.eos_ids

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        try:
            with self.weights.reading() as version:
                gens = self.llm.generate(prompts, params)
        except (TimeoutError, PartialWeights) as e:
            raise BackendUnavailable(str(e)) from None
        for g in gens:
            g.meta["weight_version"] = version
        return gens

    def prompt_logprobs(self, ids: list[int]) -> tuple[list[float], str]:
        """``(log p(ids[i] | ids[:i]) for i >= 1, the weight version)``; raises
        :class:`agent.llm.BackendUnavailable` while the weights cannot be read (as :meth:`generate`)."""
        try:
            with self.weights.reading() as version:
                return sequence_logprobs(self.llm.model, ids), version
        except (TimeoutError, PartialWeights) as e:
            raise BackendUnavailable(str(e)) from None


class EngineServer:
    """The engine's state and its FastAPI :attr:`app`: ``llm`` (the model it serves, updated in place by
    weight pushes), the served ``name``, ``limits``, ``weights`` (:class:`EngineWeights`, made from
    ``llm.model`` when not given) and an optional ``api_key``."""

    def __init__(self, llm: TransformersLLM, name: str, limits: EngineLimits | None = None,
                 weights: EngineWeights | None = None, api_key: str | None = None):
        self.name, self.limits, self.api_key = name, limits or EngineLimits(), api_key
        self.guard = RequestGuard(api_key, self.limits.max_body_bytes)
        self.tokenizer = llm.tokenizer
        self.weights = weights or EngineWeights(llm.model)
        self.gated = GatedLLM(llm, self.weights)
        self.scheduler = Scheduler(self.gated, None, max_batch=self.limits.max_batch)
        self.fingerprint = tokenizer_fingerprint(llm.tokenizer)
        config = getattr(llm.model, "config", None)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        self.inflight = 0
        self.stats = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
        self.app = self._build_app()

    # -- requests -------------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        self.guard.check_auth(request.headers.get("authorization"))

    async def _read_json(self, request: Request) -> dict[str, Any]:
        """The request's JSON object (an empty body: ``{}``, as vLLM's routes that take none), bounded and
        parsed by the shared guard (:class:`retrieval.http_guard.RequestGuard`)."""
        body = await self.guard.read_body(request.stream(), request.headers.get("content-length"))
        return self.guard.parse_object(body) if body.strip() else {}

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = encode(self.tokenizer, prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0] if isinstance(prompt[0], list) else encode(self.tokenizer, prompt[0])
        vocab = len(self.tokenizer)
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise HTTPError(422, f"prompt must be a string or a non-empty list of token ids in [0, {vocab})")
        return prompt

    def _params(self, body: dict[str, Any], n_prompt: int) -> SamplingParams:
        lim = self.limits
        if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
            raise HTTPError(422, "n (and best_of) must be 1")
        if body.get("stream") or body.get("echo"):
            raise HTTPError(422, "stream and echo are not supported by this engine")
        want = body.get("max_tokens", 16)
        if isinstance(want, bool) or not isinstance(want, int) or not 1 <= want <= lim.max_new_tokens:
            raise HTTPError(422, f"max_tokens must be an integer in [1, {lim.max_new_tokens}]")
        if n_prompt + want > self.max_model_len:
            raise HTTPError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                 f"you requested {n_prompt + want} tokens ({n_prompt} in the prompt, {want} in the "
                                 "completion). Please reduce the length of the prompt or completion.")
        temp, top_p = _number(body, "temperature", 1.0, 0.0, 100.0), _number(body, "top_p", 1.0, 1e-9, 1.0)
        for key, neutral in (("min_p", 0.0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                             ("frequency_penalty", 0.0)):
            if _number(body, key, neutral, -1e9, 1e9) != neutral:
                raise HTTPError(422, f"{key} other than {neutral} is not supported by this engine")
        top_k, seed = body.get("top_k", -1), body.get("seed")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise HTTPError(422, "top_k must be an integer >= -1")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise HTTPError(422, "seed must be an integer")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > lim.max_stop or not all(
                isinstance(s, str) and 0 < len(s) <= lim.max_stop_chars for s in stop):
            raise HTTPError(422, f"stop must be a string or a list of at most {lim.max_stop} non-empty strings of "
                                 f"at most {lim.max_stop_chars} characters")
        return SamplingParams(max_new_tokens=want, temperature=temp, top_p=top_p, top_k=max(top_k, 0),
                              stop=tuple(dict.fromkeys(stop)), seed=seed)

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer one ``/v1/completions`` body (see the module docstring); raises :class:`HTTPError`."""
        model = body.get("model")
        if model not in (None, "") and model != self.name:
            raise HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError")
        prompt = self._prompt(body)
        params = self._params(body, len(prompt))
        want_prompt_lp = body.get("prompt_logprobs")
        if want_prompt_lp is not None and (isinstance(want_prompt_lp, bool) or want_prompt_lp not in (0, 1)):
            raise HTTPError(422, "prompt_logprobs must be 0 or 1 (the prompt token's own log-probability)")
        if self.inflight >= self.limits.max_inflight:
            raise HTTPError(503, f"{self.inflight} requests in flight (the limit)", "overloaded")
        self.inflight += 1
        try:
            async with self.scheduler.episode():
                gen = await asyncio.wait_for(self.scheduler.generate(prompt, params), self.limits.request_timeout_s)
            prompt_lp = None
            if want_prompt_lp is not None:
                prompt_lp = await asyncio.wait_for(asyncio.to_thread(self.gated.prompt_logprobs, prompt),
                                                   self.limits.request_timeout_s)
        except TimeoutError:
            raise HTTPError(504, f"the request took longer than {self.limits.request_timeout_s:g} s", "timeout") from None
        except BackendUnavailable as e:
            raise HTTPError(503, str(e), "unavailable") from None
        finally:
            self.inflight -= 1
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["completion_tokens"] += len(gen.token_ids)
        return self._reply(body, prompt, params, gen, prompt_lp)

    def _reply(self, body: dict[str, Any], prompt: list[int], params: SamplingParams, gen: Generation,
               prompt_lp: tuple[list[float], str] | None) -> dict[str, Any]:
        matched = (next((s for s in params.stop if gen.text.endswith(s)), None)
                   if gen.finish_reason == "stop" else None)
        text = gen.text
        if matched and body.get("include_stop_str_in_output") is not True:
            text = text[: -len(matched)]
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": gen.finish_reason,
                                  "stop_reason": matched, "logprobs": None}
        if body.get("logprobs") is not None:
            ids = gen.token_ids
            toks = ([f"token_id:{t}" for t in ids] if body.get("return_tokens_as_token_ids")
                    else [decode(self.tokenizer, [t]) for t in ids])
            choice["logprobs"] = {"tokens": toks, "token_logprobs": list(gen.logprobs or [0.0] * len(ids)),
                                  "top_logprobs": None, "text_offset": None}
        version = gen.meta.get("weight_version", self.weights.version)
        if prompt_lp is not None:
            lps, version = prompt_lp
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": lp, "decoded_token": decode(self.tokenizer, [t])}}
                for t, lp in zip(prompt[1:], lps, strict=True)]
        n_out = len(gen.token_ids)
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": self.name, "choices": [choice], "weight_version": version,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                          "total_tokens": len(prompt) + n_out}}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": 0, "owned_by": "sleuth", "root": self.name,
            "max_model_len": self.max_model_len, "tokenizer_fingerprint": self.fingerprint,
            "weight_version": self.weights.version}]}

    def health(self) -> dict[str, Any]:
        w = self.weights
        return {"status": "ok", "model": self.name, "weight_version": w.version, "inflight": self.inflight,
                "updating": w.session is not None, "partial": w.partial, **self.stats,
                "updates": w.stats["updates"], "abandoned_updates": w.stats["abandoned"]}

    # -- app ------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Sleuth engine server", version="0.1")
        srv = self

        @app.exception_handler(HTTPError)
        async def _http_error(request: Request, exc: HTTPError):
            headers = {"Retry-After": "1"} if exc.status == 503 else None
            return JSONResponse({"error": {"message": exc.message, "type": exc.kind, "code": exc.status}},
                                status_code=exc.status, headers=headers)

        @app.exception_handler(GuardError)
        async def _guard_error(request: Request, exc: GuardError):
            return JSONResponse({"error": {"message": exc.message, "type": exc.kind, "code": exc.status}},
                                status_code=exc.status)

        @app.exception_handler(UpdateError)
        async def _update_error(request: Request, exc: UpdateError):
            return JSONResponse({"error": {"message": exc.message, "type": "weight_update_error",
                                           "code": exc.status}}, status_code=exc.status)

        @app.exception_handler(Exception)
        async def _internal_error(request: Request, exc: Exception):
            return JSONResponse({"error": {"message": f"internal server error ({type(exc).__name__}: {exc})",
                                           "type": "server_error", "code": 500}}, status_code=500)

        @app.get("/health")
        async def health():
            return srv.health()

        @app.get("/v1/models")
        async def models(request: Request):
            srv._check_auth(request)
            return srv.models()

        @app.post("/v1/completions")
        async def completions(request: Request):
            srv._check_auth(request)
            return await srv.completion(await srv._read_json(request))

        @app.post("/tokenize")
        async def tokenize(request: Request):
            srv._check_auth(request)
            body = await srv._read_json(request)
            if not isinstance(body.get("prompt"), str):
                raise HTTPError(422, "prompt must be a string")
            ids = list(srv.tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))))
            return {"count": len(ids), "max_model_len": srv.max_model_len, "tokens": ids}

        _weight_routes(app, srv)
        return app


def _weight_routes(app: FastAPI, srv: EngineServer) -> None:
    """vLLM's RL weight-transfer routes over ``srv.weights``; each call runs in a worker thread, where a
    broadcast or the wait for the running batch may block, so that generation and ``/health`` go on."""
    w = srv.weights

    async def body_of(request: Request) -> dict[str, Any]:
        srv._check_auth(request)
        return await srv._read_json(request)

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        info = (await body_of(request)).get("init_info")
        if not isinstance(info, dict):
            raise HTTPError(400, "Missing 'init_info' in request body")
        return {"message": "Weight transfer initialized", **await asyncio.to_thread(w.init_group, info)}

    @app.post("/start_weight_update")
    async def start_weight_update(request: Request):
        body = await body_of(request)
        if body.get("is_checkpoint_format", True) is not True:
            raise HTTPError(422, "only checkpoint-format weights (Hugging Face names) are supported")
        return {"message": "Weight update started", **await asyncio.to_thread(w.start)}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        info = (await body_of(request)).get("update_info")
        if not isinstance(info, dict):
            raise HTTPError(400, "Missing 'update_info' in request body")
        return {"message": "Weights updated", **await asyncio.to_thread(w.update, info)}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request):
        version = (await body_of(request)).get("weight_version")
        if version is not None and not (isinstance(version, str) and 0 < len(version) <= 128):
            raise HTTPError(422, "weight_version must be a string of 1-128 characters")
        return {"message": "Weight update finished", **await asyncio.to_thread(w.finish, version)}

    @app.get("/weight_info")
    async def weight_info(request: Request):
        srv._check_auth(request)
        return {"weight_version": w.version, "partial": w.partial, "updating": w.session is not None}

    @app.get("/get_world_size")
    async def get_world_size(request: Request):
        srv._check_auth(request)
        return {"world_size": 1}


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise HTTPError(422, f"{key} must be a number in [{lo:g}, {hi:g}]")
    return float(v)


def serve_engine(model: str, host: str = "127.0.0.1", port: int = 8100, *, name: str | None = None,
                 dtype: str = "float32", device: str = "auto", limits: EngineLimits | None = None,
                 api_key: str | None = None, weights_dir: str | None = None, idle_timeout_s: float = 600.0,
                 seed: int = 0) -> None:
    """Load ``model`` (a local directory or cached hub id) with transformers and serve it at
    ``host:port`` until interrupted; the served name is ``name`` or ``model`` as given (as ``vllm serve``
    names it). Raises ``FileNotFoundError`` when the model cannot be loaded."""
    import torch
    import uvicorn

    torch.manual_seed(seed)
    llm = TransformersLLM.from_pretrained(model, dtype, device)
    lim = limits or EngineLimits()
    weights = EngineWeights(llm.model, lock_timeout_s=lim.request_timeout_s, idle_timeout_s=idle_timeout_s,
                            weights_dir=weights_dir)
    server = EngineServer(llm, name or model, lim, weights, api_key)
    uvicorn.run(server.app, host=host, port=port, log_level="warning", timeout_keep_alive=30)

