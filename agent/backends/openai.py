"""A backend for any OpenAI-compatible HTTP server (vLLM serve, SGLang, a hosted API), over ``httpx2``.

Uses the **completions** endpoint (``POST {base_url}/completions``) with the prompt given as token ids, so
the server continues exactly the tokens the agent recorded. Token-exactness of the *output* depends on
the server:

* vLLM (and SGLang's compatible mode) accept ``return_tokens_as_token_ids: true`` with ``logprobs``: each
  returned token is ``"token_id:<id>"``, and the backend records those ids and their log-probabilities
  (exact).
* A server that does not return token ids (most hosted APIs) gives text only: the backend re-encodes the
  text with the local tokenizer and marks the generation ``meta["exact"] = False``. The trajectory stays
  self-consistent (what is recorded is what the next turn sends), but the ids may differ from the ones
  the server sampled, so such a backend suits evaluation and serving, not RL training.

Requests run concurrently (``asyncio`` + ``httpx2.AsyncClient``) under a concurrency limit, with a timeout
per request and retries with exponential backoff on connection errors, timeouts, 429 and 5xx (waiting at least
what a `Retry-After` header asks, up to 60 s); a request still failing after them raises
:class:`BackendUnreachable` (the server is down: the scheduler fails the whole batch), and 401, 403 and
404 raise :class:`BackendRefused` at once (a wrong key, URL or model name: the same). Other 4xx responses
and malformed bodies fail their request at once (a retry would not help): the batch raises
:class:`BackendPartlyFailed` with every request's outcome, so the scheduler fails only the episodes whose
requests failed, each with its reason, and sends nothing again.
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
from typing import Any

import httpx2

from agent.llm import (
    BackendUnavailable,
    BatchPartlyFailed,
    Generation,
    SamplingParams,
    decode,
    encode,
    end_of_turn_ids,
    run_sync,
    truncate_at_stop,
)
from retrieval.retry import RetriesExhausted, Retry, RetryPolicy, acall, retry_after_s, retryable_status


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx2's default TLS context (its CA bundle), made once per process: building it loads the CA bundle,
    about 20-250 ms, which a client made per batch paid every time."""
    return httpx2.create_ssl_context()


class BackendError(RuntimeError):
    """The server failed or answered something that is not a completion; the message says which."""


class BackendUnreachable(BackendError, BackendUnavailable):
    """A request still failed after all its retries (connection errors, timeouts, 429, 5xx): the server is
    down or overloaded, not unhappy with one request."""


class BackendPartlyFailed(BackendError, BatchPartlyFailed):
    """Some requests of a batch failed on their own (a 400 for one prompt, a malformed answer) and the others
    did not; ``results`` holds each request's :class:`~agent.llm.Generation` or error."""


class BackendRefused(BackendError, BackendUnavailable):
    """The server refuses every request: HTTP 401 or 403 (a wrong or missing key) or 404 (a wrong base URL
    or model name)."""


