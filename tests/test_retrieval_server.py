"""The Search-R1-compatible server and the httpx client: exact payload, reply shape, limits, batching."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx2
import pytest

from retrieval.base import Hit
from retrieval.client import RemoteRetriever, RetrievalServerError
from retrieval.index import build_index, load_retriever
from retrieval.server import ServerLimits, create_app

ROWS = [
    (
        "d0",
        "Big Stone Gap (film)",
        "Big Stone Gap is a 2014 romantic comedy film directed by Adriana Trigiani.",
    ),
    ("d1", "Adriana Trigiani", "Adriana Trigiani is an author and filmmaker based in Greenwich Village."),
    ("d2", "Mount Everest", "Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("d3", "Photosynthesis", "Plants convert sunlight, water and carbon dioxide into glucose."),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, app, **config):
        import uvicorn

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", **config)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.02)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def bm25(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    with open(d / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"id": i, "title": t, "contents": f"{t}\n{x}"}) + "\n" for i, t, x in ROWS)
    build_index(d / "c.jsonl", d / "index", build_dense=False, show_progress=False)
    return load_retriever(d / "index", "bm25")


@pytest.fixture(scope="module")
def server(bm25):
    limits = ServerLimits(max_queries=64, max_query_chars=1000, max_topk=100, max_hits=200)
    app = create_app(bm25, limits, info={"method": "bm25"})
    with _Server(app) as s:
        yield s


def test_search_r1_payload_and_reply(server, bm25):
    # exactly what search_r1/llm_agent/generation.py::_batch_search posts (requests.post(url, json=payload))
    payload = {
        "queries": ["highest mountain Himalayas", "who directed Big Stone Gap"],
        "topk": 3,
        "return_scores": True,
    }
    r = httpx2.post(
        server.url + "/retrieve", content=json.dumps(payload), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2 and all(1 <= len(x) <= 3 for x in result)
    top = result[0][0]
    assert set(top) == {"document", "score"} and top["document"]["id"] == "d2"
    assert top["document"]["contents"] == f"{ROWS[2][1]}\n{ROWS[2][2]}"
    assert result[1][0]["document"]["id"] == "d0"
    # what Search-R1's _passages2string does with it
    content = top["document"]["contents"]
    assert content.split("\n")[0] == "Mount Everest" and "\n".join(content.split("\n")[1:]).startswith(
        "Everest is"
    )
    # same ranking and scores as in-process
    local = bm25.search(payload["queries"], 3)
    assert [[d["document"]["id"] for d in q] for q in result] == [[h.id for h in q] for q in local]
    assert result[0][0]["score"] == pytest.approx(local[0][0].score, rel=1e-6)
    # return_scores false: bare documents, as Search-R1's server
    r = httpx2.post(server.url + "/retrieve", json={"queries": ["Everest"], "topk": 1, "return_scores": False})
    assert r.json()["result"][0][0]["id"] == "d2"
    # read as Search-R1's pydantic server reads a bool: the string "false" is false, not bool("false")
    for flag, scored in (("false", False), ("true", True), (0, False), (None, False)):
        r = httpx2.post(server.url + "/retrieve", json={"queries": ["Everest"], "topk": 1, "return_scores": flag})
        assert ("score" in r.json()["result"][0][0]) is scored, flag


@pytest.mark.parametrize(
    "payload,status,needle",
    [
        ({"queries": [""], "topk": 3}, 400, "query 0 is empty"),
        ({"queries": ["x" * (1 << 20)], "topk": 3}, 400, "max_query_chars"),
        ({"queries": ["Everest"], "topk": 0}, 400, "'topk' must be between 1 and 100"),
        ({"queries": ["Everest"], "topk": 10000}, 400, "'topk' must be between 1 and 100"),
        ({"queries": ["q"] * 65, "topk": 1}, 400, "max_queries"),
        ({"queries": ["q"] * 3, "topk": 67}, 400, "3 queries x topk 67 = 201 hits in one request; the limit is 200"),
        (b'{"queries": ["Everest", "\\ud800 x"], "topk": 1}', 400, "query 1 is not valid Unicode"),
        ({"queries": [1, 2]}, 400, "query 0 is int"),
        ({"topk": 3}, 400, "'queries' must be a list"),
        ({"queries": ["Everest"], "topk": 1, "return_scores": "maybe"}, 400, "'return_scores' must be a boolean"),
    ],
)
def test_bad_requests_get_clear_4xx_and_server_keeps_serving(server, payload, status, needle):
    r = httpx2.post(server.url + "/retrieve", **{"content" if isinstance(payload, bytes) else "json": payload})
    assert r.status_code == status and needle in r.json()["error"]
    assert httpx2.post(server.url + "/retrieve", json={"queries": ["Everest"], "topk": 1}).status_code == 200


def test_request_body_limit_with_and_without_content_length(bm25):
    """The body limit answers 413 whether the client declares the size (Content-Length) or streams it
    (chunked); the endpoint only takes POST; the server keeps serving."""
    with _Server(create_app(bm25, ServerLimits(max_body_bytes=200))) as s:
        big = json.dumps({"queries": ["Everest " * 40], "topk": 1}).encode()
        r = httpx2.post(s.url + "/retrieve", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "limit is 200 (max_body_bytes)" in r.json()["error"]
        r = httpx2.post(s.url + "/retrieve", content=iter([big[:150], big[150:]]))  # chunked: no length
        assert r.status_code == 413 and "limit is 200 (max_body_bytes)" in r.json()["error"]
        assert httpx2.get(s.url + "/retrieve").status_code == 405
        r = httpx2.post(s.url + "/retrieve", json={"queries": ["Everest"], "topk": 1})
        assert r.status_code == 200 and r.json()["result"][0][0]["id"] == "d2"


def test_not_json_and_health(server):
    r = httpx2.post(server.url + "/retrieve", content=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    h = httpx2.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["method"] == "bm25" and h["limits"]["max_topk"] == 100


def test_a_number_past_the_int_digit_limit_is_a_400(server):
    """Valid JSON whose integer has more digits than Python converts (4,300) raised a plain ValueError from
    json.loads, which the endpoint did not catch: a 500 instead of the 400 that says why."""
    body = b'{"queries": ["Everest"], "topk": ' + b"1" * 5000 + b"}"
    r = httpx2.post(server.url + "/retrieve", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"] and "digits" in r.json()["error"]
    assert httpx2.post(server.url + "/retrieve", json={"queries": ["Everest"], "topk": 1}).status_code == 200


def test_client_round_trip_and_errors(server, bm25):
    with RemoteRetriever(server.url, max_batch=2) as c:
        qs = ["Everest", "glucose sunlight", "Trigiani author", "Big Stone Gap"]
        assert [[h.id for h in q] for q in c.search(qs, 2)] == [[h.id for h in q] for q in bm25.search(qs, 2)]
        hit = c.search(["Everest"], 1)[0][0]
        assert isinstance(hit, Hit) and hit.title == "Mount Everest" and hit.text.startswith("Everest is")
        with pytest.raises(ValueError, match="topk"):
            c.search(["Everest"], 500)
    down = RemoteRetriever(f"http://127.0.0.1:{_free_port()}", retries=1, backoff=0.01, timeout=1)
    with pytest.raises(RetrievalServerError, match="sleuth serve-retrieval"):
        down.search(["x"], 1)


def test_client_replaces_kept_alive_connections_the_server_closed(bm25):
    """uvicorn closes an idle keep-alive connection after ``timeout_keep_alive`` seconds; the client's next
    request must not fail on it (no retries allowed here) and must open a new connection."""
    with _Server(create_app(bm25), timeout_keep_alive=1) as s, RemoteRetriever(s.url, retries=0) as c:
        first = c.search(["Everest"], 1)
        (conn,) = c._pool._idle
        time.sleep(1.6)
        assert c.search(["Everest"], 1) == first
        assert conn.sock is None and c._pool._idle and c._pool._idle[0] is not conn
        assert c.health()["status"] == "ok"


def test_concurrent_requests_are_batched():
    class Slow:
        def __init__(self):
            self.calls = []

        def search(self, queries, k):
            self.calls.append(len(queries))
            time.sleep(0.2)
            return [[Hit(q, q, q, 1.0)] * k for q in queries]

    slow = Slow()
    with _Server(create_app(slow)) as s:
        threads = [
            threading.Thread(
                target=lambda i=i: httpx2.post(
                    s.url + "/retrieve", json={"queries": [f"q{i}"], "topk": 2}, timeout=10
                )
            )
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        h = httpx2.get(s.url + "/health").json()
    assert h["queries"] == 8 and sum(slow.calls) == 8
    assert h["batches"] < 8 and max(slow.calls) > 1  # requests arriving together shared an index pass


def _post_together(app, url: str, rec, payloads: list[dict]) -> list[httpx2.Response]:
    """POST ``payloads`` to ``url``/retrieve so that they form one batch, whatever the machine's load: a
    lead request holds the batcher's search (``rec`` blocks on it) until every payload is queued. Returns
    the payloads' responses in order."""
    out = [None] * (len(payloads) + 1)

    def post(i, payload):
        out[i] = httpx2.post(url + "/retrieve", json=payload, timeout=30)

    lead = threading.Thread(target=post, args=(len(payloads), {"queries": ["lead"], "topk": 1}))
    lead.start()
    queue = app.state.batcher._queue
    _wait(lambda: rec.calls and rec.calls[0][0] == ["lead"], "the lead request's search")  # it holds the batcher
    threads = [threading.Thread(target=post, args=(i, p)) for i, p in enumerate(payloads)]
    for t in threads:
        t.start()
    _wait(lambda: queue.qsize() == len(payloads), f"{len(payloads)} requests queued behind the lead")
    rec.gate.set()
    for t in [lead, *threads]:
        t.join()
    assert out[-1].status_code == 200
    return out[:-1]


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    """Wait until ``cond()``; fail naming ``what`` (the state that never came) after ``timeout`` s."""
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            pytest.fail(f"{what}: not reached within {timeout} s")
        time.sleep(0.01)


