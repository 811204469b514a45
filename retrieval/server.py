"""A retrieval server that is a drop-in for Search-R1's ``search_r1/search/retrieval_server.py``.

``POST /retrieve`` takes ``{"queries": [...], "topk": k, "return_scores": true}`` and answers
``{"result": [[{"document": {"id", "title", "contents"}, "score": s}, ...], ...]}`` (one list per query,
best first); with ``return_scores`` false each item is the document itself, as in Search-R1. ``contents``
carries the title on its first line, which Search-R1's client (``search_r1/llm_agent/generation.py``)
renders as ``Doc i(Title: <first line>) <rest>``. ``GET /health`` reports the index and batching counters.

Reply path: for retrievers over an index directory (BM25, dense, Lucene: they expose ``rows`` and a passage
store), the worker searches for row ids only and the reply is spliced from the store's stored JSON bytes
(:func:`retrieval.reply.rows_to_reply`: a numba kernel copies them from the store's memory map), so no
passage is parsed or re-serialised on the server; such replies carry the ``x-sleuth-rows-reply`` header
(:data:`retrieval.base.ROWS_REPLY_HEADER`) naming their format: Search-R1's; ``columns`` (documents and
scores apart, no wrapper per hit), asked for with ``x-sleuth-reply-format: columns``; or ``columns-stream``,
which Sleuth's client asks for: the same in frames of ``frame_docs`` documents, spliced and sent one after
another, so the client parses the first frames while the rest are still being written (a reply that fits in
one frame is plain ``columns``). Other retrievers (hybrid, cached, remote) go through
:class:`~retrieval.base.Hit` objects and orjson, in Search-R1's format.

Batching: requests wait in a queue; one worker takes everything queued (up to ``max_batch_queries``
queries), runs one ``retriever.search`` per distinct ``topk`` in a thread and hands each request its slice;
if a search of several requests fails, each is searched alone, so a bad request fails only itself. While
one search runs, the next requests pile up and form the next batch, so concurrent rollout workers share
index passes without a fixed wait (``max_wait_ms`` adds one if wanted).

Limits (each violation is a 4xx whose ``error`` names the limit): body bytes (413), a body that is not JSON,
nests too deeply or holds an over-long integer (400; these and the API key are the shared
:mod:`retrieval.http_guard`'s checks), queries per request, query characters, empty or non-Unicode queries, ``topk``
range, queries x ``topk`` (400), and the reply's estimated bytes (queries x ``topk`` x the index's mean bytes
per hit, :func:`reply_bytes_per_hit`; 413 over ``max_reply_bytes``). Overload is shed, not piled up: a
request that would take the queries waiting or being searched past ``max_pending_queries``, or the
estimated bytes of the replies being searched or sent past ``max_reply_bytes``, is refused at once with 503
and ``Retry-After: 1`` (:data:`BUSY_RETRY_AFTER_S`). With an API key, ``/retrieve`` answers 401 without
``Authorization: Bearer <key>``. A failing search answers 500 and the server keeps serving. Binds 127.0.0.1
unless told otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI
from orjson import dumps as _dumps
from starlette.routing import Route

from retrieval.base import REPLY_FORMAT_HEADER, ROWS_REPLY_HEADER, Hit, Retriever
from retrieval.http_guard import GuardError, RequestGuard, asgi_body
from retrieval.reply import REPLY_FORMATS, rows_to_frame, rows_to_reply

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """Request bounds. ``max_hits`` bounds queries x ``topk`` of one request, and with it the reply's size
    (about 0.7 KB per hit for wiki-18 passages); ``max_pending_queries`` bounds the queries of all requests
    waiting or being searched (503 past it; at least ``max_queries``, else ``ValueError``);
    ``max_reply_bytes`` bounds the estimated reply bytes of all requests being searched or answered
    (queries x ``topk`` x the index's mean bytes per hit, :func:`reply_bytes_per_hit`): a request whose own
    estimate is over it gets 413, one that would take the total over it 503 with ``Retry-After``;
    ``allow_empty_queries`` answers an empty query with no hits instead of a 400."""

    max_queries: int = 4096
    max_query_chars: int = 4096
    max_topk: int = 1000
    max_hits: int = 1 << 20
    default_topk: int = 3
    max_body_bytes: int = 16 << 20
    max_pending_queries: int = 1 << 16
    max_reply_bytes: int = 1 << 30
    allow_empty_queries: bool = False

    def __post_init__(self):
        if self.max_pending_queries < self.max_queries:  # a full-size request would be refused forever
            raise ValueError(f"max_pending_queries ({self.max_pending_queries}) must be at least max_queries "
                             f"({self.max_queries})")


BUSY_RETRY_AFTER_S = 1
"""``Retry-After`` (seconds) of the 503 a request gets past ``max_pending_queries`` or ``max_reply_bytes``."""

HIT_FRAME_BYTES = 48
"""Reply bytes of one hit besides its stored passage JSON (Search-R1's ``{"document": ..., "score": s}``
wrapper, the comma), in :func:`reply_bytes_per_hit`'s estimate."""

DEFAULT_BYTES_PER_HIT = 1024
"""The estimate of reply bytes per hit for a retriever without a passage store to measure."""


def reply_bytes_per_hit(retriever) -> int:
    """Estimated reply bytes per hit of ``retriever``: the mean stored passage JSON of its index's passage
    store (``store.offsets``, BM25, dense, Lucene, hybrid, behind a cache too) plus :data:`HIT_FRAME_BYTES`;
    :data:`DEFAULT_BYTES_PER_HIT` without a store."""
    offsets = getattr(getattr(retriever, "store", None), "offsets", None)
    if offsets is None or len(offsets) < 2:
        return DEFAULT_BYTES_PER_HIT
    return int(offsets[-1]) // (len(offsets) - 1) + HIT_FRAME_BYTES


class RequestError(ValueError):
    """A request breaks a limit; ``status`` is the HTTP code to answer."""

    def __init__(self, msg: str, status: int = 400):
        super().__init__(msg)
        self.status = status


def parse_request(body: bytes, limits: ServerLimits, guard: RequestGuard | None = None) -> tuple[list[str], int, bool]:
    """Validate a ``/retrieve`` body; returns (queries, topk, return_scores) or raises :class:`RequestError`.
    The body is bounded and parsed by ``guard`` (default: one of ``limits.max_body_bytes``; see
    :mod:`retrieval.http_guard`)."""
    guard = guard or RequestGuard(max_body_bytes=limits.max_body_bytes)
    try:
        guard.check_length(len(body))
        obj = guard.parse_object(body, " with 'queries'")
    except GuardError as e:
        raise RequestError(e.message, e.status) from None
    queries = obj.get("queries")
    if isinstance(queries, str):
        queries = [queries]
    if not isinstance(queries, list):
        raise RequestError("'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise RequestError(
            f"{len(queries)} queries in one request; the limit is {limits.max_queries} (max_queries)"
        )
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(f"query {i} is {type(q).__name__}, expected a string")
        if len(q) > limits.max_query_chars:
            raise RequestError(
                f"query {i} has {len(q)} characters; the limit is {limits.max_query_chars} (max_query_chars)"
            )
        if not q.strip() and not limits.allow_empty_queries:
            raise RequestError(f"query {i} is empty")
        if not q.isascii():
            try:
                q.encode()
            except UnicodeEncodeError as e:  # JSON may escape a lone surrogate; no encoder takes one
                raise RequestError(
                    f"query {i} is not valid Unicode ({e.reason} at character {e.start})") from None
    topk = obj.get("topk", limits.default_topk)
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise RequestError(f"'topk' must be an integer, got {topk!r}")
    if not 1 <= topk <= limits.max_topk:
        raise RequestError(f"'topk' must be between 1 and {limits.max_topk} (max_topk), got {topk}")
    if len(queries) * topk > limits.max_hits:
        raise RequestError(
            f"{len(queries)} queries x topk {topk} = {len(queries) * topk} hits in one request; the limit is "
            f"{limits.max_hits} (max_hits)"
        )
    return queries, topk, _flag(obj.get("return_scores"), "return_scores")


_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}


