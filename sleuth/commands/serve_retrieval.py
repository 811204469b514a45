"""``sleuth serve-retrieval``: a Search-R1-compatible retrieval server over an index directory."""

from __future__ import annotations

import argparse
import os

from retrieval.bm25 import BACKENDS
from retrieval.client import API_KEY_ENV
from sleuth.commands.common import (
    check_port_free,
    non_negative_int,
    non_negative_number,
    port_number,
    positive_int,
    warn_if_exposed,
)

HELP = "Serve an index over HTTP, Search-R1 compatible: POST /retrieve {queries, topk, return_scores}; GET /health."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", default="runs/index", help="index directory (default: runs/index)")
    p.add_argument("--method", default="bm25", choices=["bm25", "dense", "hybrid", "lucene"],
                   help="retriever (lucene: the part built by `sleuth index --lucene`)")
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
    p.add_argument("--bm25-backend", default="maxscore", choices=BACKENDS,
                   help="BM25 top-k: maxscore (exact, pruned; default) or bm25s's exhaustive numpy/numba")


def run(args: argparse.Namespace) -> int:
    from retrieval.index import load_retriever, read_manifest
    from retrieval.server import ServerLimits, create_app, serve

    if args.topk > args.max_topk:  # every request without a topk would be refused
        raise ValueError(f"--topk ({args.topk}) must not exceed --max-topk ({args.max_topk})")
    if args.max_pending_queries < args.max_queries:  # a full-size request would be refused forever
        raise ValueError(f"--max-pending-queries ({args.max_pending_queries}) must be at least --max-queries "
                         f"({args.max_queries})")
    limits = ServerLimits(
        max_queries=args.max_queries,
        max_query_chars=args.max_query_chars,
        max_topk=args.max_topk,
        max_hits=args.max_hits,
        default_topk=args.topk,
        allow_empty_queries=args.allow_empty_queries,
        max_body_bytes=args.max_body_bytes,
        max_pending_queries=args.max_pending_queries,
        max_reply_bytes=args.max_reply_bytes,
    )
    warn_if_exposed(args.host, args.api_key, f"--api-key or ${API_KEY_ENV}")
    check_port_free(args.host, args.port)  # before the index loads (minutes for a large one)
    retriever = load_retriever(args.index, args.method, cache_size=args.cache_size, mmap=args.mmap,
                               bm25_backend=args.bm25_backend)
    man = read_manifest(args.index)
    info = {"index": str(args.index), "method": args.method, "num_passages": man["num_passages"]}
    bm25 = getattr(retriever, "bm25", None)
    if bm25 is not None:
        info["bm25_backend"] = bm25.backend
    app = create_app(retriever, limits, info, max_wait_ms=args.max_wait_ms, api_key=args.api_key)
    print(
        f"serving {args.method} over {man['num_passages']} passages at http://{args.host}:{args.port}/retrieve"
    )
    serve(app, args.host, args.port)
    return 0
