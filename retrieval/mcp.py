"""Model Context Protocol, both ways, with the official ``mcp`` SDK.

* :func:`build_server`: any Sleuth :class:`~retrieval.base.Retriever` as an MCP server with one tool,
  ``search(query, k)``, answering the top-k passages as structured content (``{"hits": [{"id", "title",
  "contents", "score"}, ...]}``) and the same as JSON text; served over stdio or streamable HTTP
  (:func:`serve`, ``sleuth serve-mcp``), so Claude Desktop, LangChain's MCP adapters or any MCP client can
  search a Sleuth index.
* :class:`MCPRetriever`: a configured MCP server's search tool as a Sleuth retriever (``retrieval.method:
  mcp``), so the built-in agent loop searches through it, behind the same query cache as the other
  retrievers. A reply with structured ``hits`` (a Sleuth server) gives those hits; any other search tool's
  text blocks become one hit each, in order (id ``mcp:<sha1 of the text>``, the first line as title).

A tool call that fails (``isError``) raises ``RuntimeError`` with the server's message, which fails only the
episode that searched (the agent loop records it); a server that cannot be reached or started raises
``ConnectionError`` (the scheduler fails the batch, the trainer retries the episodes: a service down).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pydantic import BaseModel

from retrieval.base import Hit, Retriever, check_queries


class HitModel(BaseModel):
    """One passage of a ``search`` reply."""

    id: str
    title: str
    contents: str
    score: float


class SearchResult(BaseModel):
    """The ``search`` tool's structured reply: the top-k hits, best first."""

    hits: list[HitModel]