class _Recorder:
    """A retriever that records each call's ``(queries, k)``, holds a search of ``"lead"`` until ``gate`` is
    set (so the requests behind it pile up into one batch), raises ``ValueError`` on the query ``"bad"`` and
    answers hits whose ids name the ``k`` they were searched with, as a search whose top hits depend on its
    depth (hybrid fusion, HNSW) would."""

    def __init__(self):
        self.calls, self.gate = [], threading.Event()

    def search(self, queries, k):
        self.calls.append((list(queries), k))
        if queries == ["lead"]:
            self.gate.wait(30)
        if "bad" in queries:
            raise ValueError("the encoder rejects 'bad'")
        return [[Hit(f"{q}@{k}#{i}", q, q, float(k - i)) for i in range(k)] for q in queries]


def test_a_bad_request_fails_only_itself_in_a_batch():
    """A request that makes the shared search fail gets its 400; the requests batched with it are searched
    again without it and answered."""
    rec = _Recorder()
    app = create_app(rec)
    with _Server(app) as s:
        payloads = [{"queries": [f"q{i}"], "topk": 1} for i in range(6)]
        payloads[3] = {"queries": ["bad"], "topk": 1}
        rs = _post_together(app, s.url, rec, payloads)
        assert rs[3].status_code == 400 and "the encoder rejects 'bad'" in rs[3].json()["error"]
        for i, r in enumerate(rs):
            if i != 3:
                assert r.status_code == 200 and r.json()["result"][0][0]["id"] == f"q{i}@1#0"
    assert sorted(rec.calls[1][0]) == sorted(p["queries"][0] for p in payloads)  # one batch, which failed
    assert sorted(qs[0] for qs, _ in rec.calls[2:]) == sorted(p["queries"][0] for p in payloads)  # each alone


