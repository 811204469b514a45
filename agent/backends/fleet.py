"""A fleet of rollout engines apart from the trainer, as one :class:`agent.llm.LLM`.

Each engine is an OpenAI-compatible server that takes and returns token ids: ``vllm serve`` on GPUs, or
Sleuth's transformers engine (``sleuth serve-engine``, :mod:`agent.serve.engine`). :class:`Fleet` sends
every request to one of them, through :class:`agent.backends.openai.OpenAICompatibleLLM` (token-exact,
with its retries), and chooses the engine:

* **episode affinity**: a request whose ``SamplingParams.episode`` was seen before goes to the engine that
  served that episode (the agent loop names each episode, so all its turns reach one engine, whose prefix
  cache still holds the earlier turns); remembered for the last ``max_affinity`` episodes;
* **least loaded** otherwise (and when that engine left the rotation): the engine in rotation with the
  fewest requests in flight (ties: the one that served fewest, then the first listed).

Faults. A request that still fails after its engine's own retries because the engine is down (connection
refused, timeouts, 5xx: :class:`agent.llm.BackendUnavailable`) takes that engine out of rotation, with a
warning naming it and why, and is sent to another engine; so are the other requests that were in flight on
it when they fail. With no engine left a request waits ``retry_waits`` seconds in turn for one to rejoin,
then raises :class:`FleetUnavailable` naming every engine and its reason. An engine rejoins only by
:meth:`Fleet.admit`, which the trainer calls after a verified weight sync
(:mod:`training.rollout.fleet_sync`): a restarted engine has its initial weights, not the policy's. A request
that fails on its own (HTTP 400: a prompt over the context) fails alone, as with one server.

Start. :meth:`Fleet.connect` (run by the constructor) asks every engine what it serves (``GET
/v1/models``): each must answer, serve ``model`` (when given; else all the same name), and tokenise as the
trainer's tokenizer does (its ``tokenizer_fingerprint``, or ``POST /tokenize`` of
:data:`agent.backends.engine_protocol.IDENTITY_TEXT` for an engine without one); else :class:`FleetError`
naming every engine that failed and why. An empty or repeated URL list is a ``ValueError``.

Every generation carries ``meta["engine"]`` (the URL that generated it) and ``meta["weight_version"]`` (as
the engine reported it with the reply, else the version the trainer last pushed to that engine).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2

from agent.backends.engine_protocol import IDENTITY_TEXT, tokenizer_fingerprint
from agent.backends.openai import BackendError, OpenAICompatibleLLM, tls_context
from agent.llm import BackendUnavailable, BatchPartlyFailed, Generation, SamplingParams, run_sync

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    """The fleet cannot start: an engine is unreachable, serves another model or tokenizer (the message names
    every engine that failed and why)."""


class FleetUnavailable(BackendError, BackendUnavailable):
    """Every engine is out of rotation, and none rejoined during the retry waits."""


@dataclass
class Engine:
    """One engine: its root ``url`` (``http://host:port``), the client that talks to it, requests in flight,
    whether it is in rotation (and else why: ``reason``), the weight version it holds as far as the trainer
    knows, how many requests it served, and ``owned_by`` from ``/v1/models`` (``"sleuth"``, ``"vllm"``)."""

    url: str
    client: OpenAICompatibleLLM
    inflight: int = 0
    in_rotation: bool = True
    reason: str = ""
    weight_version: Any = None
    served: int = 0
    owned_by: str = ""
    events: list[str] = field(default_factory=list)


def as_version(v: Any) -> Any:
    """A weight version as an engine reports it (vLLM's are strings): an integer when it is one."""
    return int(v) if isinstance(v, str) and v.isdigit() else v


def root_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1`` (``http://h:8100/v1/`` -> ``http://h:8100``)."""
    url = url.strip().rstrip("/")
    return url.removesuffix("/v1")


class Fleet:
    """:class:`agent.llm.LLM` over several engines (see the module docstring).

    Args:
        urls: the engines' base URLs (``http://host:port`` or ``.../v1``).
        tokenizer: the policy's tokenizer (prompts are token ids; compared with each engine's).
        model: the served model name every engine must report (``None``: whatever they serve, the same on all).
        api_key: bearer token sent to every engine (``None``: none).
        timeout_s: per-request timeout, seconds (it must exceed the longest weight push: an engine holds
            requests while its weights are replaced). max_retries, backoff_s: each engine client's retries
            before the engine counts as down (:class:`agent.backends.openai.OpenAICompatibleLLM`).
        retry_waits: seconds waited in turn, with every engine out, for one to rejoin before giving up.
        connect_timeout_s: timeout of the start checks and of :meth:`candidates`' health checks.
        max_concurrency: requests in flight per engine. max_affinity: episodes remembered.
        connect: check the engines now (:meth:`connect`); ``False`` leaves it to the caller.
    """

    concurrent_calls = True

    def __init__(self, urls: Sequence[str], tokenizer: Any, model: str | None = None, *, api_key: str | None = None,
                 timeout_s: float = 600.0, max_retries: int = 2, backoff_s: float = 0.5,
                 retry_waits: Sequence[float] = (1.0, 2.0, 4.0), connect_timeout_s: float = 10.0,
                 max_concurrency: int = 64, max_affinity: int = 100_000, connect: bool = True):
        if isinstance(urls, str) or not urls:
            raise ValueError("a fleet needs a list of at least one engine URL (http://host:port)")
        roots = [root_url(u) for u in urls]
        if any(not u.startswith(("http://", "https://")) for u in roots):
            raise ValueError(f"engine URLs must start with http:// or https://, got {list(urls)}")
        if len(set(roots)) < len(roots):
            raise ValueError(f"an engine is listed twice: {roots}")
        self.tokenizer, self.model, self.api_key = tokenizer, model, api_key
        self.retry_waits, self.connect_timeout_s = tuple(retry_waits), connect_timeout_s
        self.max_concurrency, self.max_affinity = max_concurrency, max_affinity
        self.engines: dict[str, Engine] = {
            u: Engine(u, OpenAICompatibleLLM(u + "/v1", model or "", tokenizer, api_key=api_key or "",
                                             timeout_s=timeout_s, max_retries=max_retries,
                                             max_concurrency=max_concurrency, backoff_s=backoff_s))
            for u in roots}
        self.eos_ids = next(iter(self.engines.values())).client.eos_ids
        self.affinity: OrderedDict[str, str] = OrderedDict()
        self.stats = {"requests": 0, "rerouted": 0, "taken_out": 0, "admitted": 0, "affinity_hits": 0}
        self._fingerprint: str | None = None
        self._lock = threading.Lock()
        if connect:
            self.connect()

    # -- start ----------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Check every engine (:meth:`identify`); raises :class:`FleetError` naming each that fails. Sets
        ``model`` to the served name when it was not given, and each engine's ``weight_version``."""
        errors, names = [], {}
        for url, eng in self.engines.items():
            try:
                info = self.identify(url)
            except FleetError as e:
                errors.append(str(e))
                continue
            names[url] = info["id"]
            eng.weight_version, eng.owned_by = as_version(info.get("weight_version")), str(info.get("owned_by", ""))
        if not errors and len(set(names.values())) > 1:
            errors.append(f"the engines serve different models: {names}")
        if errors:
            raise FleetError(f"{len(errors)} of {len(self.engines)} rollout engines cannot join the fleet: "
                             + "; ".join(errors))
        if self.model is None:
            self.model = next(iter(names.values()))
            for eng in self.engines.values():
                eng.client.model = self.model

    def identify(self, url: str) -> dict[str, Any]:
        """What engine ``url`` serves (its ``/v1/models`` entry), checked against this fleet: reachable, the
        right model name, the same tokenizer. Raises :class:`FleetError` naming the engine and the reason."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with httpx2.Client(base_url=url, headers=headers, timeout=self.connect_timeout_s, verify=tls_context()) as http:
                r = http.get("/v1/models")
                if r.status_code != 200:
                    raise FleetError(f"{url}: GET /v1/models answered HTTP {r.status_code}: {r.text[:200]}")
                data = r.json().get("data") or []
                info = data[0] if data and isinstance(data[0], dict) else None
                if info is None or not isinstance(info.get("id"), str):
                    raise FleetError(f"{url}: GET /v1/models names no model: {r.text[:200]}")
                if self.model is not None and info["id"] != self.model:
                    raise FleetError(f"{url} serves model {info['id']!r}, not {self.model!r}")
                self._check_tokenizer(url, http, info)
        except (httpx2.TransportError, httpx2.TimeoutException) as e:
            raise FleetError(f"{url} is unreachable ({type(e).__name__}: {e or 'timed out'})") from None
        except (ValueError, AttributeError) as e:
            raise FleetError(f"{url}: GET /v1/models answered something that is not a model list ({e})") from None
        return info

    def _check_tokenizer(self, url: str, http: httpx2.Client, info: dict[str, Any]) -> None:
        theirs = info.get("tokenizer_fingerprint")
        if theirs is not None:
            if self._fingerprint is None:
                self._fingerprint = tokenizer_fingerprint(self.tokenizer)
            if theirs != self._fingerprint:
                raise FleetError(f"{url} serves {info['id']!r} with another tokenizer (fingerprint {theirs[:12]}..., "
                                 f"the trainer's is {self._fingerprint[:12]}...): its token ids mean other strings")
            return
        r = http.post("/tokenize", json={"model": info["id"], "prompt": IDENTITY_TEXT, "add_special_tokens": False})
        ours = list(self.tokenizer.encode(IDENTITY_TEXT, add_special_tokens=False))
        got = r.json().get("tokens") if r.status_code == 200 else None
        if got != ours:
            raise FleetError(f"{url} tokenises differently from the trainer's tokenizer (POST /tokenize answered "
                             f"HTTP {r.status_code}: {r.text[:120]}): another tokenizer, or none to compare")

    # -- rotation -------------------------------------------------------------------------------------
    def in_rotation(self) -> list[str]:
        """The URLs of the engines in rotation, in order."""
        with self._lock:
            return [u for u, e in self.engines.items() if e.in_rotation]

    def take_out(self, url: str, reason: str) -> None:
        """Take engine ``url`` out of rotation (a warning names it and ``reason``); no-op when it is out."""
        with self._lock:
            eng = self.engines[url]
            if not eng.in_rotation:
                return
            eng.in_rotation, eng.reason = False, reason
            eng.events.append(f"out: {reason}")
            self.stats["taken_out"] += 1
        log.warning("rollout engine %s taken out of rotation: %s", url, reason)

    def admit(self, url: str, weight_version: Any) -> None:
        """Put engine ``url`` back in rotation, holding ``weight_version`` (after a verified weight sync)."""
        with self._lock:
            eng = self.engines[url]
            if not eng.in_rotation:
                self.stats["admitted"] += 1
                eng.events.append(f"admitted at version {weight_version}")
                log.warning("rollout engine %s rejoins the rotation at weight version %s", url, weight_version)
            eng.in_rotation, eng.reason, eng.weight_version = True, "", weight_version

    def candidates(self) -> list[str]:
        """Engines out of rotation that are up again and serve the right model and tokenizer
        (:meth:`identify`): to be sent the weights and, once verified, :meth:`admit` ted."""
        out = []
        for url in [u for u, e in self.engines.items() if not e.in_rotation]:
            try:
                self.identify(url)
            except FleetError as e:
                log.info("rollout engine %s stays out of rotation: %s", url, e)
                continue
            out.append(url)
        return out

    def probe(self, url: str, ids: list[int]) -> list[float]:
        """Engine ``url``'s ``log p(ids[i] | ids[:i])`` for ``i >= 1`` at temperature 1 (vLLM's
        ``prompt_logprobs``): the weight-sync probe. Raises :class:`agent.backends.openai.BackendError` when
        the engine fails or answers without them."""
        body = {"model": self.model, "prompt": list(ids), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        eng = self.engines[url]
        try:
            r = httpx2.post(url + "/v1/completions", json=body, headers=headers, timeout=eng.client.timeout_s,
                            verify=tls_context())
            steps = r.json()["choices"][0]["prompt_logprobs"] if r.status_code == 200 else None
            if not isinstance(steps, list) or len(steps) != len(ids):
                raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
            return [float(step[str(t)]["logprob"]) for step, t in zip(steps[1:], ids[1:], strict=True)]
        except (httpx2.TransportError, httpx2.TimeoutException, ValueError, KeyError, TypeError, IndexError) as e:
            raise BackendError(f"{url}: the weight-sync probe failed ({type(e).__name__}: {e})") from None

    def handle(self, url: str) -> EngineProbe:
        """An object with ``probe_logprobs(ids)`` for engine ``url``, as
        :func:`training.rollout.weight_sync.check_engine` expects of a rollout backend."""
        return EngineProbe(self, url)

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """Not for a fleet: each engine is verified on its own (``handle(url).probe_logprobs``). Raises
        ``NotImplementedError`` so that a check written for one engine fails loudly instead of passing."""
        raise NotImplementedError("a fleet's engines are verified one by one: "
                                  "training.rollout.fleet_sync.verify_fleet, or Fleet.handle(url)")

    # -- routing --------------------------------------------------------------------------------------
    def pick(self, episode: str | None) -> Engine | None:
        """The engine for a request of ``episode`` (see the module docstring), its in-flight count raised;
        ``None`` when no engine is in rotation."""
        with self._lock:
            if episode is not None:
                url = self.affinity.get(episode)
                if url is not None and self.engines[url].in_rotation:
                    self.affinity.move_to_end(episode)
                    self.stats["affinity_hits"] += 1
                    eng = self.engines[url]
                    eng.inflight += 1
                    return eng
            live = [e for e in self.engines.values() if e.in_rotation]
            if not live:
                return None
            eng = min(live, key=lambda e: (e.inflight, e.served))  # min keeps the first of equals
            eng.inflight += 1
            if episode is not None:
                self.affinity[episode] = eng.url
                self.affinity.move_to_end(episode)
                while len(self.affinity) > self.max_affinity:
                    self.affinity.popitem(last=False)
            return eng

    def _done(self, eng: Engine, served: bool) -> None:
        with self._lock:
            eng.inflight -= 1
            eng.served += int(served)

    async def _engine_for(self, episode: str | None) -> Engine:
        """:meth:`pick`, waiting ``retry_waits`` in turn while no engine is in rotation; then
        :class:`FleetUnavailable`."""
        for wait in (*self.retry_waits, None):
            eng = self.pick(episode)
            if eng is not None:
                return eng
            if wait is None:
                break
            await asyncio.sleep(wait)
        with self._lock:
            why = "; ".join(f"{u}: {e.reason}" for u, e in self.engines.items())
        raise FleetUnavailable(f"all {len(self.engines)} rollout engines are out of rotation ({why}); waited "
                               f"{sum(self.retry_waits):g} s ({' + '.join(f'{w:g}' for w in self.retry_waits)}) "
                               "for one to rejoin")

    async def _one(self, clients: dict[str, Any], sems: dict[str, asyncio.Semaphore], prompt: list[int],
                   params: SamplingParams, i: int) -> Generation:
        first = True
        while True:
            eng = await self._engine_for(params.episode)
            if not first:
                with self._lock:
                    self.stats["rerouted"] += 1
            first = False
            if eng.url not in clients:
                clients[eng.url] = eng.client.async_client()
                sems[eng.url] = asyncio.Semaphore(self.max_concurrency)
            try:
                gen = await eng.client.request(clients[eng.url], sems[eng.url], prompt, params, i)
            except BackendUnavailable as e:
                self._done(eng, False)
                self.take_out(eng.url, f"{type(e).__name__}: {e}")
                continue
            except BaseException:
                self._done(eng, False)
                raise
            self._done(eng, True)
            gen.meta["engine"] = eng.url
            gen.meta.setdefault("weight_version", eng.weight_version)
            return gen

    async def _agenerate(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        clients: dict[str, Any] = {}
        sems: dict[str, asyncio.Semaphore] = {}
        with self._lock:
            self.stats["requests"] += len(requests)
        try:
            out = await asyncio.gather(*(self._one(clients, sems, p, params, i)
                                         for i, (p, params) in enumerate(requests)), return_exceptions=True)
        finally:
            for c in clients.values():
                await c.aclose()
        failed = [r for r in out if isinstance(r, BaseException)]
        for r in failed:  # a cancellation, or every engine down: the whole batch
            if not isinstance(r, Exception) or isinstance(r, BackendUnavailable):
                raise r
        if failed:  # requests that failed on their own: each request's outcome (agent.loop.scheduler)
            raise failed[0] if len(out) == 1 else BatchPartlyFailed(list(out))
        return list(out)

    # -- LLM protocol ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One continuation per prompt, each request on its engine (see the module docstring). Raises
        :class:`FleetUnavailable` when every engine is out after the retry waits, the request's own
        :class:`agent.backends.openai.BackendError` for a batch of one, else
        :class:`agent.llm.BatchPartlyFailed` with each request's outcome."""
        return self.generate_each([(p, params) for p in prompts])

    def generate_each(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        """:meth:`generate` with each request's own settings (its ``max_new_tokens`` and ``episode``)."""
        return run_sync(self._agenerate(requests)) if requests else []

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each engine's state: in rotation, reason, in flight, served, weight version, events."""
        with self._lock:
            return {u: {"in_rotation": e.in_rotation, "reason": e.reason, "inflight": e.inflight, "served": e.served,
                        "weight_version": e.weight_version, "events": list(e.events)}
                    for u, e in self.engines.items()}


@dataclass
class EngineProbe:
    """One engine of a fleet as :func:`training.rollout.weight_sync.check_engine` sees a backend."""

    fleet: Fleet
    url: str

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        return self.fleet.probe(self.url, ids)


def wait_until_up(url: str, timeout_s: float, what: str = "the engine") -> None:
    """Poll ``url/health`` until it answers 200; ``TimeoutError`` naming ``url`` and ``what`` after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx2.get(root_url(url) + "/health", timeout=5.0, verify=tls_context())
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except (httpx2.TransportError, httpx2.TimeoutException) as e:
            last = type(e).__name__
        time.sleep(0.2)
    raise TimeoutError(f"{what} at {url} did not answer /health within {timeout_s:g} s (last: {last})")
