"""``sleuth serve-mcp``: any retriever (an index's, the web, a plugin's), opened as every command opens one
(:func:`sleuth.pipeline.open_retriever`), as an MCP server (``search`` tool; stdio or streamable HTTP)."""

from __future__ import annotations

import argparse

from sleuth.commands.common import (
    add_config_arguments,
    check_port_free,
    config_from_args,
    non_negative_int,
    port_number,
    positive_int,
)

HELP = "Serve an index as an MCP server with a search(query, k) tool, over stdio or streamable HTTP."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from retrieval.registry import RETRIEVERS

    add_config_arguments(p)  # the retrieval section (web_*, bm25_backend) and plugins of a config
    p.add_argument("--index", default=None, help="index directory (default: retrieval.index_dir, runs/index)")
    p.add_argument("--method", default=None,
                   help=f"the retriever: {RETRIEVERS.help()}; default: retrieval.method, bm25")
    p.add_argument("--transport", default="stdio", choices=["stdio", "http"],
                   help="stdio (the MCP client starts this command) or http (streamable HTTP at --host/--port/--path)")
    p.add_argument("--host", default="127.0.0.1", help="bind address for http (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8765, help="TCP port for http (default 8765)")
    p.add_argument("--path", default="/mcp", help="endpoint path for http (default /mcp)")
    p.add_argument("--topk", type=positive_int, default=3, help="k when a call gives none (default 3)")
    p.add_argument("--max-topk", type=positive_int, default=50, help="largest k accepted (default 50)")
    p.add_argument("--max-query-chars", type=positive_int, default=4096, help="longest query accepted")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="largest HTTP request body")
    p.add_argument("--cache-size", type=non_negative_int, default=10_000, help="LRU query cache entries (0 = off)")


def run(args: argparse.Namespace) -> int:
    import sys

    from retrieval.mcp import build_server, serve
    from retrieval.registry import RETRIEVERS
    from sleuth.pipeline import open_retriever

    if args.topk > args.max_topk:
        raise ValueError(f"--topk ({args.topk}) must not exceed --max-topk ({args.max_topk})")
    cfg = config_from_args(args)  # (plugins first: a method they register is a valid --method)
    method = args.method or cfg.retrieval.method
    RETRIEVERS.get(method)  # an unknown method before the port is taken
    index = args.index or cfg.retrieval.index_dir
    if args.transport == "http":
        check_port_free(args.host, args.port)
    retriever = open_retriever(cfg, index, method, cache_size=args.cache_size)  # the index given, never a url
    try:
        server = build_server(retriever, args.topk, args.max_topk, args.max_query_chars)
        if args.transport == "http":  # stdout belongs to the protocol on stdio
            print(f"serving MCP search over {index} ({method}) at http://{args.host}:{args.port}{args.path}")
        else:
            print(f"serving MCP search over {index} ({method}) on stdio", file=sys.stderr)
        serve(server, args.transport, args.host, args.port, args.path, args.max_body_bytes)
    finally:
        close = getattr(retriever, "close", None)
        if close is not None:  # a web search's on-disk cache, an MCP server's process
            close()
    return 0