def test_requests_with_different_topk_are_searched_at_their_own_depth():
    """Requests batched together but asking different ``topk`` each get the hits of a search at their own
    depth, not the first ``topk`` of a deeper search; requests of one ``topk`` still share a pass."""
    rec = _Recorder()
    app = create_app(rec)
    with _Server(app) as s:
        payloads = [{"queries": [f"q{i}"], "topk": 1 + i % 3} for i in range(6)]
        rs = _post_together(app, s.url, rec, payloads)
    for p, r in zip(payloads, rs):
        q, k = p["queries"][0], p["topk"]
        assert [d["id"] for d in r.json()["result"][0]] == [f"{q}@{k}#{i}" for i in range(k)]
    assert sorted((sorted(qs), k) for qs, k in rec.calls[1:]) == [(["q0", "q3"], 1), (["q1", "q4"], 2), (["q2", "q5"], 3)]


def test_a_retriever_answering_the_wrong_number_of_queries_is_a_500_and_server_survives():
    class Short:
        n = 0

        def search(self, queries, k):
            Short.n += 1
            return [[Hit("d", "T", "T\nx", 1.0)] for _ in queries[: len(queries) - (Short.n == 1)]]

    with _Server(create_app(Short())) as s:
        r = httpx2.post(s.url + "/retrieve", json={"queries": ["a", "b"], "topk": 1}, timeout=5)
        assert r.status_code == 500 and "answered 1 queries of 2" in r.json()["error"]
        r = httpx2.post(s.url + "/retrieve", json={"queries": ["a", "b"], "topk": 1}, timeout=5)
        assert r.status_code == 200 and len(r.json()["result"]) == 2