def build_server(retriever: Retriever, default_k: int = 3, max_k: int = 50, max_query_chars: int = 4096,
                 name: str = "sleuth-search") -> Any:
    """An ``mcp.server.mcpserver.MCPServer`` with the ``search`` tool over ``retriever``. A query that is empty
    or over ``max_query_chars``, or ``k`` outside ``[1, max_k]``, is a tool error naming the limit; a retriever failure is a tool
    error too (its text stays in the server's log)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError  # its message reaches the client (others stay here)

    server = MCPServer(name, instructions="Search a text corpus (Wikipedia paragraphs) with the search tool.")

    @server.tool(name="search", description="Search the corpus; returns the top-k passages (id, title, contents, "
                                            "score), best first.")
    def search(query: str, k: int = default_k) -> SearchResult:
        if not query.strip():
            raise ToolError("the query is empty")
        if len(query) > max_query_chars:
            raise ToolError(f"the query has {len(query)} characters; the limit is {max_query_chars}")
        if isinstance(k, bool) or not 1 <= k <= max_k:
            raise ToolError(f"k must be an integer in [1, {max_k}]")
        (hits,) = retriever.search([query], k)
        return SearchResult(hits=[HitModel(**h.to_json()) for h in hits])

    return server


def serve(server: Any, transport: str = "stdio", host: str = "127.0.0.1", port: int = 8765, path: str = "/mcp",
          max_body_bytes: int = 1 << 20) -> None:
    """Run ``server`` until stopped: ``stdio`` (the client starts this process), or ``http`` (streamable HTTP at
    ``http://host:port/path``, bodies bounded by ``max_body_bytes``). Raises ``ValueError`` for another
    transport."""
    if transport == "stdio":
        server.run("stdio")
    elif transport == "http":
        server.run("streamable-http", host=host, port=port, streamable_http_path=path,
                   max_request_body_size=max_body_bytes)
    else:
        raise ValueError(f"unknown MCP transport {transport!r}; use stdio or http")


def parse_hits(result: Any, k: int) -> list[Hit]:
    """The hits of a ``tools/call`` result (``mcp_types.CallToolResult``), at most ``k``: its structured
    ``hits`` when present, else one hit per text block. Raises ``RuntimeError`` with the server's text for an
    error result, ``ValueError`` for structured hits of the wrong shape."""
    texts = [getattr(c, "text", "") for c in result.content if getattr(c, "type", None) == "text"]
    if result.is_error:
        raise RuntimeError(f"the MCP search tool failed: {' '.join(texts)[:500] or 'no message'}")
    data = result.structured_content
    if isinstance(data, dict) and "hits" in data:
        try:
            return [Hit(str(h["id"]), str(h["title"]), str(h["contents"]), float(h["score"]))
                    for h in data["hits"][:k]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the MCP search tool answered hits of the wrong shape ({type(e).__name__}: {e})") from None
    hits = []
    for i, t in enumerate(texts[:k]):
        title = t.strip().partition("\n")[0][:200]
        hits.append(Hit("mcp:" + hashlib.sha1(t.encode()).hexdigest()[:16], title, t, float(len(texts) - i)))
    return hits


class MCPRetriever:
    """:class:`~retrieval.base.Retriever` over an MCP server's search tool.

    Args:
        target: the server's streamable-HTTP URL (``http://127.0.0.1:8765/mcp``), or the command that starts a
            stdio server (a string split like a shell line, or a list), e.g. ``sleuth serve-mcp --index DIR``.
        tool: the tool's name; ``query_arg`` / ``k_arg``: its argument names (``k_arg=None``: the tool takes
            no k, and its hits are cut to k here).
        timeout_s: seconds per tool call (then ``TimeoutError``) and to connect.

    One session is held open by a background event loop for the retriever's life (:meth:`close` ends it, and
    a stdio server's process); ``search`` may be called from several threads at once (``concurrent_calls``),
    each query one tool call. Raises ``ConnectionError`` when the server cannot be reached or started.
    """

    concurrent_calls = True

    def __init__(self, target: str | list[str], tool: str = "search", query_arg: str = "query",
                 k_arg: str | None = "k", timeout_s: float = 60.0, env: dict[str, str] | None = None):
        self.target, self.tool, self.query_arg, self.k_arg, self.timeout_s = target, tool, query_arg, k_arg, timeout_s
        self.calls = 0
        self._server = self._transport(target, env)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._client: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True,
                                        name="sleuth-mcp")
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            self.close()
            why = f"{type(self._error).__name__}: {self._error}" if self._error else f"no answer in {timeout_s} s"
            raise ConnectionError(f"cannot connect to the MCP server {target!r} ({why})")
        names = {t.name for t in self._call(lambda c: c.list_tools()).tools}
        if tool not in names:
            self.close()
            raise ValueError(f"the MCP server {target!r} has no tool {tool!r} (it has: {', '.join(sorted(names))})")

    @staticmethod
    def _transport(target: str | list[str], env: dict[str, str] | None) -> Any:
        if isinstance(target, str) and target.startswith(("http://", "https://")):
            return target
        from mcp.client.stdio import StdioServerParameters

        argv = shlex.split(target) if isinstance(target, str) else list(target)
        if not argv:
            raise ValueError("the MCP server command is empty")
        return StdioServerParameters(command=argv[0], args=argv[1:], env=env)

    async def _main(self) -> None:
        from mcp import Client

        self._stop = asyncio.Event()
        try:
            async with Client(self._server, read_timeout_seconds=self.timeout_s) as client:
                self._client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the constructor, or to the next search
            self._error = e
        finally:
            self._client = None
            self._ready.set()

    def _call(self, make: Any) -> Any:
        """Run ``make(client)`` (a coroutine) on the session's loop and wait for its result."""
        client = self._client
        if client is None:
            raise ConnectionError(f"the MCP server {self.target!r} is gone ({self._error!r})")
        fut = asyncio.run_coroutine_threadsafe(make(client), self._loop)
        try:
            return fut.result(self.timeout_s + 5)
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError(f"the MCP server {self.target!r} did not answer in {self.timeout_s} s") from None

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-``k`` hits per query, one tool call each (see :class:`~retrieval.base.Retriever`). Raises as
        :func:`parse_hits`, ``TimeoutError`` and ``ConnectionError`` (see the class)."""
        check_queries(queries, k)
        out = []
        for q in queries:
            args: dict[str, Any] = {self.query_arg: q}
            if self.k_arg:
                args[self.k_arg] = k
            self.calls += 1
            out.append(parse_hits(self._call(lambda c, a=args: c.call_tool(self.tool, a)), k))
        return out

    def close(self) -> None:
        """End the session (and a stdio server's process); idempotent."""
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __repr__(self) -> str:
        return f"MCPRetriever({json.dumps(self.target) if isinstance(self.target, str) else self.target!r}, " \
               f"tool={self.tool!r})"