class OpenAICompatibleLLM:
    """:class:`agent.llm.LLM` over an OpenAI-compatible completions endpoint.

    Args:
        base_url: e.g. ``http://127.0.0.1:8001/v1``.
        model: the served model name.
        tokenizer: the model's Hugging Face tokenizer (prompts are token ids; text-only servers need it to
            re-encode outputs).
        api_key: bearer token (default: ``$OPENAI_API_KEY`` if set).
        timeout_s: per-request timeout, seconds. max_retries: retries after the first attempt.
        max_concurrency: requests in flight at once. backoff_s: first retry delay (doubles each retry).
        deadline_s: no retry wait of a request ends later than this many seconds after its first attempt
            (``None``: none); the retries are :func:`retrieval.retry.acall`'s.

    ``generate`` may be called from several threads at once (each call runs its own event loop and
    client), so ``concurrent_calls`` is true: the scheduler retries a failed batch's requests concurrently.
    """

    concurrent_calls = True

    def __init__(self, base_url: str, model: str, tokenizer: Any, api_key: str | None = None,
                 timeout_s: float = 120.0, max_retries: int = 3, max_concurrency: int = 64,
                 backoff_s: float = 0.5, deadline_s: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s, self.max_retries, self.max_concurrency = timeout_s, max_retries, max_concurrency
        self.backoff_s = backoff_s
        self.deadline_s = deadline_s
        self.eos_ids: set[int] = end_of_turn_ids(tokenizer, getattr(tokenizer, "name_or_path", None))
        self.stats = {"requests": 0, "retries": 0, "backoff_s": 0.0, "inexact": 0}

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of a request (from ``max_retries``, ``backoff_s``, ``deadline_s``)."""
        return RetryPolicy(self.max_retries, self.backoff_s, deadline_s=self.deadline_s)

    # -- LLM protocol ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Blocking batch call (the scheduler runs it in a worker thread); every request runs to its end.
        Raises :class:`BackendUnreachable` when a request still fails after its retries and
        :class:`BackendRefused` on 401, 403 or 404 (both :class:`agent.llm.BackendUnavailable`: the batch
        fails); else, when some requests were rejected or answered with garbage, :class:`BackendPartlyFailed`
        with each request's outcome (the request's own :class:`BackendError` for a batch of one). All are
        :class:`BackendError`."""
        return run_sync(self.agenerate(prompts, params))

    def generate_each(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        """:meth:`generate` with each prompt's own sampling settings, as one batch of concurrent requests
        (each prompt is its own HTTP request anyway). :class:`agent.loop.scheduler.Scheduler` uses it so that
        each request keeps its own ``max_new_tokens``: a server checks prompt + ``max_tokens`` against the
        model's context (`vllm serve` answers 400 past it), so the batch's largest budget on a prompt near the
        end of its context would be refused. Raises as :meth:`generate`."""
        return run_sync(self._agenerate(requests))

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return await self._agenerate([(p, params) for p in prompts])

    def async_client(self) -> httpx2.AsyncClient:
        """An ``httpx2.AsyncClient`` for this server (base URL, key, timeout, connection limit), to use in the
        running event loop with :meth:`request`."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx2.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout_s,
                                  limits=httpx2.Limits(max_connections=self.max_concurrency), verify=tls_context())

    async def request(self, client: httpx2.AsyncClient, sem: asyncio.Semaphore, prompt: list[int],
                      params: SamplingParams, i: int = 0) -> Generation:
        """One completion over ``client`` (:meth:`async_client`) within ``sem``, with this backend's retries;
        ``i`` offsets a seeded request's seed (``params.seed + i``). Raises as :meth:`generate` does for a
        batch of one."""
        return await self._one(client, sem, prompt, params, i)

    async def _agenerate(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        sem = asyncio.Semaphore(self.max_concurrency)
        async with self.async_client() as client:
            out = await asyncio.gather(*(self._one(client, sem, p, params, i)
                                         for i, (p, params) in enumerate(requests)), return_exceptions=True)
        failed = [r for r in out if isinstance(r, BaseException)]
        for r in failed:  # a cancellation, or the server down or refusing every request: the whole batch
            if not isinstance(r, Exception) or isinstance(r, BackendUnavailable):
                raise r
        if failed:  # each request's own outcome, so that only the failed ones fail (agent.loop.scheduler)
            raise failed[0] if len(out) == 1 else BackendPartlyFailed(list(out))
        return list(out)

    # -- one request ----------------------------------------------------------------------------------
    def _body(self, prompt: list[int], params: SamplingParams, i: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 1,
            # vLLM / SGLang extensions (ignored or rejected by other servers; see the module docstring)
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            # sent even at their neutral values: `vllm serve` (generation_config "auto") fills fields a request
            # leaves out from the model's generation_config (Qwen2.5-Instruct: repetition_penalty 1.05, top_k
            # 20), a distribution the trainer's log-probs (logits / T) would not describe
            "top_k": params.top_k if params.top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed + i
        return body

    async def _one(self, client: httpx2.AsyncClient, sem: asyncio.Semaphore, prompt: list[int],
                   params: SamplingParams, i: int) -> Generation:
        body = self._body(prompt, params, i)

        async def attempt() -> Generation:
            try:
                async with sem:
                    self.stats["requests"] += 1
                    r = await client.post("/completions", json=body)
            except (httpx2.TimeoutException, httpx2.TransportError) as e:
                raise Retry(f"{type(e).__name__}: {e or 'timed out'}") from None
            if retryable_status(r.status_code):
                raise Retry(f"HTTP {r.status_code}: {r.text[:200]}", retry_after_s(r.headers.get("retry-after")))
            if r.status_code in (401, 403, 404):
                raise BackendRefused(f"{self.base_url}/completions answered HTTP {r.status_code}: {r.text[:300]}")
            if r.status_code >= 400:
                raise BackendError(f"{self.base_url}/completions answered HTTP {r.status_code}: {r.text[:300]}")
            return self._parse(r, params)

        def on_retry(wait: float) -> None:
            self.stats["retries"] += 1
            self.stats["backoff_s"] += wait

        try:
            return await acall(attempt, self.retry, on_retry)
        except RetriesExhausted as e:
            raise BackendUnreachable(f"{self.base_url}/completions failed after {e.attempts} attempts "
                                     f"({e.last.reason})") from None

    def _parse(self, r: httpx2.Response, params: SamplingParams) -> Generation:
        try:
            obj = r.json()
            choice = obj["choices"][0]
            text = choice["text"]
            if not isinstance(text, str):
                raise TypeError("choices[0].text is not a string")
        except (ValueError, KeyError, IndexError, TypeError) as e:  # ValueError: not JSON, not UTF-8
            raise self._malformed(r, e) from None
        lp = choice.get("logprobs") or {}
        toks = lp.get("tokens") if isinstance(lp, dict) else None
        ids: list[int] | None = None
        if toks and all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
            try:
                ids = [int(t.split(":", 1)[1]) for t in toks]
            except ValueError:
                ids = None
            if ids is not None and min(ids) < 0:
                raise self._malformed(r, ValueError(f"negative token id {min(ids)}"))
        exact = ids is not None
        logprobs = None
        if exact:
            raw = lp.get("token_logprobs")
            if isinstance(raw, list) and len(raw) == len(ids):
                try:
                    logprobs = [float(x) if x is not None else 0.0 for x in raw]
                except (ValueError, TypeError) as e:
                    raise self._malformed(r, e) from None
        else:
            self.stats["inexact"] += 1
            ids = encode(self.tokenizer, restore_stop(text, choice, params.stop))
        cut, cut_text, reason = truncate_at_stop(self.tokenizer, ids, params.stop, self.eos_ids)
        if reason == "length" and choice.get("finish_reason") == "stop":
            reason = "stop"
        if logprobs is not None:
            logprobs = logprobs[: len(cut)]
        meta: dict[str, Any] = {"exact": exact}
        version = obj.get("weight_version")  # Sleuth's engine server says which weights generated it
        if isinstance(version, (str, int)) and not isinstance(version, bool):
            meta["weight_version"] = int(version) if isinstance(version, str) and version.isdigit() else version
        return Generation(cut, cut_text if exact else decode(self.tokenizer, cut), reason, logprobs, meta=meta)

    def _malformed(self, r: httpx2.Response, e: Exception) -> BackendError:
        """The :class:`BackendError` of a 200 reply that is not a completion (``e`` says what is wrong)."""
        return BackendError(f"malformed completion from {self.base_url} ({type(e).__name__}: {e}): "
                            f"{r.text[:200]!r}")


def restore_stop(text: str, choice: dict, stop: tuple[str, ...]) -> str:
    """``text`` with the stop string a text-only server left out put back (OpenAI's API always leaves it
    out; vLLM's ``include_stop_str_in_output`` is its own extension). The protocol needs it: ``<search> q``
    without ``</search>`` is an unclosed tag, so an agent could never search through such a server.

    The string the server names (vLLM ``stop_reason``, SGLang ``matched_stop``; ``None`` or a token id: it
    stopped at EOS, nothing is added); a server that names none stopped at one of ``stop`` or at EOS, and a
    closing tag ``</x>`` of ``stop`` whose ``<x>`` is open at the end of ``text`` is taken as the one it
    matched (after EOS inside an open tag this adds a tag the model did not write; such a server's
    trajectories are inexact anyway). Only for ``finish_reason`` ``"stop"`` and a text not already ending in
    a stop string.
    """
    if choice.get("finish_reason") != "stop" or any(text.endswith(s) for s in stop):
        return text
    if "stop_reason" in choice or "matched_stop" in choice:
        named = choice.get("stop_reason", choice.get("matched_stop"))
        return text + named if isinstance(named, str) and named in stop else text
    for s in stop:
        if s.startswith("</") and s.endswith(">") and text.rfind("<" + s[2:]) > text.rfind(s):
            return text + s
    return text
