"""The retrieval methods (``retrieval.method``, ``--method`` of ``sleuth search``, ``serve-retrieval`` and
``serve-mcp``): a :class:`~corpora.registry.Registry` of how each retriever is opened and what it needs.

A method is one function ``open(request) -> Retriever`` registered with :func:`register_retriever`; its entry
says whether it searches an index directory (which parts: ``bm25``, ``dense``, ``lucene``), whether its
answers may be cached, and whether an LLM writes its documents. The composition root
(:func:`sleuth.pipeline.open_retriever`) is the one caller: it fills the :class:`OpenRequest`, builds a missing
index, puts a server (``retrieval.url``) in place of an index, and the query cache in front. A plugin module
(the config's ``plugins``) registers its own::

    from retrieval.registry import register_retriever

    @register_retriever("my_engine", description="my search API")
    def open_my_engine(req):
        return MyEngine(req.config.retrieval.top_k)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corpora.registry import Registry
from retrieval.base import Retriever


@dataclass
class OpenRequest:
    """What a retriever is opened from.

    ``index_dir``: the index directory to search (the config's ``retrieval.index_dir`` or a command's
    ``--index``); ``settings``: the run's retrieval section (``retrieval.*``: ``mcp_server``, ``web_*``, ...);
    ``config``: the whole run config (a plugin's own settings; the simulated engine's ``agent.simulator``);
    ``options``: keywords of :func:`retrieval.index.load_retriever` (``bm25_backend``, ``dense_model``,
    ``mmap``, ...); ``generate``: builds, when first called, the ``generate(prompts) -> texts`` callable of an
    LLM (for a method whose documents an LLM writes; ``None`` where none can be had); ``total_steps``: the
    training steps a noise curriculum runs over; ``seed``.
    """

    index_dir: Path
    settings: Any = None
    config: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    generate: Callable[[], Callable[[list[str]], list[str]]] | None = None
    total_steps: int = 1
    seed: int = 0


@dataclass(frozen=True)
class RetrieverEntry:
    """One retrieval method: ``open(request) -> Retriever``; ``index_parts``, the parts of an index
    directory it searches (empty: it searches no local index, so there is nothing to build and a retrieval
    server, ``retrieval.url``, does not stand in for it); ``cached``, whether the run's query cache may answer
    for it (not when its documents are sampled); ``generative``, whether an LLM writes its documents
    (:attr:`OpenRequest.generate`); ``description`` for help texts."""

    open: Callable[[OpenRequest], Retriever]
    index_parts: tuple[str, ...] = ()
    cached: bool = True
    generative: bool = False
    description: str = ""

    @property
    def needs_index(self) -> bool:
        return bool(self.index_parts)


RETRIEVERS: Registry[RetrieverEntry] = Registry("retrieval method", "retrieval.method")


def register_retriever(name: str, *, index_parts: tuple[str, ...] = (), cached: bool = True,
                       generative: bool = False, description: str = "", replace: bool = False):
    """Register the decorated ``open(request: OpenRequest) -> Retriever`` as retrieval method ``name``
    (see :class:`RetrieverEntry` for the flags). Raises ``ValueError`` for a name already registered, unless
    ``replace``."""

    def wrap(fn: Callable[[OpenRequest], Retriever]) -> Callable[[OpenRequest], Retriever]:
        RETRIEVERS.add(name, RetrieverEntry(fn, tuple(index_parts), cached, generative, description), replace=replace)
        return fn

    return wrap


def _index_method(method: str, parts: tuple[str, ...], description: str) -> None:
    """Register ``method`` of an index directory (:func:`retrieval.index.load_retriever`)."""

    @register_retriever(method, index_parts=parts, description=description)
    def open_index(req: OpenRequest) -> Retriever:
        from retrieval.index import load_retriever

        return load_retriever(req.index_dir, method, **req.options)


_index_method("bm25", ("bm25",), "BM25 (bm25s, Lucene scoring) over the index")
_index_method("dense", ("dense",), "dense inner-product search (FAISS) over the index")
_index_method("hybrid", ("bm25", "dense"), "BM25 and dense fused by reciprocal rank")
_index_method("lucene", ("lucene",), "Lucene BM25 (pyserini; the part `sleuth index --lucene` builds)")


@register_retriever("simulated", cached=False, generative=True,
                    description="ZeroSearch's simulated search engine: an LLM writes the documents")
def open_simulated(req: OpenRequest) -> Retriever:
    """:class:`retrieval.simulated.SimulatedSearch` over ``req.generate()``, with the noise curriculum of the
    config's ``agent.simulator`` over ``req.total_steps``. Raises ``ValueError`` without an LLM."""
    from retrieval.simulated import SimulatedSearch

    if req.generate is None:
        raise ValueError("retrieval.method=simulated needs an LLM to write its documents, and none is wired here")
    s = req.config.agent.simulator
    return SimulatedSearch(req.generate(), s.noise_start, s.noise_end, s.noise_base,
                           total_steps=max(req.total_steps, 1), seed=req.seed)


@register_retriever("self_search", cached=False, generative=True,
                    description="SSRL's self-search: the policy being trained writes the results of its own queries")
def open_self_search(req: OpenRequest) -> Retriever:
    """:class:`retrieval.simulated.SelfSearch`: bound to the rollout backend when training starts; elsewhere
    (``sleuth ask``, ``sleuth eval``) it writes with ``req.generate()``, the policy model's LLM, built on its
    first search."""
    from retrieval.simulated import SelfSearch

    return SelfSearch(req.generate, seed=req.seed)


@register_retriever("mcp", description="the search tool of an MCP server (retrieval.mcp_server)")
def open_mcp(req: OpenRequest) -> Retriever:
    """:class:`retrieval.mcp.MCPRetriever` of ``retrieval.mcp_server`` / ``mcp_tool``; ``ValueError`` without a
    server."""
    from retrieval.mcp import MCPRetriever

    s = req.settings
    if not s.mcp_server:
        raise ValueError("retrieval.method=mcp needs retrieval.mcp_server: a streamable-HTTP URL or the command "
                         "of a stdio MCP server (e.g. 'sleuth serve-mcp --index runs/index')")
    return MCPRetriever(s.mcp_server, s.mcp_tool)


@register_retriever("web", description="a web search API (retrieval.web_provider: tavily or searxng), cached on "
                                       "disk and rate-limited")
def open_web(req: OpenRequest) -> Retriever:
    """:class:`retrieval.web.WebSearch` of ``retrieval.web_provider``, ``web_url``, ``web_cache_dir`` (its on-disk
    cache) and ``web_rate_per_s`` (its rate limit)."""
    from retrieval.web import WebSearch

    s = req.settings
    return WebSearch(s.web_provider, s.web_url, s.web_cache_dir, rate_per_s=s.web_rate_per_s)
