"""Both servers against hostile clients: deeply nested JSON, API keys (an empty one is open), warnings when
bound beyond loopback, the retrieval server's bound on reply bytes in flight, and a fuzz of malformed
bodies that must never get a 5xx or a traceback in the log."""

from __future__ import annotations

import json
import logging
import threading

import httpx2
import pytest

from retrieval.server import ServerLimits, create_app
from tests.test_retrieval_server import _Recorder, _Server, _wait

NESTED = [b"[" * 100_000 + b"]" * 100_000, b'{"queries": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
          b'{"question": ' + b'{"a":' * 30_000 + b"1" + b"}" * 30_000 + b"}"]


class LogRecords(logging.Handler):
    """Collects the records of the loggers a server writes its errors to (uvicorn's, the apps')."""

    NAMES = ("uvicorn", "uvicorn.error", "uvicorn.access", "retrieval.server", "agent.serve.app", "fastapi")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)

    def tracebacks(self) -> list[str]:
        return [self.format(r) for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def retrieval_server(tmp_path_factory):
    from corpora.formats import write_jsonl
    from retrieval.index import build_index, load_retriever
    from tests.conftest import PASSAGES

    d = tmp_path_factory.mktemp("hard")
    write_jsonl(d / "c.jsonl", PASSAGES)
    build_index(d / "c.jsonl", d / "index", build_dense=False, show_progress=False)
    app = create_app(load_retriever(d / "index", "bm25"), ServerLimits(max_queries=64, max_topk=50, max_hits=500))
    with _Server(app) as s:
        yield s


def test_deeply_nested_json_gets_a_clear_400_and_no_traceback(retrieval_server):
    """A few hundred KB of ``[[[...]]]`` (or nested ``queries``) got a plain-text 500 and a RecursionError
    traceback in the log."""
    with LogRecords() as logs:
        for body in NESTED:
            r = httpx2.post(retrieval_server.url + "/retrieve", content=body, timeout=30)
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"], r.text[:200]
    assert logs.tracebacks() == []
    assert httpx2.post(retrieval_server.url + "/retrieve", json={"queries": ["Paris"]}).status_code == 200


def test_retrieval_api_key_guards_retrieve_and_the_client_sends_it(retriever, monkeypatch):
    from retrieval.client import API_KEY_ENV, RemoteRetriever

    with _Server(create_app(retriever, api_key="s3cret")) as s:
        url, q = s.url + "/retrieve", {"queries": ["capital of France"], "topk": 1}
        assert httpx2.post(url, json=q).status_code == 401
        r = httpx2.post(url, json=q, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "API key" in r.json()["error"]
        assert httpx2.post(url, json=q, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx2.get(s.url + "/health").json()["auth"] is True  # /health stays open
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        with pytest.raises(ValueError, match=f"HTTP 401.*{API_KEY_ENV}"):
            RemoteRetriever(s.url, retries=0).search(["capital of France"], 1)
        assert RemoteRetriever(s.url, api_key="s3cret").search(["capital of France"], 1)[0][0].id == "p0"
        monkeypatch.setenv(API_KEY_ENV, "s3cret")
        assert RemoteRetriever(s.url).search(["capital of France"], 1)[0][0].id == "p0"
    with _Server(create_app(retriever, api_key="")) as s:  # empty: open
        assert httpx2.post(s.url + "/retrieve", json={"queries": ["Paris"]}).status_code == 200


def test_agent_server_with_an_empty_api_key_is_open(tiny_llm, retriever, agent_cfg):
    """`sleuth serve --api-key ""` refused every request, although an empty key is documented as open."""
    from agent.serve.app import create_app as agent_app
    from tests.test_agent_fakes import ServerThread
    from tests.test_serve import SCRIPTS, ScriptLLM

    app = agent_app(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, agent_cfg, api_key="")
    with ServerThread(app) as srv:
        r = httpx2.post(srv.url + "/ask", json={"question": "What is the capital of France?"}, timeout=30)
    assert r.status_code == 200 and r.json()["answer"] == "Paris"


@pytest.mark.parametrize("host,exposed", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("127.0.0.2", False), ("0.0.0.0", True), ("::", True),
                                          ("192.168.1.4", True), ("myhost.example", True)])
def test_loopback_hosts_are_told_apart(host, exposed):
    from sleuth.commands.common import is_loopback

    assert is_loopback(host) is not exposed


def test_both_servers_warn_when_bound_beyond_loopback(bm25_index, monkeypatch, capsys):
    import uvicorn

    import agent.backends.build
    import agent.serve.app
    import retrieval.server
    import sleuth.commands.serve
    import sleuth.commands.serve_retrieval
    import sleuth.pipeline
    from sleuth.cli import main

    seen = {}
    for mod in (sleuth.commands.serve, sleuth.commands.serve_retrieval):
        monkeypatch.setattr(mod, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(retrieval.server, "serve", lambda app, host, port: seen.__setitem__("retrieval", app))
    monkeypatch.setattr(sleuth.pipeline, "open_retriever", lambda cfg, index=None, method=None, **kw: object())
    monkeypatch.setattr(sleuth.pipeline, "resolve_model_path", lambda m: m)
    monkeypatch.setattr(sleuth.pipeline, "check_context_length", lambda cfg, model: None)
    monkeypatch.setattr(sleuth.pipeline, "answer_judge", lambda cfg: None)
    monkeypatch.setattr(agent.backends.build, "make_llm", lambda *a, **kw: object())
    monkeypatch.setattr(agent.serve.app, "create_app", lambda *a, **kw: object())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.delenv("SLEUTH_API_KEY", raising=False)
    monkeypatch.delenv("SLEUTH_RETRIEVAL_API_KEY", raising=False)
    for cmd in (["serve-retrieval", "--index", str(bm25_index)], ["serve", "--model", "m"]):
        assert main([*cmd, "--host", "0.0.0.0"]) == 0
        assert "reachable from other machines, without an API key" in capsys.readouterr().err
        assert main([*cmd, "--host", "0.0.0.0", "--api-key", "k"]) == 0
        assert "plain HTTP" in capsys.readouterr().err
        assert main(cmd) == 0
        assert "warning" not in capsys.readouterr().err
    assert main(["serve-retrieval", "--index", str(bm25_index), "--max-reply-bytes", "12345"]) == 0
    app = seen["retrieval"]
    assert app.router.routes[0].endpoint.limits.max_reply_bytes == 12345


def test_reply_bytes_in_flight_are_bounded_413_alone_503_together():
    """Requests inside the other limits (a thousand queries at a large topk) made replies of hundreds of MB,
    and three at once took the server from 0.35 to 2.4 GB. The estimated reply bytes (queries x topk x bytes
    per hit) are now bounded: a request over the bound alone gets 413 before any search, one that would take
    the requests in flight over it 503 with Retry-After, and the bytes in flight return to 0."""
    from retrieval.server import DEFAULT_BYTES_PER_HIT

    rec = _Recorder()  # no passage store: the default estimate per hit
    limit = 10 * DEFAULT_BYTES_PER_HIT
    app = create_app(rec, ServerLimits(max_queries=20, max_topk=20, max_reply_bytes=limit))
    out: dict[str, httpx2.Response] = {}

    def post(name, queries, topk):
        out[name] = httpx2.post(s.url + "/retrieve", json={"queries": queries, "topk": topk}, timeout=30)

    with _Server(app) as s:
        post("alone", ["a", "b", "c"], 4)  # 12 hits: over the bound by itself
        assert out["alone"].status_code == 413 and "max_reply_bytes" in out["alone"].json()["error"]
        assert rec.calls == []  # refused before searching
        lead = threading.Thread(target=post, args=("lead", ["lead"], 6))  # 6 hits, held in flight
        lead.start()
        _wait(lambda: rec.calls, "the lead request's search")
        assert httpx2.get(s.url + "/health").json()["reply_bytes_in_flight"] == 6 * DEFAULT_BYTES_PER_HIT
        post("over", ["x"], 5)  # 6 + 5 > 10
        assert out["over"].status_code == 503 and out["over"].headers["retry-after"] == "1"
        assert "max_reply_bytes" in out["over"].json()["error"]
        fits = threading.Thread(target=post, args=("fits", ["x"], 4))  # 6 + 4 = 10: admitted, behind the lead
        fits.start()
        _wait(lambda: app.router.routes[0].endpoint.reply_bytes == limit, "the bytes in flight at the bound")
        rec.gate.set()
        lead.join()
        fits.join()
        assert out["lead"].status_code == 200 and out["fits"].status_code == 200
        health = httpx2.get(s.url + "/health").json()
        assert health["reply_bytes_in_flight"] == 0 and health["limits"]["max_reply_bytes"] == limit


def test_the_estimate_per_hit_is_the_index_passages_mean(retriever):
    from retrieval.server import HIT_FRAME_BYTES, reply_bytes_per_hit

    offsets = retriever.store.offsets
    assert reply_bytes_per_hit(retriever) == int(offsets[-1]) // (len(offsets) - 1) + HIT_FRAME_BYTES


# -- fuzz: malformed bodies never get a 5xx or a traceback --------------------------------------------------------
HOSTILE = [None, True, False, 0, -1, 1.5, 1e308, -1e308, 10**30, "", " ", "x" * 5000, [], {}, [[]], [None], {"a": 1},
           ["a", 1], [""] * 3, "\u0000", "😀" * 10, "\u202e rtl", -(2**63), 2**64]
RAW = [b"", b" ", b"null", b"[]", b"{}", b'"str"', b"1", b"{", b"}", b'{"a":', b"\xff\xfe\x00", b"\xef\xbb\xbf{}",
       b"NaN", b'{"queries": [NaN], "topk": Infinity}', b'{"question": "\\ud800"}', b'{"question": "\\u0000?"}',
       b'{"messages": [{"role": "user", "content": "\\udfff"}]}', b"{" * 5000, b'{"a": 1, "a": 2}',
       b'{"topk": 1' + b"0" * 5000 + b"}", b"\x00" * 100, b'{"queries": ["a"], "topk": -0}', b"[" * 5000 + b"]" * 5000,
       b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}']


def _mutations(valid: dict, seed: int, count: int) -> list[bytes]:
    """``valid`` with each field set to each :data:`HOSTILE` value, then ``count`` seeded byte-level mutations
    of its JSON (bytes flipped, dropped, repeated), then :data:`RAW`."""
    import random

    out = [json.dumps({**valid, key: v}).encode() for key in valid for v in HOSTILE]
    out += [json.dumps({k: v for k, v in valid.items() if k != key}).encode() for key in valid]
    rnd, text = random.Random(seed), json.dumps(valid).encode()
    for _ in range(count):
        b = bytearray(text)
        for _ in range(rnd.randint(1, 4)):
            i = rnd.randrange(len(b))
            op = rnd.random()
            if op < 0.4:
                b[i] = rnd.randrange(256)
            elif op < 0.7:
                del b[i]
            else:
                b[i:i] = b[i : i + rnd.randint(1, 8)] * rnd.randint(1, 3)
        out.append(bytes(b))
    return out + RAW


def _fuzz(url: str, path: str, bodies: list[bytes], headers: dict | None = None) -> list[tuple[int, bytes]]:
    """POST each body; the (status, body) pairs of the answers at or above 500."""
    bad = []
    with httpx2.Client(base_url=url, timeout=60, headers=headers) as c:
        for i, body in enumerate(bodies):
            r = c.post(path, content=body, headers={"content-type": "text/plain" if i % 7 == 0 else "application/json"})
            if r.status_code >= 500:
                bad.append((r.status_code, body[:200], r.text[:200]))
            if i % 10 == 0:
                bad += [(r.status_code, b"GET", r.text[:200]) for r in [c.get(path)] if r.status_code >= 500]
    return bad


def test_fuzzed_retrieval_requests_never_get_a_5xx_or_a_traceback(retrieval_server):
    bodies = _mutations({"queries": ["capital of France", "Rhine"], "topk": 3, "return_scores": True}, 0, 150)
    with LogRecords() as logs:
        bad = _fuzz(retrieval_server.url, "/retrieve", bodies)
        bad += _fuzz(retrieval_server.url, "/retrieve", bodies[:40], {"x-sleuth-reply-format": "columns-stream"})
        bad += _fuzz(retrieval_server.url, "/nope", RAW)
    assert bad == [] and logs.tracebacks() == []
    assert httpx2.get(retrieval_server.url + "/health").json()["pending_queries"] == 0


class AnswerLLM:
    """A policy that answers every prompt at once (so every episode a valid request starts ends well)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        from agent.llm import Generation, decode, encode

        ids = encode(self.tokenizer, "<answer> Paris </answer>")[: params.max_new_tokens]
        return [Generation(ids, decode(self.tokenizer, ids), "stop") for _ in prompts]


def test_fuzzed_agent_requests_never_get_a_5xx_or_a_traceback(tiny_llm, retriever, agent_cfg):
    from agent.serve.app import create_app as agent_app
    from tests.test_agent_fakes import ServerThread

    app = agent_app(AnswerLLM(tiny_llm.tokenizer), retriever, agent_cfg, api_key="k")
    ask = {"question": "What is the capital of France?", "golden_answers": ["Paris"], "top_k": 2, "max_turns": 2}
    chat = {"model": "sleuth-agent", "messages": [{"role": "user", "content": "capital of France?"}], "n": 1,
            "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "stream": False, "top_k": 2}
    with ServerThread(app) as srv, LogRecords() as logs:
        bad = _fuzz(srv.url, "/ask", _mutations(ask, 1, 40), {"Authorization": "Bearer k"})
        bad += _fuzz(srv.url, "/v1/chat/completions", _mutations(chat, 2, 40), {"Authorization": "Bearer k"})
        bad += _fuzz(srv.url, "/v1/chat/completions", _mutations({**chat, "stream": True}, 3, 20),
                     {"Authorization": "Bearer k"})
        bad += _fuzz(srv.url, "/ask", RAW[:5], {"Authorization": b"Bearer \xed\xa0\x80\xff"})  # not UTF-8
        health = httpx2.get(srv.url + "/health").json()
    assert bad == [] and logs.tracebacks() == [], (bad[:5], logs.tracebacks()[:2])
    assert health["inflight"] == 0
