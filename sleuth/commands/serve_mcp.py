"""``sleuth serve-mcp``: an index's retriever as an MCP server (``search`` tool; stdio or streamable HTTP)."""

from __future__ import annotations

import argparse

from sleuth.commands.common import check_port_free, non_negative_int, port_number, positive_int

HELP = "Serve an index as an MCP server with a search(query, k) tool, over stdio or streamable HTTP."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", default="runs/index", help="index directory (default: runs/index)")
    p.add_argument("--method", default="bm25", choices=["bm25", "dense", "hybrid", "lucene"], help="retriever")
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

    from retrieval.index import load_retriever
    from retrieval.mcp import build_server, serve

    if args.topk > args.max_topk:
        raise ValueError(f"--topk ({args.topk}) must not exceed --max-topk ({args.max_topk})")
    if args.transport == "http":
        check_port_free(args.host, args.port)
    retriever = load_retriever(args.index, args.method, cache_size=args.cache_size)
    server = build_server(retriever, args.topk, args.max_topk, args.max_query_chars)
    if args.transport == "http":  # stdout belongs to the protocol on stdio
        print(f"serving MCP search over {args.index} ({args.method}) at http://{args.host}:{args.port}{args.path}")
    else:
        print(f"serving MCP search over {args.index} ({args.method}) on stdio", file=sys.stderr)
    serve(server, args.transport, args.host, args.port, args.path, args.max_body_bytes)
    return 0