def test_search_error_is_500_and_server_survives():
    class Flaky:
        n = 0

        def search(self, queries, k):
            Flaky.n += 1
            if Flaky.n == 1:
                raise RuntimeError("disk on fire")
            return [[] for _ in queries]

    with _Server(create_app(Flaky())) as s:
        r = httpx2.post(s.url + "/retrieve", json={"queries": ["a"], "topk": 1})
        assert r.status_code == 500 and "disk on fire" in r.json()["error"]
        assert httpx2.post(s.url + "/retrieve", json={"queries": ["a"], "topk": 1}).json() == {"result": [[]]}
        # the client retries a 5xx and then succeeds
        assert RemoteRetriever(s.url).search(["a"], 1) == [[]]

    class Broken:
        def search(self, queries, k):
            raise RuntimeError("index corrupt")

    with _Server(create_app(Broken())) as s:  # a server that is up but always fails: not "is it running?"
        with pytest.raises(RetrievalServerError, match="HTTP 500: .*index corrupt.*it is up but failing") as e:
            RemoteRetriever(s.url, retries=1, backoff=0.01).search(["a"], 1)
        assert "is it running" not in str(e.value)


def test_reply_that_cannot_be_encoded_is_a_json_500_and_server_survives():
    class Odd:
        n = 0

        def search(self, queries, k):
            Odd.n += 1
            return [[Hit(object() if Odd.n == 1 else "d1", "T", "T\nx", 1.0)] for _ in queries]

    with _Server(create_app(Odd())) as s:
        r = httpx2.post(s.url + "/retrieve", json={"queries": ["a"], "topk": 1})
        assert r.status_code == 500 and "reply failed" in r.json()["error"]
        r = httpx2.post(s.url + "/retrieve", json={"queries": ["a"], "topk": 1})
        assert r.status_code == 200 and r.json()["result"][0][0]["id"] == "d1"


def test_row_path_reply_equals_hit_path_reply(tmp_path):
    """The raw-bytes reply (rows spliced from the passage store) is the same JSON as serialising hits,
    including unicode, a query without hits, topk above the corpus size and return_scores false."""
    import numpy as np

    from retrieval.cache import CachedRetriever
    from retrieval.server import Batcher, hits_to_result, row_source, rows_to_reply

    rows = [*ROWS, ("d4", "Zürich – Ω", 'Zürich "quoted" \\ back\\slash, naïve café 東京.')]
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"id": i, "title": t, "contents": f"{t}\n{x}"}) + "\n" for i, t, x in rows)
    build_index(tmp_path / "c.jsonl", tmp_path / "index", build_dense=False, show_progress=False)
    r = load_retriever(tmp_path / "index", "bm25")
    assert row_source(r) is not None
    assert row_source(CachedRetriever(r, 8)) is None  # the cache keeps its own search
    qs = ["Zürich café", "Everest Himalayas", "zzzunknownword", "Trigiani"]
    for k in (2, 10):
        rw, sc = r.search_rows(qs, k)
        for scores in (True, False):
            fast = json.loads(bytes(rows_to_reply(rw, sc, r.store, scores)))
            slow = hits_to_result(r.search(qs, k), scores)
            assert fast == {"result": json.loads(json.dumps(slow))}
        cols = json.loads(bytes(rows_to_reply(rw, sc, r.store, True, "columns")))
        scored = fast_scored(rw, sc, r.store)
        assert cols == {
            "result": [[x["document"] for x in q] for q in scored],
            "scores": [x["score"] for q in scored for x in q],
        }
        assert json.loads(bytes(rows_to_reply(rw, sc, r.store, False, "columns"))) == json.loads(
            bytes(rows_to_reply(rw, sc, r.store, False))
        )
    with pytest.raises(ValueError, match="reply format"):
        rows_to_reply(rw, sc, r.store, True, "xml")
    assert json.loads(bytes(rows_to_reply(rw, sc, r.store, True)))["result"][2] == []
    # empty queries on the row path: no hits, others unchanged
    search_rows, _ = Batcher(r).rows
    er, es = search_rows(["", "Everest", " "], 3)
    assert (er[0] == -1).all() and (er[2] == -1).all() and er[1][0] == r.search_rows(["Everest"], 3)[0][0][0]
    assert np.isfinite(es).all()


