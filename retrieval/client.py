"""The HTTP client of a Search-R1-compatible retrieval server (``sleuth serve-retrieval`` or Search-R1's
own ``retrieval_server.py``), behind the :class:`~retrieval.base.Retriever` interface.

Keep-alive connections from the standard library's ``http.client``, pooled and thread-safe
(:class:`_Connections`); a timeout per socket operation, retries with exponential backoff on connection
errors, timeouts, 429 and 5xx (waiting at least what a ``Retry-After: <seconds>`` header of the answer asks,
up to 60 s); a 4xx is the caller's fault and is raised at once with the server's message.
Large batches are split into requests of at most ``max_batch`` queries.

Reply formats: the client asks for ``columns-stream`` (header ``x-sleuth-reply-format``). A Sleuth server
answers a batch larger than one frame with frames ``<byte count>\n<columns object>\n`` of a few hundred
documents each (:func:`retrieval.reply.rows_to_frame`), and the client parses each frame as soon as it has
read it, while the server is still splicing and sending the next: at batch 256, top-10, over 10k passages
this took the server's overhead over in-process search from about +21% to +4-9% (same runs, steady state,
``bench/retrieval.py``'s ``time_blocks``); at 100k passages it made no clear difference, at 1M it cost about
2 ms of a 130 ms call, and after idle gaps it did not help (``bench/RESULTS.md``). A smaller batch comes as
one ``columns`` body; any other server answers Search-R1's format, which is parsed the general way.

Why ``http.client`` and not httpx2 (used for the other HTTP clients) or urllib3: a batch of 256 queries at
top-10 is a ~1.7 MB reply. ``http.client`` reads it in one buffered read; httpx2 (h11, 64 KiB chunks copied
through several buffers) took 2-5 ms on this project's 2-core machine, and urllib3, a layer over
``http.client``, adds ~0.17 ms per request (0.34 ms against 0.52 ms for a 1.7 MB reply over loopback). At 10k
passages an in-process batch of 256 takes ~12 ms, so these fractions of a millisecond are the retrieval
server's overhead over in-process search (``bench/retrieval.py``).
"""

from __future__ import annotations

import functools
import http.client
import os
import select
import threading
from math import nan
from urllib.parse import urlsplit

from orjson import dumps as _dumps
from orjson import loads as _loads

from retrieval.base import REPLY_FORMAT_HEADER, ROWS_REPLY_HEADER, Hit, check_queries
from retrieval.retry import RetriesExhausted, Retry, RetryPolicy, call, retry_after_s, retryable_status

API_KEY_ENV = "SLEUTH_RETRIEVAL_API_KEY"
"""The environment variable holding the retrieval server's API key, read by the client and by
``sleuth serve-retrieval``."""


class RetrievalServerError(ConnectionError):
    """The retrieval server could not be reached or kept failing after all retries."""


