"""Every request bound of the retrieval server (retrieval.server), on both sides, over HTTP: a request exactly at
a limit is served, one past it gets the 4xx (or 503) that names the limit. Bounds: body bytes (declared and
streamed), queries per request, query characters, ``topk`` (1 and ``max_topk``), queries x ``topk``, the
reply's estimated bytes (alone and in flight), queries pending, empty queries, and the API key."""

from __future__ import annotations

import json
import threading
import time

import httpx2
import pytest

from retrieval.base import Hit
from retrieval.server import DEFAULT_BYTES_PER_HIT, ServerLimits, create_app
from tests.test_agent_fakes import ServerThread


class Echo:
    """Answers ``k`` hits per query (ids ``q#i``); a query ``"hold"`` waits for ``gate`` first."""

    def __init__(self):
        self.gate, self.calls = threading.Event(), []

    def search(self, queries, k):
        self.calls.append((list(queries), k))
        if "hold" in queries:
            self.gate.wait(30)
        return [[Hit(f"{q}#{i}", q, q, float(k - i)) for i in range(k)] for q in queries]


LIMITS = ServerLimits(max_queries=4, max_query_chars=10, max_topk=5, max_hits=12, default_topk=2,
                      max_body_bytes=3000, max_pending_queries=8, max_reply_bytes=1 << 30)


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(Echo(), LIMITS)) as s:
        yield s


def post(url, payload, **kw):
    if not isinstance(payload, dict):  # bytes, or an iterator of chunks (sent chunked, without a length)
        return httpx2.post(url + "/retrieve", content=payload, timeout=30, **kw)
    return httpx2.post(url + "/retrieve", json=payload, timeout=30, **kw)


def ok(r, n_queries, topk):
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert len(result) == n_queries and all(len(hits) == topk for hits in result)


def refused(r, status, needle):
    assert r.status_code == status, (r.status_code, r.text)
    assert needle in r.json()["error"], r.json()["error"]


def test_topk_both_ends(server):
    ok(post(server.url, {"queries": ["a"], "topk": 1}), 1, 1)
    ok(post(server.url, {"queries": ["a"], "topk": 5}), 1, 5)  # topk == max_topk is served
    refused(post(server.url, {"queries": ["a"], "topk": 0}), 400, "'topk' must be between 1 and 5 (max_topk), got 0")
    refused(post(server.url, {"queries": ["a"], "topk": 6}), 400, "'topk' must be between 1 and 5 (max_topk), got 6")
    ok(post(server.url, {"queries": ["a"]}), 1, 2)  # default_topk
    ok(post(server.url, {"queries": ["a"], "topk": None}), 1, 2)
    refused(post(server.url, {"queries": ["a"], "topk": True}), 400, "'topk' must be an integer, got True")
    refused(post(server.url, {"queries": ["a"], "topk": 2.0}), 400, "'topk' must be an integer, got 2.0")


def test_queries_per_request_and_hits_both_sides(server):
    ok(post(server.url, {"queries": ["a", "b", "c", "d"], "topk": 3}), 4, 3)  # 4 queries, 12 hits: both at the limit
    refused(post(server.url, {"queries": ["a"] * 5, "topk": 1}), 400,
            "5 queries in one request; the limit is 4 (max_queries)")
    refused(post(server.url, {"queries": ["a", "b", "c"], "topk": 5}), 400,
            "3 queries x topk 5 = 15 hits in one request; the limit is 12 (max_hits)")
    ok(post(server.url, {"queries": [], "topk": 5}), 0, 5)
    ok(post(server.url, {"queries": "a", "topk": 1}), 1, 1)  # one query as a string


def test_query_characters_both_sides(server):
    ok(post(server.url, {"queries": ["x" * 10], "topk": 1}), 1, 1)
    refused(post(server.url, {"queries": ["a", "x" * 11], "topk": 1}), 400,
            "query 1 has 11 characters; the limit is 10 (max_query_chars)")
    refused(post(server.url, {"queries": [" \t"], "topk": 1}), 400, "query 0 is empty")
    refused(post(server.url, {"queries": ["a", 3], "topk": 1}), 400, "query 1 is int, expected a string")
    refused(post(server.url, b'{"queries": ["\\udc00"], "topk": 1}'), 400, "query 0 is not valid Unicode")
    ok(post(server.url, {"queries": ["été"], "topk": 1}), 1, 1)


def test_body_bytes_both_sides_declared_and_streamed(server):
    def body(n):  # a request of exactly n bytes
        base = json.dumps({"queries": ["a"], "topk": 1, "pad": ""}).encode()
        out = json.dumps({"queries": ["a"], "topk": 1, "pad": "x" * (n - len(base))}).encode()
        assert len(out) == n
        return out

    ok(post(server.url, body(3000)), 1, 1)
    refused(post(server.url, body(3001)), 413, "request body of 3001 bytes exceeds the size limit; the limit is 3000 (max_body_bytes)")
    at, over = body(3000), body(3001)
    ok(post(server.url, iter([at[:1000], at[1000:]])), 1, 1)  # chunked: no Content-Length
    refused(post(server.url, iter([over[:1000], over[1000:]])), 413, "the limit is 3000 (max_body_bytes)")


def test_bad_bodies(server):
    refused(post(server.url, b"{"), 400, "request body is not valid JSON")
    refused(post(server.url, b"[1]"), 400, "request body must be a JSON object with 'queries'")
    refused(post(server.url, b"[" * 1200 + b"]" * 1200), 400, "nested too deeply")
    refused(post(server.url, {"queries": {"a": 1}}), 400, "'queries' must be a list of strings")
    refused(post(server.url, {"queries": ["a"], "return_scores": 2}), 400, "'return_scores' must be a boolean")