def fast_scored(rw, sc, store):
    from retrieval.reply import rows_to_reply

    return json.loads(bytes(rows_to_reply(rw, sc, store, True)))["result"]


def test_server_uses_row_path_for_index_retrievers(server):
    assert httpx2.get(server.url + "/health").json()["reply_path"] == "rows"


def test_reply_format_negotiation(server, bm25):
    """Search-R1's clients (no header) get Search-R1's format; Sleuth's client header gets ``columns`` with
    the same documents and scores; without scores the format stays Search-R1's (bare documents)."""
    from retrieval.base import REPLY_FORMAT_HEADER, ROWS_REPLY_HEADER

    payload = {"queries": ["highest mountain Himalayas", "Trigiani"], "topk": 2, "return_scores": True}
    plain = httpx2.post(server.url + "/retrieve", json=payload)
    cols = httpx2.post(server.url + "/retrieve", json=payload, headers={REPLY_FORMAT_HEADER: "columns"})
    assert plain.headers[ROWS_REPLY_HEADER] == "search-r1" and cols.headers[ROWS_REPLY_HEADER] == "columns"
    assert cols.json() == {
        "result": [[x["document"] for x in q] for q in plain.json()["result"]],
        "scores": [x["score"] for q in plain.json()["result"] for x in q],
    }
    for fmt in ("pairs", "xml"):  # a format the server does not know: Search-R1's
        other = httpx2.post(server.url + "/retrieve", json=payload, headers={REPLY_FORMAT_HEADER: fmt})
        assert other.headers[ROWS_REPLY_HEADER] == "search-r1" and other.content == plain.content
    bare = httpx2.post(
        server.url + "/retrieve", json={**payload, "return_scores": False}, headers={REPLY_FORMAT_HEADER: "columns"}
    )
    assert bare.headers[ROWS_REPLY_HEADER] == "search-r1"
    assert bare.json()["result"] == [[x["document"] for x in q] for q in plain.json()["result"]]
    with RemoteRetriever(server.url) as c:  # Sleuth's client asks for columns and reads them
        assert [[(h.id, h.score) for h in q] for q in c.search(payload["queries"], 2)] == [
            [(h.id, pytest.approx(h.score, rel=1e-6)) for h in q] for q in bm25.search(payload["queries"], 2)
        ]


def test_empty_query_list_on_the_row_path_keeps_the_server_serving(server):
    """``{"queries": []}`` gets an empty result, and the batcher survives it (it used to crash the batching
    loop on the row path, after which every request hung)."""
    r = httpx2.post(server.url + "/retrieve", json={"queries": [], "topk": 2, "return_scores": True}, timeout=5)
    assert r.status_code == 200 and r.json() == {"result": []}
    r = httpx2.post(server.url + "/retrieve", json={"queries": ["Everest"], "topk": 1}, timeout=5)
    assert r.status_code == 200 and r.json()["result"][0][0]["id"] == "d2"


def test_non_finite_scores_reach_the_client_as_nan():
    """The server writes a non-finite score as JSON null (orjson); the client reads it back as NaN instead of
    rejecting the reply as malformed."""
    import math

    class NaNScores:
        def search(self, queries, k):
            return [[Hit("d9", "T", "T\nbody", float("nan"))] for _ in queries]

    with _Server(create_app(NaNScores())) as s:
        r = httpx2.post(s.url + "/retrieve", json={"queries": ["a"], "topk": 1, "return_scores": True})
        assert r.json()["result"][0][0]["score"] is None
        (hit,), = RemoteRetriever(s.url).search(["a"], 1)
    assert hit.id == "d9" and math.isnan(hit.score)