def _flag(v: Any, name: str) -> bool:
    """A JSON boolean read as Search-R1's pydantic server reads ``bool`` fields: ``null`` is false, ``0``/``1``
    and the strings ``"true"``/``"false"``/``"yes"``/``"no"``... are accepted (``bool("false")`` would be
    true). Anything else raises :class:`RequestError`."""
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise RequestError(f"{name!r} must be a boolean, got {v!r:.40}")


def hits_to_result(hits: list[list[Hit]], return_scores: bool) -> list[list[dict]]:
    """Search-R1's ``result`` field."""
    out = []
    for hs in hits:
        docs = [{"id": h.id, "title": h.title, "contents": h.contents} for h in hs]
        out.append([{"document": d, "score": h.score} for d, h in zip(docs, hs)] if return_scores else docs)
    return out


def row_source(retriever):
    """``(rows, store)`` when ``retriever`` searches an index directory by row ids
    (:meth:`retrieval.index._RowRetriever.rows`: BM25, dense, Lucene) and its store can hand out raw passage
    JSON; ``None`` otherwise (wrappers such as the LRU cache must keep their own ``search``, so the method is
    looked up on the class, not forwarded)."""
    store = getattr(retriever, "store", None)
    if callable(getattr(type(retriever), "rows", None)) and callable(getattr(store, "spans", None)):
        return retriever.rows, store
    return None