def test_empty_queries_allowed_when_asked():
    limits = ServerLimits(allow_empty_queries=True)
    with ServerThread(create_app(Echo(), limits)) as s:
        ok(post(s.url, {"queries": ["", "a"], "topk": 1}), 2, 1)


def test_reply_bytes_alone_both_sides():
    # no passage store: 1024 estimated bytes per hit; the limit fits exactly 3 hits
    limits = ServerLimits(max_reply_bytes=3 * DEFAULT_BYTES_PER_HIT)
    with ServerThread(create_app(Echo(), limits)) as s:
        ok(post(s.url, {"queries": ["a"], "topk": 3}), 1, 3)
        refused(post(s.url, {"queries": ["a", "b"], "topk": 2}), 413,
                "the reply to 2 queries x topk 2 is estimated at 4096 bytes (1024 per hit); the limit is 3072 "
                "(max_reply_bytes)")


def _wait_for(cond, what: str, broken: str, timeout: float = 10.0) -> None:
    """Wait until ``cond()``; fail at once, naming the broken limit, if it does not hold in ``timeout`` s."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"{what} did not happen within {timeout} s: {broken}")
        time.sleep(0.01)


def test_reply_bytes_in_flight_and_queries_pending_both_sides():
    echo = Echo()
    limits = ServerLimits(max_queries=3, max_pending_queries=4, max_reply_bytes=4 * DEFAULT_BYTES_PER_HIT)
    app = create_app(echo, limits)
    out: dict[str, httpx2.Response] = {}

    def send(name, queries, topk):
        out[name] = post(s.url, {"queries": queries, "topk": topk})

    with ServerThread(app) as s:
        lead = threading.Thread(target=send, args=("lead", ["hold"], 2))  # 1 query, 2048 bytes in flight
        lead.start()
        _wait_for(lambda: echo.calls, "the held search", "the first request was not searched")
        # 2 more queries x 1 hit: 3 pending, 4096 bytes in flight: both at their limits, admitted
        second = threading.Thread(target=send, args=("second", ["a", "b"], 1))
        second.start()
        _wait_for(lambda: app.state.batcher.pending == 3 or "second" in out,
                  "the second request's admission", "")
        if "second" in out:
            pytest.fail(f"a request that takes the pending queries to max_pending_queries and the reply bytes in "
                        f"flight to max_reply_bytes, both at their limits, was refused: {out['second'].status_code} "
                        f"{out['second'].text}")
        send("bytes", ["c"], 1)  # 1024 more bytes: past max_reply_bytes
        refused(out["bytes"], 503, "server busy: replies of about 4096 bytes in flight, this one's 1024 more would "
                                   "pass the limit of 4096 (max_reply_bytes)")
        assert out["bytes"].headers["retry-after"] == "1"
        echo.gate.set()
        lead.join()
        second.join()
        ok(out["lead"], 1, 2)
        ok(out["second"], 2, 1)
        assert app.state.batcher.pending == 0
        h = httpx2.get(s.url + "/health").json()
        assert h["reply_bytes_in_flight"] == 0 and h["pending_queries"] == 0

    echo = Echo()
    app = create_app(echo, ServerLimits(max_queries=3, max_pending_queries=4))
    out.clear()
    with ServerThread(app) as s:
        lead = threading.Thread(target=send, args=("lead", ["hold", "x"], 1))  # 2 pending
        lead.start()
        _wait_for(lambda: echo.calls, "the held search", "the first request was not searched")
        second = threading.Thread(target=send, args=("second", ["a", "b"], 1))  # 4 pending: at the limit
        second.start()
        _wait_for(lambda: app.state.batcher.pending == 4 or "second" in out, "the second request's admission", "")
        if "second" in out:
            pytest.fail(f"a request taking the queries pending to max_pending_queries (4), not past it, was refused: "
                        f"{out['second'].status_code} {out['second'].text}")
        third = threading.Thread(target=send, args=("third", ["c"], 1))  # a 5th: refused at once
        third.start()
        _wait_for(lambda: "third" in out or app.state.batcher.pending > 4, "the third request's answer", "")
        if "third" not in out:
            echo.gate.set()
            pytest.fail("a request past max_pending_queries (5 queries pending, limit 4) was admitted, not refused")
        refused(out["third"], 503, "server busy: 4 queries pending, 1 more would pass the limit of 4 "
                                   "(max_pending_queries)")
        echo.gate.set()
        for t in (lead, second, third):
            t.join()
        ok(out["lead"], 2, 1)
        ok(out["second"], 2, 1)


def test_limits_must_let_a_full_request_through():
    ServerLimits(max_queries=4, max_pending_queries=4)
    with pytest.raises(ValueError, match=r"max_pending_queries \(3\) must be at least max_queries \(4\)"):
        ServerLimits(max_queries=4, max_pending_queries=3)


def test_api_key():
    with ServerThread(create_app(Echo(), api_key="k3y")) as s:
        refused(post(s.url, {"queries": ["a"]}), 401, "missing or wrong API key")
        refused(post(s.url, {"queries": ["a"]}, headers={"Authorization": "Bearer k3"}), 401, "missing or wrong")
        refused(post(s.url, {"queries": ["a"]}, headers={"Authorization": "Bearer k3yy"}), 401, "missing or wrong")
        ok(post(s.url, {"queries": ["a"]}, headers={"Authorization": "Bearer k3y"}), 1, 3)
        assert httpx2.get(s.url + "/health").json()["auth"] is True
    with ServerThread(create_app(Echo(), api_key="")) as s:  # an empty key: open
        ok(post(s.url, {"queries": ["a"]}), 1, 3)
