"""``sleuth serve-retrieval``: a Search-R1-compatible retrieval server over any retriever ``retrieval.method`` can
name (an index directory's BM25, dense, hybrid or Lucene part, a web search API with its on-disk cache and rate
limit, an MCP server's search tool, a plugin's), opened as every command opens one
(:func:`sleuth.pipeline.open_retriever`), so an agent of any framework calling ``/retrieve`` gets them."""

from __future__ import annotations

import argparse
import os

from retrieval.bm25 import BACKENDS
from retrieval.client import API_KEY_ENV
from sleuth.commands.common import (
    add_config_arguments,
    check_port_free,
    config_from_args,
    non_negative_int,
    non_negative_number,
    port_number,
    positive_int,
    warn_if_exposed,
)

HELP = ("Serve an index (or the web, an MCP server, any retriever) over HTTP, Search-R1 compatible: POST /retrieve "
        "{queries, topk, return_scores}; GET /health.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from retrieval.registry import RETRIEVERS

    add_config_arguments(p)  # the retrieval section (web_*, mcp_*) and plugins of a config
    p.add_argument("--index", default=None, help="index directory (default: retrieval.index_dir, runs/index)")
    p.add_argument("--method", default=None,
                   help=f"the retriever: {RETRIEVERS.help()}; default: retrieval.method, bm25 (lucene: the part "
                        "built by `sleuth index --lucene`; web: retrieval.web_provider, web_url, its cache in "
                        "web_cache_dir and rate limit web_rate_per_s; mcp: retrieval.mcp_server)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000)")
    p.add_argument("--topk", type=positive_int, default=3, help="topk when a request gives none (Search-R1: 3)")
    p.add_argument("--max-topk", type=positive_int, default=1000, help="largest topk accepted")
    p.add_argument("--max-queries", type=positive_int, default=4096, help="most queries in one request")
    p.add_argument("--max-hits", type=positive_int, default=1 << 20,
                   help="most hits (queries x topk) in one request; bounds the reply's size")
    p.add_argument("--max-query-chars", type=positive_int, default=4096, help="longest query accepted, in characters")
    p.add_argument(
        "--allow-empty-queries",
        action="store_true",
        help="answer an empty query with no hits instead of HTTP 400",
    )
    p.add_argument("--max-body-bytes", type=positive_int, default=16 << 20,
                   help="largest request body accepted, in bytes (default 16 MiB; above: HTTP 413)")
    p.add_argument("--max-pending-queries", type=positive_int, default=1 << 16,
                   help="most queries waiting or being searched, over all requests (default 65536; a request "
                        "past it: HTTP 503 with Retry-After); at least --max-queries")
    p.add_argument("--max-reply-bytes", type=positive_int, default=1 << 30,
                   help="most estimated reply bytes (queries x topk x the index's mean bytes per hit) of all requests "
                        "being searched or answered (default 1 GiB); a request over it alone: HTTP 413; one that "
                        "would pass it: HTTP 503 with Retry-After")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /retrieve (default: ${API_KEY_ENV}, which Sleuth's "
                        "client sends too; unset or empty: no key, open)")
    p.add_argument("--cache-size", type=non_negative_int, default=0, help="LRU query cache entries (0 = off)")
    p.add_argument("--max-wait-ms", type=non_negative_number, default=0.0,
                   help="extra wait to gather a batch, in milliseconds (a finite number >= 0; default 0)")
    p.add_argument("--mmap", action="store_true", help="memory-map the index instead of loading it")
    p.add_argument("--bm25-backend", default=None, choices=BACKENDS,
                   help="BM25 top-k: maxscore (exact, pruned) or bm25s's exhaustive numpy/numba (default: "
                        "retrieval.bm25_backend, maxscore)")


def run(args: argparse.Namespace) -> int:
    from retrieval.server import serve

    server_limits(args)
    _choice(args)  # a bad limit or an unknown method before the port is taken
    warn_if_exposed(args.host, args.api_key, f"--api-key or ${API_KEY_ENV}")
    check_port_free(args.host, args.port)  # before the index loads (minutes for a large one)
    app, retriever, what = make_app(args)
    try:
        print(f"serving {what} at http://{args.host}:{args.port}/retrieve")
        serve(app, args.host, args.port)
    finally:
        close = getattr(retriever, "close", None)
        if close is not None:  # a web search's on-disk cache, an MCP server's process
            close()
    return 0


def make_app(args: argparse.Namespace):
    """``(app, retriever, what)``: the server's app over the retriever the arguments and config name, opened
    by :func:`sleuth.pipeline.open_retriever` (the index given, never ``retrieval.url``: this server is what a
    client's url names), and what it serves in words. The caller serves the app and closes the retriever."""
    from retrieval.server import create_app
    from sleuth.pipeline import open_retriever

    limits = server_limits(args)
    cfg, method, entry, index = _choice(args)
    retriever = open_retriever(cfg, index, method, cache_size=args.cache_size, mmap=args.mmap)
    info, what = _info(retriever, method, entry, index)
    app = create_app(retriever, limits, info, max_wait_ms=args.max_wait_ms, api_key=args.api_key)
    return app, retriever, f"{method} over {what}"


def server_limits(args: argparse.Namespace):
    """The :class:`retrieval.server.ServerLimits` of the arguments; ``ValueError`` for limits that refuse
    every request."""
    from retrieval.server import ServerLimits

    if args.topk > args.max_topk:  # every request without a topk would be refused
        raise ValueError(f"--topk ({args.topk}) must not exceed --max-topk ({args.max_topk})")
    if args.max_pending_queries < args.max_queries:  # a full-size request would be refused forever
        raise ValueError(f"--max-pending-queries ({args.max_pending_queries}) must be at least --max-queries "
                         f"({args.max_queries})")
    return ServerLimits(max_queries=args.max_queries, max_query_chars=args.max_query_chars, max_topk=args.max_topk,
                        max_hits=args.max_hits, default_topk=args.topk, allow_empty_queries=args.allow_empty_queries,
                        max_body_bytes=args.max_body_bytes, max_pending_queries=args.max_pending_queries,
                        max_reply_bytes=args.max_reply_bytes)


def _choice(args: argparse.Namespace):
    """``(config, method, its registry entry, index directory)`` of the arguments (plugins imported first, so
    a method they register is a valid ``--method``)."""
    from retrieval.registry import RETRIEVERS

    cfg = config_from_args(args)
    method = args.method or cfg.retrieval.method
    entry = RETRIEVERS.get(method)
    if args.bm25_backend:
        cfg.retrieval.bm25_backend = args.bm25_backend
    return cfg, method, entry, args.index or cfg.retrieval.index_dir


def _info(retriever, method: str, entry, index: str) -> tuple[dict, str]:
    """``/health``'s description of what is served, and the same in words for the start-up line: the index and
    its passages for an index method, the provider for web search, the server for MCP."""
    from retrieval.index import read_manifest

    info: dict = {"method": method}
    if entry.needs_index:
        man = read_manifest(index)
        info |= {"index": str(index), "num_passages": man["num_passages"]}
        bm25 = getattr(retriever, "bm25", None)
        if bm25 is not None:
            info["bm25_backend"] = bm25.backend
        return info, f"{man['num_passages']} passages"
    # (a query cache in front hands these attributes on)
    provider, target = getattr(retriever, "provider", None), getattr(retriever, "target", None)
    if provider is not None:
        info["provider"] = provider
        return info, f"{provider} web search"
    if target is not None:
        info["mcp_server"] = str(target)
        return info, f"the MCP server {target}"
    return info, f"the {method} retriever"
