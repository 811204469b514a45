"""``sleuth serve-retrieval --method ...`` opens the same retrievers as ``retrieval.method``: web search (a fake
SearXNG on 127.0.0.1, its on-disk cache and rate limit kept behind the server) and an MCP server's search tool
answer ``/retrieve`` as an index does, for any client (Sleuth's, or an agent of another framework)."""

from __future__ import annotations

import time

import httpx2
import pytest
import yaml

from retrieval.client import RemoteRetriever
from tests.test_agent_fakes import ServerThread
from tests.test_mcp import http_mcp  # noqa: F401 (the fixture: the retriever's MCP server over HTTP)
from tests.test_web_search import fake  # noqa: F401 (the fixture: fake Tavily and SearXNG)


def serve_args(*argv: str):
    """The parsed ``sleuth serve-retrieval`` arguments, as ``sleuth.cli.main`` parses them."""
    from sleuth.cli import build_parser

    args, extra = build_parser().parse_known_args(["serve-retrieval", *argv])
    args.overrides = [*(args.overrides or []), *extra]
    return args


def serving(*argv: str):
    """``(ServerThread, retriever)`` of ``sleuth serve-retrieval`` with these arguments (the command's own
    :func:`make_app`; the thread stands in for uvicorn's blocking run)."""
    from sleuth.commands.serve_retrieval import make_app

    app, retriever, what = make_app(serve_args(*argv))
    return ServerThread(app), retriever, what


def web_config(tmp_path, url: str, rate_per_s: float = 0) -> str:
    path = tmp_path / "web.yaml"
    path.write_text(yaml.safe_dump({"retrieval": {"method": "web", "web_provider": "searxng", "web_url": url,
                                                  "web_cache_dir": str(tmp_path / "cache"),
                                                  "web_rate_per_s": rate_per_s}}))
    return str(path)


def test_web_search_behind_the_retrieval_server_keeps_its_cache(fake, tmp_path):  # noqa: F811
    url, mode = fake
    server, web, what = serving("--config", web_config(tmp_path, url))
    assert what == "web over searxng web search"
    with server, RemoteRetriever(server.url) as client:
        health = client.health()
        assert health["method"] == "web" and health["provider"] == "searxng" and health["reply_path"] == "hits"
        hits = client.search(["eiffel tower", "capital of france"], 3)
        assert [h.id for h in hits[0]] == [f"https://example.org/eiffel_tower/{i}" for i in range(3)]
        assert hits[1][0].title == "capital of france 0" and hits[1][0].text == "snippet 0 about capital of france"
        assert len(mode["seen"]) == 2
        again = client.search(["eiffel tower"], 3)  # from the web search's on-disk cache: no request
        assert again[0] == hits[0] and len(mode["seen"]) == 2 and web.stats["cache_hits"] == 1
        # Search-R1's own client format, as an agent of another framework sends it
        r = httpx2.post(server.url + "/retrieve", json={"queries": ["dijon"], "topk": 2, "return_scores": True})
        assert r.status_code == 200
        assert [d["document"]["id"] for d in r.json()["result"][0]] == ["https://example.org/dijon/0",
                                                                       "https://example.org/dijon/1"]
    web.close()
    # a second server over the same cache folder sends no request for what the first one fetched
    server, web, _ = serving("--config", web_config(tmp_path, url))
    with server, RemoteRetriever(server.url) as client:
        assert client.search(["eiffel tower"], 3)[0] == hits[0] and len(mode["seen"]) == 3
    web.close()


def test_web_search_behind_the_retrieval_server_keeps_its_rate_limit(fake, tmp_path):  # noqa: F811
    url, mode = fake
    server, web, _ = serving("--config", web_config(tmp_path, url, rate_per_s=10))
    with server, RemoteRetriever(server.url) as client:
        t0 = time.monotonic()
        client.search([f"q{i}" for i in range(4)], 1)
        took = time.monotonic() - t0
    web.close()
    assert len(mode["seen"]) == 4 and took >= 0.3 - 1e-3  # 4 requests at 10/s: 3 gaps of 0.1 s, server or not


def test_the_method_flag_and_overrides_choose_the_retriever(fake, tmp_path, bm25_index):  # noqa: F811
    url, _ = fake
    # --method web over a config that names bm25; the web settings as overrides
    server, web, what = serving("--method", "web", f"--index={bm25_index}", "retrieval.web_provider=searxng",
                                f"retrieval.web_url={url}", f"retrieval.web_cache_dir={tmp_path / 'c'}",
                                "retrieval.web_rate_per_s=0")
    with server, RemoteRetriever(server.url) as client:
        assert client.health()["method"] == "web" and client.search(["paris"], 1)[0][0].title == "paris 0"
    web.close()
    server, _, what = serving("--index", str(bm25_index))  # the default: retrieval.method, bm25
    with server, RemoteRetriever(server.url) as client:
        assert client.health()["method"] == "bm25" and client.search(["Dijon mustard"], 1)[0][0].id == "p4"
    assert what == "bm25 over 6 passages"
    with pytest.raises(ValueError, match="unknown retrieval method 'wbe'.*did you mean 'web'"):
        serving("--method", "wbe")
    with pytest.raises(ValueError, match="needs retrieval.mcp_server"):
        serving("--method", "mcp")


def test_an_mcp_servers_search_tool_behind_the_retrieval_server(http_mcp, retriever):  # noqa: F811
    server, mcp, what = serving("--method", "mcp", f"retrieval.mcp_server={http_mcp}")
    assert what == f"mcp over the MCP server {http_mcp}"
    try:
        with server, RemoteRetriever(server.url) as client:
            assert client.health()["mcp_server"] == http_mcp
            for query in ("Eiffel Tower designer", "capital of Germany"):
                got = client.search([query], 2)[0]
                assert [h.to_json() for h in got] == [h.to_json() for h in retriever.search([query], 2)[0]]
            # past the MCP server's own bound (k <= 5): its tool error, named, and the server keeps serving
            r = httpx2.post(server.url + "/retrieve", json={"queries": ["Dijon"], "topk": 9})
            assert r.status_code == 500 and "search failed: RuntimeError" in r.json()["error"], r.text
            assert "k must be an integer in [1, 5]" in r.json()["error"], r.text
            assert client.search(["Dijon"], 1)[0][0].id == "p4"
    finally:
        mcp.close()
