"""``sleuth search``: print the ranked hits of a query from any retriever (an index, a retrieval server, the web,
an MCP server, a plugin's), opened as every command opens one (:func:`sleuth.pipeline.open_retriever`)."""

from __future__ import annotations

import argparse

HELP = "Search an index (or any retriever): print the top-k passages of a query with their scores."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from retrieval.registry import RETRIEVERS

    p.add_argument("query", nargs="+", help="the query (several arguments are joined by spaces)")
    p.add_argument("-k", type=int, default=5, help="number of hits (default 5)")
    p.add_argument("--config", "-c", default=None,
                   help="YAML config whose retrieval section (and plugins) to use (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override, e.g. --set retrieval.web_provider=searxng (repeatable)")
    p.add_argument("--index", default=None, help="index directory (default: retrieval.index_dir, runs/index)")
    p.add_argument("--method", default=None,
                   help=f"the retriever: {RETRIEVERS.help()}; default: retrieval.method, bm25 (lucene: the part "
                        "built by `sleuth index --lucene`; with --url the server's own, set by `serve-retrieval "
                        "--method`)")
    p.add_argument("--url", default=None, help="query a running `sleuth serve-retrieval` instead of an index")
    p.add_argument("--chars", type=int, default=160, help="characters of each passage to show")
    p.add_argument("--json", action="store_true", help="print hits as JSON lines")


def run(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from sleuth.commands.common import config_from_args
    from sleuth.pipeline import open_retriever

    query = " ".join(args.query)
    if not query.strip():
        raise ValueError("empty query")
    if args.k < 1:
        raise ValueError(f"-k must be >= 1, got {args.k}")
    cfg = config_from_args(args)  # (plugins first: a method they register is a valid --method)
    if args.url:
        cfg.retrieval.url = args.url
    if args.url or (cfg.retrieval.url and args.index is None):
        retriever = open_retriever(cfg, cache_size=0)
        try:  # Sleuth's server names its method; Search-R1's has no /health
            health = retriever.health()
            method = health.get("method") if isinstance(health, dict) else None
        except ValueError:
            method = None
        if method is None:
            method = args.method or "server"
        elif args.method and args.method != method:
            raise ValueError(f"--method {args.method}: the server at {cfg.retrieval.url} searches with {method} "
                             "(set by `sleuth serve-retrieval --method`)")
    else:
        method = args.method or cfg.retrieval.method
        retriever = open_retriever(cfg, args.index or cfg.retrieval.index_dir, method, cache_size=0)
    try:
        hits = retriever.search([query], args.k)[0]
    finally:
        close = getattr(retriever, "close", None)
        if close is not None:  # a web search's cache, an MCP server's process, a server's connections
            close()
    if args.json:
        for h in hits:
            print(json.dumps(h.to_json(), ensure_ascii=False))
        return 0
    table = Table(title=f"{method} top-{args.k}: {query}", show_lines=False)
    table.add_column("#", justify="right")
    table.add_column("score", justify="right")
    table.add_column("id")
    table.add_column("title")
    table.add_column("text")
    for i, h in enumerate(hits, 1):
        text = h.text.replace("\n", " ")
        table.add_row(
            str(i),
            f"{h.score:.4f}",
            h.id,
            h.title,
            text[: args.chars] + ("…" if len(text) > args.chars else ""),
        )
    Console().print(table)
    if not hits:
        print("no hits")
    return 0