class Batcher:
    """Coalesce concurrent searches into one ``retriever.search`` call (see module docstring).

    ``batches``/``queries`` count the index passes and the queries they served; ``pending`` is the number of
    queries waiting or being searched. Raises ``ValueError`` for ``max_batch_queries < 1`` or a
    ``max_wait_ms`` that is not a finite number >= 0 (NaN or infinity: the batcher would sleep for ever).
    """

    def __init__(self, retriever: Retriever, max_batch_queries: int = 8192, max_wait_ms: float = 0.0):
        if max_batch_queries < 1:
            raise ValueError(f"max_batch_queries must be >= 1, got {max_batch_queries}")
        if not math.isfinite(max_wait_ms) or max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be a finite number >= 0, got {max_wait_ms}")
        self.retriever = retriever
        self.rows = row_source(retriever)  # (rows, store) for the raw-bytes reply path, or None
        self.max_batch_queries = max_batch_queries
        self.max_wait = max_wait_ms / 1000
        self.batches = self.queries = self.pending = 0
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def search(self, queries: list[str], k: int) -> list[list[Hit]] | tuple[np.ndarray, np.ndarray]:
        """Search ``queries`` together with whatever else is queued. Returns hit lists, or ``([Q, k] rows,
        [Q, k] scores)`` arrays on the row path (see :func:`encode_reply`)."""
        fut = asyncio.get_running_loop().create_future()
        self.pending += len(queries)
        try:
            await self._queue.put((queries, k, fut))
            return await fut
        finally:
            self.pending -= len(queries)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self._queue.get()]
            if self.max_wait:
                await asyncio.sleep(self.max_wait)
            n = len(items[0][0])
            while not self._queue.empty() and n < self.max_batch_queries:
                items.append(self._queue.get_nowait())
                n += len(items[-1][0])
            try:  # one pass per distinct topk: a deeper search's top 3 need not be the top 3 (hybrid, HNSW)
                for k in dict.fromkeys(k for _, k, _ in items):
                    await self._serve(loop, [item for item in items if item[1] == k], k)
            except Exception as e:  # a bug here must not leave requests waiting forever
                log.exception("retrieval batch failed")
                _fail(items, e)

    async def _serve(self, loop, group: list, k: int) -> None:
        """Search the queries of ``group`` (``(queries, k, future)`` items of one ``k``) in one pass and
        resolve each future with its slice. If that search fails and the group holds several requests, each
        is searched alone, so one bad request (say, a query the encoder rejects) fails only itself."""
        queries = [q for qs, _, _ in group for q in qs]
        search = self.rows[0] if self.rows else self.retriever.search
        try:  # requests with no queries: nothing to search (the row path still answers with empty arrays)
            res = await loop.run_in_executor(None, search, queries, k) if queries or self.rows else []
            parts = self._split(res, [len(qs) for qs, _, _ in group], k)
        except Exception as e:  # noqa: BLE001 (the server keeps serving; each waiting request gets the error)
            if len(group) > 1:
                for item in group:
                    await self._serve(loop, [item], k)
            else:
                _fail(group, e)
            return
        self.batches += 1
        self.queries += len(queries)
        for (_, _, fut), part in zip(group, parts):
            if not fut.done():
                fut.set_result(part)

    def _split(self, res, sizes: list[int], k: int) -> list:
        """One search result cut into per-request slices of ``sizes`` queries; raises ``RuntimeError`` when
        the retriever answered another number of queries."""
        n = len(res[0]) if self.rows else len(res)
        if n != sum(sizes):
            raise RuntimeError(f"the retriever answered {n} queries of {sum(sizes)}")
        at, out = 0, []
        for m in sizes:
            if self.rows:
                out.append((res[0][at : at + m, :k], res[1][at : at + m, :k]))
            else:
                out.append([h[:k] for h in res[at : at + m]])
            at += m
        return out

    def encode_reply(
        self, res: list[list[Hit]] | tuple[np.ndarray, np.ndarray], return_scores: bool, fmt: str = "search-r1"
    ) -> bytes | memoryview:
        """The ``/retrieve`` reply body for one request's :meth:`search` result; ``fmt`` (``search-r1`` or
        ``columns``, see :func:`rows_to_reply`) applies on the row path only."""
        if isinstance(res, tuple):
            return rows_to_reply(res[0], res[1], self.rows[1], return_scores, fmt)
        return _dumps({"result": hits_to_result(res, return_scores)})


