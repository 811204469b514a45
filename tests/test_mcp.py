"""MCP both ways: the retriever served as an MCP server answers the official ``mcp`` client over stdio (the
``sleuth serve-mcp`` command) and streamable HTTP; the built-in agent loop searches through an MCP server's
search tool, behind the same query cache as the other retrievers."""

from __future__ import annotations

import asyncio
import sys

import pytest

from corpora.formats import QAExample
from tests.test_agent_fakes import ServerThread


@pytest.fixture()
def http_mcp(retriever):
    """The retriever's MCP server over streamable HTTP on 127.0.0.1 (in-process, a thread); yields its URL."""
    from retrieval.mcp import build_server

    app = build_server(retriever, default_k=2, max_k=5).streamable_http_app(streamable_http_path="/mcp")
    with ServerThread(app) as server:
        yield server.url + "/mcp"


def stdio_command(index) -> list[str]:
    return [sys.executable, "-m", "sleuth.cli", "serve-mcp", "--index", str(index), "--topk", "2"]


async def ask(server, query: str, k: int | None = None):
    from mcp import Client

    async with Client(server) as client:
        tools = (await client.list_tools()).tools
        args = {"query": query} if k is None else {"query": query, "k": k}
        return tools, await client.call_tool("search", args)


def check_reply(tools, result, retriever, query: str, k: int) -> None:
    (tool,) = tools
    assert tool.name == "search" and set(tool.input_schema["properties"]) == {"query", "k"}
    assert not result.is_error
    want = [h.to_json() for h in retriever.search([query], k)[0]]
    assert result.structured_content == {"hits": want}
    assert want[0]["id"] in result.content[0].text  # the same as text, for clients that read text only


def test_stdio_server_answers_the_mcp_client(bm25_index, retriever):
    from mcp.client.stdio import StdioServerParameters

    cmd = stdio_command(bm25_index)
    params = StdioServerParameters(command=cmd[0], args=cmd[1:])
    tools, result = asyncio.run(ask(params, "Eiffel Tower designer"))
    check_reply(tools, result, retriever, "Eiffel Tower designer", 2)  # --topk 2 when the call gives no k


def test_http_server_answers_the_mcp_client_and_refuses_bad_arguments(http_mcp, retriever):
    tools, result = asyncio.run(ask(http_mcp, "capital of Germany", k=3))
    check_reply(tools, result, retriever, "capital of Germany", 3)
    _, bad = asyncio.run(ask(http_mcp, "capital", k=9))
    assert bad.is_error and "k must be an integer in [1, 5]" in bad.content[0].text
    _, empty = asyncio.run(ask(http_mcp, "   "))
    assert empty.is_error and "the query is empty" in empty.content[0].text


def test_mcp_retriever_over_stdio_and_http(bm25_index, retriever, http_mcp):
    from retrieval.mcp import MCPRetriever

    queries = ["capital of France", "river Germany"]
    for target in (http_mcp, stdio_command(bm25_index)):
        r = MCPRetriever(target)
        try:
            assert r.search(queries, 2) == retriever.search(queries, 2)
            with pytest.raises(RuntimeError, match=r"MCP search tool failed.*k must be"):
                r.search(["x"], 60)  # over both servers' max k (5 here, 50 by default)
        finally:
            r.close()
    with pytest.raises(ValueError, match="has no tool 'lookup'.*search"):
        MCPRetriever(http_mcp, tool="lookup")
    with pytest.raises(ConnectionError, match="cannot connect to the MCP server"):
        MCPRetriever("http://127.0.0.1:9/mcp", timeout_s=5)


def test_a_plain_text_search_tool_gives_one_hit_per_text_block():
    """Another MCP server's search tool (text blocks, no structured hits) still gives hits, in order."""
    from mcp.server.mcpserver import MCPServer

    from retrieval.mcp import MCPRetriever

    server = MCPServer("other")

    @server.tool(name="web_search", structured_output=False)
    def web_search(q: str) -> list[str]:
        return [f"Result {i} for {q}\nbody {i}" for i in range(4)]

    with ServerThread(server.streamable_http_app(streamable_http_path="/mcp")) as s:
        r = MCPRetriever(s.url + "/mcp", tool="web_search", query_arg="q", k_arg=None)
        try:
            (hits,) = r.search(["dijon"], 3)
        finally:
            r.close()
    assert [h.title for h in hits] == [f"Result {i} for dijon" for i in range(3)]
    assert hits[0].text == "body 0" and hits[0].id.startswith("mcp:") and hits[0].score > hits[1].score


def test_the_built_in_loop_searches_through_an_mcp_server_behind_the_query_cache(http_mcp, tiny_llm, retriever,
                                                                                 agent_cfg, tmp_path):
    from agent.loop.batch import run_episodes
    from sleuth.config import Config
    from sleuth.pipeline import open_retriever
    from tests.test_agent_fakes import ScriptLLM

    cfg = Config.model_validate({"retrieval": {"method": "mcp", "mcp_server": http_mcp, "cache_size": 100}})
    mcp = open_retriever(cfg)
    try:
        assert type(mcp).__name__ == "CachedRetriever"
        script = {"France": ["<search> capital of France </search>", "<answer> Paris </answer>"]}
        examples = [QAExample("q0", "What is the capital of France?", ["Paris"])] * 2
        got = run_episodes(examples, ScriptLLM(tiny_llm.tokenizer, script), mcp, agent_cfg, top_k=2)
        want = run_episodes(examples, ScriptLLM(tiny_llm.tokenizer, script), retriever, agent_cfg, top_k=2)
        assert [t.retrieved_ids for t in got] == [t.retrieved_ids for t in want] == [["p0", "p1"]] * 2
        assert [t.token_ids for t in got] == [t.token_ids for t in want] and all(t.reward == 1.0 for t in got)
        assert mcp.inner.calls == 1  # the second episode's identical search came from the cache
    finally:
        mcp.inner.close()
    with pytest.raises(ValueError, match="needs retrieval.mcp_server"):
        open_retriever(Config.model_validate({"retrieval": {"method": "mcp"}}))