class _Connections:
    """Idle keep-alive connections to one ``http``/``https`` host, shared by threads (last in, first out).

    :meth:`take` hands out an idle connection whose socket the server has not closed (uvicorn drops idle
    keep-alive connections after 5 s; a closed socket reads as readable, as urllib3 checks) or a new one;
    :meth:`give` returns it for reuse, keeping at most ``maxsize``.
    Raises ``ValueError`` for a scheme other than http or https.
    """

    def __init__(self, scheme: str, host: str, port: int | None, timeout: float, maxsize: int):
        if scheme not in ("http", "https"):
            raise ValueError(f"retrieval server URL must be http:// or https://, got {scheme!r}")
        self._new = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        self.host, self.port, self.timeout, self.maxsize = host, port, timeout, maxsize
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        """``(connection, reused)``."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._new(self.host, self.port, timeout=self.timeout), False
            if conn.sock is not None and not _readable(conn.sock):
                return conn, True
            conn.close()  # closed by the server (or unread bytes): not reusable

    def give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.maxsize:
                self._idle.append(conn)
                return
        conn.close()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _readable(sock) -> bool:
    """Whether ``sock`` has bytes or EOF waiting (poll: no limit on descriptor numbers, unlike select)."""
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(sock, select.POLLIN)
        return bool(p.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


class _ServerFailed(Retry):
    """The server answered, with a 5xx or 429: it is up, so "is it running?" would mislead."""


class RemoteRetriever:
    """Retriever that POSTs ``{"queries", "topk", "return_scores": true}`` to ``<url>/retrieve``.

    ``url`` may be the server root (``http://127.0.0.1:8000``) or the full ``/retrieve`` endpoint, http or
    https. ``timeout`` is seconds per socket operation (connect, send, the wait for the reply, each read);
    ``retries`` extra attempts wait ``backoff * 2**i`` seconds, or longer when a 429/5xx answer's
    ``Retry-After`` asks it (at most 60 s; a kept-alive connection the server closed meanwhile is replaced at
    once, without using up an attempt); ``max_connections`` idle connections are
    kept for reuse; ``deadline_s`` (``None``: none) ends the retries of a request whose next wait would end
    later than that many seconds after its first attempt. ``reply_format`` is the reply format asked for (``columns-stream``; set ``columns`` or
    ``search-r1`` to compare them). ``api_key`` (default: ``$SLEUTH_RETRIEVAL_API_KEY``, the variable
    ``sleuth serve-retrieval --api-key`` reads too; unset or empty: none) is sent as ``Authorization: Bearer``.
    Raises :class:`RetrievalServerError` when the server is down and ``ValueError`` on a rejected request
    (a 401 among them: a missing or wrong key).
    ``search`` may be called from several threads at once (the connection pool is shared under a lock), so
    ``concurrent_calls`` is true (see :class:`agent.loop.scheduler.Scheduler`).
    """

    concurrent_calls = True

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_batch: int = 1024,
        max_connections: int = 32,
        api_key: str | None = None,
        deadline_s: float | None = None,
    ):
        url = url.rstrip("/")
        key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.endpoint = url if url.endswith("/retrieve") else url + "/retrieve"
        self.base = self.endpoint[: -len("/retrieve")]
        self.retries, self.backoff, self.max_batch = retries, backoff, max_batch
        self.deadline_s = deadline_s
        self.reply_format = "columns-stream"
        u = urlsplit(self.endpoint)
        self._path = u.path
        self._pool = _Connections(u.scheme, u.hostname or "127.0.0.1", u.port, timeout, max_connections)

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of a request (from ``retries``, ``backoff``, ``deadline_s``)."""
        return RetryPolicy(self.retries, self.backoff, deadline_s=self.deadline_s)

    def close(self) -> None:
        self._pool.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _request(self, method: str, path: str, body: bytes | None = None, read=None):
        """The reply of a successful request to ``path`` on the server (see the class docstring for retries and
        errors): its body, or what ``read(response)`` makes of a response with a status below 400 (called
        before the connection goes back to the pool; an ``OSError`` or ``HTTPException`` it raises is retried
        like a failed request; a :class:`RetrievalServerError` or any other exception is raised at once). The
        retries are :func:`retrieval.retry.call`'s."""
        headers = dict(self._auth)
        if body is not None:
            headers |= {"Content-Type": "application/json", REPLY_FORMAT_HEADER: self.reply_format}
        try:
            return call(functools.partial(self._attempt, method, path, body, headers, read), self.retry)
        except RetriesExhausted as e:
            hint = ("it is up but failing: see its log" if isinstance(e.last, _ServerFailed)
                    else "is it running? Start one with: sleuth serve-retrieval --index DIR")
            raise RetrievalServerError(
                f"retrieval server at {self.base} failed after {e.attempts} attempts ({e.last.reason}); {hint}"
            ) from None

    def _attempt(self, method: str, path: str, body: bytes | None, headers: dict, read):
        """One attempt of :meth:`_request`: :class:`~retrieval.retry.Retry` on a connection error, a timeout, 429
        or 5xx (a kept-alive connection the server had closed meanwhile is replaced at once, on a new one,
        within the attempt)."""
        while True:
            conn, reused = self._pool.take()
            try:
                conn.request(method, path, body=body, headers=headers)
                r = conn.getresponse()
                data = read(r) if read is not None and r.status < 400 else r.read()
            except RetrievalServerError:  # a malformed or failed reply: not the connection's fault
                conn.close()
                raise
            except (OSError, http.client.HTTPException) as e:  # refused, timeout, reset, closed mid-reply
                conn.close()
                if reused and not isinstance(e, TimeoutError):
                    continue  # a kept-alive connection the server had closed: again at once, on a new one
                raise Retry(f"{type(e).__name__}: {e}") from None
            except BaseException:
                conn.close()
                raise
            if r.will_close or not r.isclosed():
                conn.close()
            else:
                self._pool.give(conn)
            if r.status < 400:
                return data
            if not retryable_status(r.status):
                hint = f" (set ${API_KEY_ENV} to the server's --api-key)" if r.status == 401 else ""
                raise ValueError(f"retrieval server rejected the request (HTTP {r.status}): {_message(data)}{hint}")
            raise _ServerFailed(f"HTTP {r.status}: {_message(data)}",
                                retry_after_s(r.getheader("retry-after")))

    def health(self) -> dict:
        """The server's ``/health`` JSON."""
        return _loads(self._request("GET", self._path[: -len("/retrieve")] + "/health"))

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """See :meth:`retrieval.base.Retriever.search`."""
        check_queries(queries, k)
        out: list[list[Hit]] = []
        for a in range(0, len(queries), self.max_batch):
            chunk = list(queries[a : a + self.max_batch])
            body = _dumps({"queries": chunk, "topk": k, "return_scores": True})
            out.extend(self._request("POST", self._path, body, functools.partial(self._hits, n=len(chunk))))
        return out

    def _hits(self, r: http.client.HTTPResponse, n: int) -> list[list[Hit]]:
        """The hits of the ``n`` queries of a successful ``/retrieve`` response, read to its end: a
        ``columns-stream`` (frames ``<byte count>\\n<columns object>\\n``, each parsed as soon as it is read),
        one ``columns`` body, or Search-R1's format from any other server. Raises
        :class:`RetrievalServerError` on a malformed reply or frame, or on an error frame (the server failed
        after its first frame); ``http.client.IncompleteRead`` (retried) on a stream cut between frames."""
        fmt = r.getheader(ROWS_REPLY_HEADER)
        if fmt == "columns-stream":  # spliced from a Sleuth passage store, in frames
            out: list[list[Hit]] = []
            while head := r.readline(32):
                size = int(head) if head.strip().isdigit() else -1
                data = r.read(size) if size >= 0 else b""
                if len(data) != size or size < 1:
                    raise RetrievalServerError(f"malformed columns-stream reply from {self.endpoint}: bad frame")
                out.extend(self._columns(data))
            if r.chunk_left is not None:  # http.client sets None at the closing chunk: the stream was cut
                raise http.client.IncompleteRead(b"")  # between frames, a broken connection (retried)
        elif fmt == "columns":
            out = self._columns(r.read())
        else:
            try:
                reply = _loads(r.read())
            except ValueError:
                reply = None
            result = reply.get("result") if isinstance(reply, dict) else None
            if not isinstance(result, list):
                raise RetrievalServerError(f"malformed reply from {self.endpoint}: expected 'result' per query")
            try:
                out = [[_hit(item) for item in hits] for hits in result]
            except (AttributeError, TypeError, ValueError) as e:
                raise RetrievalServerError(f"malformed hit in the reply from {self.endpoint}: {e}") from None
        if len(out) != n:
            raise RetrievalServerError(
                f"malformed reply from {self.endpoint}: {len(out)} results for {n} queries, expected one per query"
            )
        return out

    def _columns(self, data: bytes) -> list[list[Hit]]:
        """:func:`_column_hits` of one ``columns`` JSON object; its ``error`` is raised as
        :class:`RetrievalServerError`."""
        try:
            reply = _loads(data)
            if "error" in reply:
                raise RetrievalServerError(f"retrieval server at {self.base} failed mid-reply: {reply['error']}")
            return _column_hits(reply)
        except (KeyError, TypeError, ValueError) as e:
            raise RetrievalServerError(f"malformed columns reply from {self.endpoint}: {e!r}") from None


def _column_hits(reply: dict) -> list[list[Hit]]:
    """Hits of a ``columns`` reply (:func:`retrieval.reply.rows_to_reply`): ``reply["result"]`` the documents
    of each query (from a Sleuth passage store: ``id``, ``title``, ``contents`` strings), ``reply["scores"]``
    one float or null per document, flat, in the same order. One comprehension with the same result as
    :func:`_hit` on Search-R1's format. Raises ``KeyError``, ``TypeError`` or ``ValueError`` on another shape,
    ``ValueError`` when the number of scores is not the number of documents."""
    result, scores = reply["result"], reply["scores"]
    if type(scores) is not list or len(scores) != sum(map(len, result)):
        raise ValueError("expected one score per document in 'scores'")
    if None in scores:  # the server writes a non-finite score as JSON null
        scores = [nan if s is None else s for s in scores]
    it = iter(scores)
    return [[Hit(d["id"], d["title"] or _title(d["contents"]), d["contents"], next(it)) for d in ds] for ds in result]


def _title(contents: str) -> str:
    return contents.partition("\n")[0].strip('"')


def _hit(item: dict) -> Hit:
    doc = item.get("document", item)
    contents = doc.get("contents", "")
    if type(contents) is not str:
        contents = str(contents)
    title = doc.get("title") or _title(contents)
    score = item.get("score", 0.0)
    if score is None:  # the server writes a non-finite score as JSON null
        score = nan
    return Hit(str(doc.get("id", "")), title if type(title) is str else str(title), contents,
               score if type(score) is float else float(score))


def _message(data: bytes) -> str:
    try:
        j = _loads(data)
        return str(j.get("error") or j.get("detail") or j) if isinstance(j, dict) else str(j)[:500]
    except ValueError:
        return data[:500].decode("utf-8", "replace")