def test_column_hits_fast_path_equals_general_path():
    """The client's fast path for ``columns`` replies spliced from a passage store builds the same hits as the
    general path on Search-R1's format, including an empty title (taken from the first line of contents) and a
    null (non-finite) score; another shape raises."""
    import math

    from retrieval.client import _column_hits, _hit

    result = [
        [
            {"document": {"id": "a", "title": "T", "contents": "T\nbody"}, "score": 2.5},
            {"document": {"id": "b", "title": "", "contents": '"Quoted"\nrest'}, "score": None},
        ],
        [],
        [{"document": {"id": "c", "title": "C", "contents": "C\nx"}, "score": -1.0}],
    ]
    slow = [[_hit(x) for x in hits] for hits in result]
    reply = {"result": [[x["document"] for x in q] for q in result], "scores": [x["score"] for q in result for x in q]}
    fast = _column_hits(reply)
    assert [[(h.id, h.title, h.contents) for h in q] for q in fast] == [
        [(h.id, h.title, h.contents) for h in q] for q in slow
    ]
    assert fast[0][1].title == "Quoted" and math.isnan(fast[0][1].score) and fast[0][0].score == 2.5
    assert fast[2][0].score == -1.0 and fast[1] == []
    with pytest.raises(ValueError, match="one score per document"):
        _column_hits({**reply, "scores": reply["scores"][:-1]})
    with pytest.raises(KeyError):
        _column_hits({"result": [[{"id": "a", "contents": "x"}]], "scores": [1.0]})
    with pytest.raises(KeyError):
        _column_hits({"result": reply["result"]})


async def _read_request(scope, receive) -> bool:
    """For the hand-written ASGI apps below: read an HTTP request's whole body; ``False`` for other scopes
    (lifespan), which the apps ignore."""
    if scope["type"] != "http":
        return False
    while (await receive()).get("more_body"):
        pass
    return True