class RetrieveEndpoint:
    """``POST /retrieve`` as a plain ASGI app: checks the API key (``api_key``; 401 without it), reads the
    body (at most ``limits.max_body_bytes``, else 413) and parses it (both by the shared
    :class:`retrieval.http_guard.RequestGuard`), validates it (:func:`parse_request`), admits it
    within ``max_pending_queries`` and ``max_reply_bytes`` (:meth:`admit`), searches through the
    :class:`Batcher` and sends the reply (:meth:`Batcher.encode_reply`, or frames of ``frame_docs`` documents
    for ``columns-stream``). Errors answer ``{"error": msg, "detail": msg}``: 4xx for the request, 400 for a
    ``ValueError``/``TypeError`` of the search, 500 for any other failure; the server keeps serving.
    ``reply_bytes`` is the estimated reply bytes of the requests admitted and not yet answered.
    """

    def __init__(self, batcher: Batcher, limits: ServerLimits, frame_docs: int = 320, api_key: str | None = None):
        self.batcher, self.limits, self.frame_docs = batcher, limits, frame_docs
        self.guard = RequestGuard(api_key, limits.max_body_bytes)
        self.bytes_per_hit = reply_bytes_per_hit(batcher.retriever)
        self.reply_bytes = 0

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def tracked(msg) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self._handle(scope, receive, tracked)
        except Exception as e:  # a bug: a JSON 500 with its reason, logged with its traceback
            log.exception("/retrieve failed")
            if not started:
                await _send(send, 500, _error_body(f"internal server error ({type(e).__name__}: {e})"))

    def admit(self, n_queries: int, topk: int) -> tuple[int, bytes | None, int]:
        """``(reply bytes estimate, error body or None, status)`` of a request of ``n_queries`` x ``topk``:
        413 when its estimate alone is over ``max_reply_bytes``, 503 when it would take the queries pending
        over ``max_pending_queries`` or the reply bytes in flight over ``max_reply_bytes``."""
        lim, pending = self.limits, self.batcher.pending
        est = n_queries * topk * self.bytes_per_hit
        if est > lim.max_reply_bytes:
            return est, _error_body(
                f"the reply to {n_queries} queries x topk {topk} is estimated at {est} bytes ({self.bytes_per_hit} "
                f"per hit); the limit is {lim.max_reply_bytes} (max_reply_bytes): send fewer queries or a smaller "
                "topk"), 413
        if pending + n_queries > lim.max_pending_queries:
            return est, _error_body(
                f"server busy: {pending} queries pending, {n_queries} more would pass the limit of "
                f"{lim.max_pending_queries} (max_pending_queries); retry shortly"), 503
        if self.reply_bytes + est > lim.max_reply_bytes:
            return est, _error_body(
                f"server busy: replies of about {self.reply_bytes} bytes in flight, this one's {est} more would "
                f"pass the limit of {lim.max_reply_bytes} (max_reply_bytes); retry shortly"), 503
        return est, None, 200

    async def _handle(self, scope, receive, send) -> None:
        headers = dict(scope["headers"])
        asked = headers.get(_FORMAT, b"").decode("latin-1")
        try:
            self.guard.check_auth(headers.get(b"authorization"))
            body = await self.guard.read_body(asgi_body(receive), headers.get(b"content-length"))
            queries, topk, return_scores = parse_request(body, self.limits, self.guard)
        except GuardError as e:
            extra = [(b"www-authenticate", b"Bearer")] if e.status == 401 else None
            return await _send(send, e.status, _error_body(e.message), extra)
        except RequestError as e:
            return await _send(send, e.status, _error_body(str(e)))
        est, refusal, status = self.admit(len(queries), topk)
        if refusal is not None:
            extra = [(b"retry-after", b"%d" % BUSY_RETRY_AFTER_S)] if status == 503 else None
            return await _send(send, status, refusal, extra)
        self.reply_bytes += est
        try:
            await self._answer(send, queries, topk, return_scores, asked)
        finally:
            self.reply_bytes -= est

    async def _answer(self, send, queries: list[str], topk: int, return_scores: bool, asked: str) -> None:
        try:
            hits = await self.batcher.search(queries, topk)
        except (ValueError, TypeError) as e:
            return await _send(send, 400, _error_body(f"search failed: {e}"))
        except Exception as e:  # noqa: BLE001 (any backend failure is a 500, not a dead server)
            return await _send(send, 500, _error_body(f"search failed: {type(e).__name__}: {e}"))
        row_path = isinstance(hits, tuple)
        if asked == "columns-stream" and return_scores and row_path:
            step = max(1, self.frame_docs // max(hits[0].shape[1], 1))  # queries per frame
            if len(queries) > step:
                return await self._stream(send, *hits, step)
            asked = "columns"  # one frame's worth: one plain columns body costs less than a stream
        fmt = asked if asked in REPLY_FORMATS and return_scores and row_path else "search-r1"
        try:
            body = self.batcher.encode_reply(hits, return_scores, fmt)
        except Exception as e:  # noqa: BLE001 (e.g. a row outside a store that changed under the server)
            return await _send(send, 500, _error_body(f"reply failed: {type(e).__name__}: {e}"))
        await _send(send, 200, body, [(_ROWS, fmt.encode())] if row_path else None)

    async def _stream(self, send, rows: np.ndarray, scores: np.ndarray, step: int) -> None:
        """Answer ``columns-stream`` (chunked transfer): the ``[Q, k]`` ``rows``/``scores`` in frames of
        ``step`` queries (:func:`retrieval.reply.rows_to_frame`), each spliced and sent before the next is
        spliced, so the client parses the first frames while the rest are still being written. A failure
        before the first frame is an ordinary 500; after it, an error frame (``{"error": ...}``) ends the
        stream, which the client raises."""
        store, started = self.batcher.rows[1], False
        try:
            for a in range(0, len(rows), step):
                frame = rows_to_frame(rows[a : a + step], scores[a : a + step], store)
                if not started:
                    headers = [(b"content-type", b"application/octet-stream"), (_ROWS, b"columns-stream")]
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    started = True
                for part in frame:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
        except Exception as e:  # noqa: BLE001 (as in __call__)
            msg = f"reply failed: {type(e).__name__}: {e}"
            if not started:
                return await _send(send, 500, _error_body(msg))
            line = _error_body(msg) + b"\n"
            await send({"type": "http.response.body", "body": b"%d\n" % len(line) + line, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


_ROWS, _FORMAT = ROWS_REPLY_HEADER.encode(), REPLY_FORMAT_HEADER.encode()


def _fail(items: list, e: BaseException) -> None:
    for _, _, fut in items:
        if not fut.done():
            fut.set_exception(e)


def _error_body(msg: str) -> bytes:
    return _dumps({"error": msg, "detail": msg})


async def _send(send, status: int, body: bytes | memoryview, extra: list | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % memoryview(body).nbytes)]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


def create_app(
    retriever: Retriever,
    limits: ServerLimits | None = None,
    info: dict | None = None,
    max_wait_ms: float = 0.0,
    frame_docs: int = 320,
    api_key: str | None = None,
):
    """The FastAPI app serving ``retriever``. ``info`` is echoed by ``/health`` (index path, method);
    ``max_wait_ms`` goes to the :class:`Batcher`; ``frame_docs`` is the size of a ``columns-stream`` frame in
    documents (``frame_docs // topk`` queries, at least one; see :class:`RetrieveEndpoint`). With ``api_key``
    (not empty), ``/retrieve`` needs ``Authorization: Bearer <api_key>`` (401 otherwise); ``/health`` stays
    open."""
    limits = limits or ServerLimits()
    batcher = Batcher(retriever, max_batch_queries=max(limits.max_queries, 8192), max_wait_ms=max_wait_ms)

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="Sleuth retrieval server (Search-R1 compatible)", lifespan=lifespan)
    app.state.batcher = batcher
    started = time.time()

    # /retrieve is a plain ASGI endpoint ahead of FastAPI's routes: FastAPI's request/response layer cost
    # ~0.1 ms per request, about 1% of a batch of 256 at 10k passages (bench/retrieval.py)
    endpoint = RetrieveEndpoint(batcher, limits, frame_docs, api_key)
    app.router.routes.insert(0, Route("/retrieve", endpoint, methods=["POST"]))

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "uptime_s": round(time.time() - started, 1),
            "batches": batcher.batches,
            "queries": batcher.queries,
            "reply_path": "rows" if batcher.rows else "hits",
            "pending_queries": batcher.pending,
            "reply_bytes_in_flight": endpoint.reply_bytes,
            "reply_bytes_per_hit": endpoint.bytes_per_hit,
            "auth": not endpoint.guard.open,
            "limits": limits.__dict__,
            **(info or {}),
        }

    return app


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Run the app with uvicorn (blocking)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
