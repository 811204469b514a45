"""Web search as a Sleuth retriever (``retrieval.method: web``): Tavily's API and SearXNG instances.

Every answer is kept in a persistent on-disk cache keyed by ``(provider, query, k)`` (SQLite, in
``cache_dir``), so a training run, a resumed one or a second run over the same questions never pays twice for
a query; requests are spaced to at most ``rate_per_s`` a second (all threads together), and a 429 (waiting
what ``Retry-After`` asks, up to 60 s), a 5xx, a timeout or a connection error is retried with exponential
backoff up to ``max_retries`` times. Results come back as :class:`~retrieval.base.Hit` (id: the page URL,
title, ``contents`` = title line + snippet, score: the provider's, else by rank).

Errors: a missing API key is a ``ValueError`` naming the environment variable, when the retriever is made;
401/403 and other 4xx answers are :class:`WebSearchError` with the provider's message (not retried: the same
request would fail again); still failing after the retries is :class:`WebSearchUnavailable`: the episodes
whose query failed end with the error (the agent loop records it), the trainer runs them again and leaves
those that still fail out of the update, and the run goes on. A malformed answer is a :class:`WebSearchError`. Follows the providers' public docs: Tavily ``POST /search`` (Bearer key,
``max_results``), SearXNG ``GET /search?format=json`` (the instance must enable the JSON format).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import httpx2

from retrieval.base import Hit, check_queries
from retrieval.retry import RetriesExhausted, Retry, RetryPolicy, call, retry_after_s, retryable_status

PROVIDERS = {
    # provider: (default base URL, environment variable of the key or None, the key is required)
    "tavily": ("https://api.tavily.com", "TAVILY_API_KEY", True),
    "searxng": (None, "SEARXNG_API_KEY", False),
}


class WebSearchError(RuntimeError):
    """The provider refused a request or answered something that is not a result list; the message says which."""


class WebSearchUnavailable(WebSearchError):
    """A request still failed after all its retries (timeouts, connection errors, 429, 5xx). Not a
    ``ConnectionError`` on purpose: web APIs fail request by request (a rate limit, one slow query), so the
    agent scheduler runs a failed batch's queries again one by one and only the episodes whose own query still
    fails end with the error (the trainer reruns them once, then leaves them out of the update)."""


class WebCache:
    """A persistent ``(provider, query, k) -> hits`` store in ``path`` (SQLite); thread-safe."""

    def __init__(self, path: str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS hits (provider TEXT, query TEXT, k INTEGER, hits TEXT, "
                         "PRIMARY KEY (provider, query, k))")
        self._lock = threading.Lock()

    def get(self, provider: str, query: str, k: int) -> list[Hit] | None:
        with self._lock:
            row = self._db.execute("SELECT hits FROM hits WHERE provider=? AND query=? AND k=?",
                                   (provider, query, k)).fetchone()
        return None if row is None else [Hit(*h) for h in json.loads(row[0])]

    def put(self, provider: str, query: str, k: int, hits: list[Hit]) -> None:
        data = json.dumps([list(h) for h in hits], ensure_ascii=False)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO hits VALUES (?, ?, ?, ?)", (provider, query, k, data))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM hits").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class RateLimiter:
    """At most ``rate_per_s`` starts a second over all threads (``0``: no limit)."""

    def __init__(self, rate_per_s: float):
        self.interval = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + self.interval
        if start > now:
            time.sleep(start - now)


class WebSearch:
    """:class:`~retrieval.base.Retriever` over a web search API (see the module docstring).

    Args:
        provider: ``"tavily"`` or ``"searxng"``.
        url: the API's base URL (Tavily's by default; a SearXNG instance's, required, or ``$SEARXNG_URL``).
        cache_dir: where the on-disk cache lives (``web_cache.sqlite``).
        api_key_env: the environment variable holding the key (default ``TAVILY_API_KEY`` /
            ``SEARXNG_API_KEY``, the latter optional, sent as a Bearer token when set).
        rate_per_s: most requests a second (0: unlimited). timeout_s: per request, seconds.
        max_retries: retries after the first attempt. backoff_s: first retry delay (doubles each retry).
        deadline_s: no retry wait of a query ends later than this many seconds after its first attempt
            (``None``: none); the retries are :func:`retrieval.retry.call`'s.

    ``stats``: ``requests`` (sent), ``cache_hits``, ``retries``. Raises ``ValueError`` for an unknown provider,
    a missing key or SearXNG URL.
    """

    concurrent_calls = True

    def __init__(self, provider: str, url: str | None = None, cache_dir: str | Path = "runs/web_cache",
                 api_key_env: str | None = None, rate_per_s: float = 1.0, timeout_s: float = 20.0,
                 max_retries: int = 4, backoff_s: float = 1.0, deadline_s: float | None = None):
        if provider not in PROVIDERS:
            raise ValueError(f"unknown web search provider {provider!r}; use one of {', '.join(PROVIDERS)}")
        default_url, env, required = PROVIDERS[provider]
        env = api_key_env or env
        self.provider, self.key = provider, os.environ.get(env) or None
        if required and not self.key:
            raise ValueError(f"web search with {provider} needs an API key in the environment variable {env}")
        url = url or default_url or os.environ.get("SEARXNG_URL")
        if not url:
            raise ValueError(f"web search with {provider} needs the instance's URL (retrieval.web_url or $SEARXNG_URL)")
        self.url, self.env = url.rstrip("/"), env
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.deadline_s = deadline_s
        self.cache = WebCache(Path(cache_dir) / "web_cache.sqlite")
        self.limiter = RateLimiter(rate_per_s)
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.http = httpx2.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self.stats = {"requests": 0, "cache_hits": 0, "retries": 0}
        self._stats_lock = threading.Lock()

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of a query (from ``max_retries``, ``backoff_s``, ``deadline_s``)."""
        return RetryPolicy(self.max_retries, self.backoff_s, deadline_s=self.deadline_s)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-``k`` web results per query, from the cache when it has ``(provider, query, k)``. Raises as the
        class says."""
        check_queries(queries, k)
        out = []
        for q in queries:
            hits = self.cache.get(self.provider, q, k)
            if hits is None:
                hits = self._fetch(q, k)
                self.cache.put(self.provider, q, k, hits)
            else:
                self._count("cache_hits")
            out.append(hits)
        return out

    def _request(self, query: str, k: int) -> httpx2.Response:
        if self.provider == "tavily":
            return self.http.post("/search", json={"query": query, "max_results": k, "search_depth": "basic"})
        return self.http.get("/search", params={"q": query, "format": "json"})

    def _fetch(self, query: str, k: int) -> list[Hit]:
        def attempt() -> list[Hit]:
            self.limiter.wait()
            self._count("requests")
            try:
                r = self._request(query, k)
            except (httpx2.TimeoutException, httpx2.TransportError) as e:
                raise Retry(f"{type(e).__name__}: {e or 'timed out'}") from None
            if retryable_status(r.status_code):
                raise Retry(f"HTTP {r.status_code}: {r.text[:200]}", retry_after_s(r.headers.get("retry-after")))
            if r.status_code in (401, 403):
                raise WebSearchError(f"{self.provider} at {self.url} refused the API key (HTTP {r.status_code}: "
                                     f"{r.text[:200]}); check ${self.env}")
            if r.status_code >= 400:
                raise WebSearchError(f"{self.provider} at {self.url} answered HTTP {r.status_code} for {query!r}: "
                                     f"{r.text[:300]}")
            return self._parse(r, k)

        try:
            return call(attempt, self.retry, lambda wait: self._count("retries"))
        except RetriesExhausted as e:
            raise WebSearchUnavailable(f"{self.provider} at {self.url} failed after {e.attempts} attempts for "
                                       f"{query!r} ({e.last.reason})") from None

    def _parse(self, r: httpx2.Response, k: int) -> list[Hit]:
        try:
            results = r.json()["results"]
            hits = []
            for i, x in enumerate(results[:k]):
                title, text = str(x.get("title") or ""), str(x.get("content") or "")
                score = x.get("score")
                score = float(score) if isinstance(score, (int, float)) else float(len(results) - i)
                hits.append(Hit(str(x["url"]), title, f"{title}\n{text}", score))
            return hits
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WebSearchError(f"{self.provider} at {self.url} answered something that is not a result list "
                                 f"({type(e).__name__}: {e}): {r.text[:200]!r}") from None

    def close(self) -> None:
        self.http.close()
        self.cache.close()