def _canned_app(fmt: bytes, body: bytes):
    """An ASGI app that answers every request 200 with ``body``, its ``x-sleuth-rows-reply`` header claiming
    the reply format ``fmt``: a server whose reply is whatever the test chooses."""
    from retrieval.base import ROWS_REPLY_HEADER

    async def app(scope, receive, send):
        if not await _read_request(scope, receive):
            return
        headers = [(b"content-type", b"application/octet-stream"), (ROWS_REPLY_HEADER.encode(), fmt)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def test_client_rejects_a_malformed_columns_reply():
    """A reply that says ``columns`` but has a score missing is a clear RetrievalServerError, never hits
    with wrong scores."""
    body = json.dumps({"result": [[{"id": "a", "title": "T", "contents": "T\nb"}]], "scores": []}).encode()

    app = _canned_app(b"columns", body)
    with _Server(app) as s, pytest.raises(RetrievalServerError, match="malformed columns reply"):
        RemoteRetriever(s.url, retries=0).search(["q"], 1)


def _frames(body: bytes) -> list[dict]:
    """The objects of a ``columns-stream`` body, checking its framing (``<byte count>\\n<object>\\n``)."""
    out, at = [], 0
    while at < len(body):
        head, _, rest = body[at:].partition(b"\n")
        size = int(head)
        assert rest[size - 1 : size] == b"\n"
        out.append(json.loads(rest[:size]))
        at += len(head) + 1 + size
    return out


def test_columns_stream_frames_carry_the_columns_reply(bm25, monkeypatch):
    """``columns-stream`` splits the ``columns`` reply into frames of ``frame_docs`` documents (here 2: one
    query of top-2 per frame), in query order, with the same documents and scores; a batch that fits in one
    frame gets one ``columns`` body; Sleuth's client reads both into the in-process hits. A failure after the
    first frame ends the stream with an error frame, which the client raises; the server keeps serving."""
    from retrieval import server as server_module
    from retrieval.base import REPLY_FORMAT_HEADER, ROWS_REPLY_HEADER

    qs = ["highest mountain Himalayas", "Trigiani", "glucose sunlight"]
    payload = {"queries": qs, "topk": 2, "return_scores": True}
    with _Server(create_app(bm25, frame_docs=2)) as s:
        cols = httpx2.post(s.url + "/retrieve", json=payload, headers={REPLY_FORMAT_HEADER: "columns"}).json()
        r = httpx2.post(s.url + "/retrieve", json=payload, headers={REPLY_FORMAT_HEADER: "columns-stream"})
        assert r.status_code == 200 and r.headers[ROWS_REPLY_HEADER] == "columns-stream"
        frames = _frames(r.content)
        assert len(frames) == 3 and all(len(f["result"]) == 1 for f in frames)
        assert [d for f in frames for d in f["result"]] == cols["result"]
        assert [x for f in frames for x in f["scores"]] == cols["scores"]
        one = httpx2.post(
            s.url + "/retrieve", json={**payload, "queries": qs[:1]}, headers={REPLY_FORMAT_HEADER: "columns-stream"}
        )
        assert one.headers[ROWS_REPLY_HEADER] == "columns" and one.json()["result"] == cols["result"][:1]
        local = [[(h.id, h.title, h.contents, h.score) for h in q] for q in bm25.search(qs, 2)]
        with RemoteRetriever(s.url) as c:
            for batch in (qs, qs[:1]):
                got = [[(h.id, h.title, h.contents, h.score) for h in q] for q in c.search(batch, 2)]
                assert got == [[(*h[:3], pytest.approx(h[3], rel=1e-6)) for h in q] for q in local[: len(batch)]]

            calls = []
            real = server_module.rows_to_frame

            def fail_second(*a):
                calls.append(1)
                if len(calls) == 2:
                    raise IndexError("row 99 outside the store")
                return real(*a)

            monkeypatch.setattr(server_module, "rows_to_frame", fail_second)
            with pytest.raises(RetrievalServerError, match="failed mid-reply.*row 99 outside the store"):
                c.search(qs, 2)
            monkeypatch.setattr(server_module, "rows_to_frame", real)
            assert [[h.id for h in q] for q in c.search(qs, 2)] == [[h[0] for h in q] for q in local]


def test_client_retries_a_columns_stream_cut_between_frames():
    """A stream the server cuts off between two frames (no closing chunk) is a broken connection, which the
    client retries, not a short reply."""
    from retrieval.base import ROWS_REPLY_HEADER

    frame = b'{"result":[[{"id":"a","title":"T","contents":"T\\nb"}]],"scores":[1.0]}\n'
    calls = []

    async def app(scope, receive, send):
        if not await _read_request(scope, receive):
            return
        calls.append(1)
        headers = [(b"content-type", b"application/octet-stream"), (ROWS_REPLY_HEADER.encode(), b"columns-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"%d\n" % len(frame) + frame, "more_body": True})
        if len(calls) == 1:
            raise ConnectionResetError("cut")  # uvicorn drops the connection without the closing chunk
        await send({"type": "http.response.body", "body": b"%d\n" % len(frame) + frame, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    with _Server(app) as s:
        hits = RemoteRetriever(s.url, retries=1, backoff=0.01).search(["q1", "q2"], 1)
    assert len(calls) == 2 and [[h.id for h in q] for q in hits] == [["a"], ["a"]]


@pytest.mark.parametrize(
    "body,needle",
    [
        (b"abc\n{}\n", "bad frame"),  # not a byte count
        (b"0\n", "bad frame"),  # an empty frame
        (b'100\n{"result": []', "bad frame"),  # cut short
        (b'16\n{"result": [[]]}', "malformed columns reply"),  # no scores
        (b'28\n{"result":[[]],"scores":[]}\n' * 2, "2 results for 1 queries"),  # a result too many
    ],
)
def test_client_rejects_malformed_columns_stream(body, needle):
    """A ``columns-stream`` reply with a bad frame, an object that is not a columns reply, or the wrong number
    of results is a RetrievalServerError naming the fault, never hits that do not belong to the queries."""
    with _Server(_canned_app(b"columns-stream", body)) as s, pytest.raises(RetrievalServerError, match=needle):
        RemoteRetriever(s.url, retries=0).search(["q"], 1)


def test_search_cli_with_url_names_the_servers_method(bm25, capsys):
    """``sleuth search --url`` titled its table with --method's default ('bm25') whatever the server ran,
    and silently ignored an explicit --method; the title now names the server's method, and a --method the
    server does not run is an error."""
    from sleuth.cli import main

    with _Server(create_app(bm25, info={"method": "hybrid"})) as s:
        assert main(["search", "--url", s.url, "-k", "1", "Everest"]) == 0
        out = capsys.readouterr().out
        assert "hybrid top-1" in out and "bm25" not in out
        assert main(["search", "--url", s.url, "--method", "dense", "-k", "1", "Everest"]) == 2
        assert "hybrid" in capsys.readouterr().err
        assert main(["search", "--url", s.url, "--method", "hybrid", "-k", "1", "Everest"]) == 0


def test_search_cli_with_url_works_against_a_server_without_health(capsys):
    """Search-R1's own retrieval server has only POST /retrieve: `sleuth search --url` must not need /health."""
    from sleuth.cli import main

    async def app(scope, receive, send):
        if not await _read_request(scope, receive):
            return
        ok = scope["path"] == "/retrieve" and scope["method"] == "POST"
        body = json.dumps({"result": [[{"id": "d2", "contents": "Mount Everest\nEverest is high."}]]}).encode()
        await send({"type": "http.response.start", "status": 200 if ok else 404,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body if ok else b'{"detail": "Not Found"}'})

    with _Server(app) as s:
        assert main(["search", "--url", s.url, "-k", "1", "Everest"]) == 0
        assert "Mount Everest" in capsys.readouterr().out
        assert main(["search", "--url", s.url, "--method", "dense", "-k", "1", "Everest"]) == 0
        assert "dense top-1" in capsys.readouterr().out


def test_client_waits_what_a_busy_answers_retry_after_asks():
    """A 503 (or 429) with ``Retry-After: 0.4`` (a proxy in front of a busy server) was retried after the
    client's own backoff only (0.01 s here); the retry now waits at least what the answer asks."""
    calls = []

    async def app(scope, receive, send):
        if not await _read_request(scope, receive):
            return
        calls.append(time.monotonic())
        if len(calls) == 1:
            body = b'{"error": "busy"}'
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"0.4")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
        else:
            body = b'{"result": [[]]}'
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    with _Server(app) as s:
        assert RemoteRetriever(s.url, retries=1, backoff=0.01).search(["q"], 1) == [[]]
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.4


def test_queries_over_max_pending_get_503_with_retry_after_and_the_server_keeps_serving():
    """The batcher's queue had no bound: an overload piled up requests (and memory) without limit. Queries
    waiting or being searched beyond ``max_pending_queries`` are now refused at once with a JSON 503 and
    ``Retry-After``; the queued ones are answered and the server serves on."""
    from retrieval.server import ServerLimits

    rec = _Recorder()
    app = create_app(rec, ServerLimits(max_queries=2, max_pending_queries=3))
    with pytest.raises(ValueError, match="max_pending_queries"):
        ServerLimits(max_pending_queries=3)  # under max_queries: a full request would be refused forever
    out: dict[str, httpx2.Response] = {}

    def post(name, queries):
        out[name] = httpx2.post(s.url + "/retrieve", json={"queries": queries, "topk": 1}, timeout=30)

    with _Server(app) as s:
        lead = threading.Thread(target=post, args=("lead", ["lead"]))
        lead.start()
        _wait(lambda: rec.calls and rec.calls[0][0] == ["lead"], "the lead request's search")  # 1 query pending
        second = threading.Thread(target=post, args=("two", ["a", "b"]))
        second.start()
        # 3 pending: at the limit, still taken (a refusal answers at once: fail then, naming the limit)
        _wait(lambda: app.state.batcher.pending == 3 or "two" in out, "the second request's admission")
        if "two" in out:
            pytest.fail(f"max_pending_queries=3: a request taking the pending queries to 3 (at the limit, not past "
                        f"it) was refused: {out['two'].status_code} {out['two'].text}")
        over = threading.Thread(target=post, args=("over", ["c"]))  # a 4th query: refused without waiting
        over.start()
        _wait(lambda: "over" in out or app.state.batcher.pending > 3, "the 4th query's answer")
        if "over" not in out:
            rec.gate.set()
            pytest.fail("max_pending_queries=3: a request taking the pending queries to 4 was admitted, not refused "
                        "with 503")
        assert out["over"].status_code == 503 and out["over"].headers["retry-after"] == "1"
        assert "max_pending_queries" in out["over"].json()["error"]
        rec.gate.set()
        for t in (lead, second, over):
            t.join()
        assert out["lead"].status_code == 200 and out["two"].status_code == 200
        assert app.state.batcher.pending == 0
        post("after", ["c"])
        assert out["after"].status_code == 200
        assert httpx2.get(s.url + "/health").json()["limits"]["max_pending_queries"] == 3


def test_create_app_refuses_a_batching_wait_that_would_never_end():
    """``create_app(..., max_wait_ms=nan)`` (or inf) from the Python API started a server whose batcher slept for
    ever, so no request was ever answered (the CLI checks its flag; the API did not). It is a ValueError when
    the app is built; a negative wait too. A finite wait still serves."""
    from retrieval.server import Batcher

    class Nothing:
        def search(self, queries, k):
            return [[] for _ in queries]

    r = Nothing()
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="max_wait_ms must be a finite number >= 0"):
            create_app(r, max_wait_ms=bad)
    with pytest.raises(ValueError, match="max_batch_queries must be >= 1"):
        Batcher(r, max_batch_queries=0)
    assert Batcher(r, max_wait_ms=2.5).max_wait == 0.0025
