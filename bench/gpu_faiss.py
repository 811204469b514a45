"""Benchmark: the dense index's FAISS GPU path against its CPU result -- one search of a flat index.

``--vectors`` random unit vectors of ``--dim`` dimensions (e5-base's 768 by default) go into a flat
inner-product index through :func:`retrieval.dense.build_dense_shards` (what ``sleuth index`` writes), which
:meth:`retrieval.dense.DenseIndex.load` then opens twice: on the CPU and with ``use_gpu=True`` (cloned to the
GPUs when faiss has a GPU build and sees one). The same ``--queries`` random queries are searched once on each
(top ``--k``, after one warm-up call), and the results compared: the share of identical result rows, the
top-1 agreement, the overlap of the top-k sets and the largest score difference. A GPU flat index computes the
inner products with cuBLAS, the CPU one with BLAS: the scores may differ in the last float bits, and rows whose
scores tie to those bits may swap.

Usage: ``python bench/gpu_faiss.py [--vectors 100000 --dim 768 --queries 256 --k 10] [--out PATH]``;
``--tiny`` searches 10,000 vectors of 64 dimensions (on the CPU without a faiss GPU build: the fallback path).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_tables


def unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def timed_search(index, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, float]:
    index.search_rows(q[:1], k)  # warm-up (GPU: first kernel launch and allocation)
    t0 = time.perf_counter()
    rows, scores = index.search_rows(q, k)
    return rows, scores, time.perf_counter() - t0


def run(args) -> dict:
    import faiss

    from retrieval.dense import DenseIndex, DenseIndexSpec, build_dense_shards

    out = {"faiss": faiss.__version__, "faiss_gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0,
           "vectors": args.vectors, "dim": args.dim,
           "queries": args.queries, "k": args.k, "kind": "flat"}
    emb, q = unit_rows(args.vectors, args.dim, 0), unit_rows(args.queries, args.dim, 1)
    spec = DenseIndexSpec("flat")
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        names = build_dense_shards(emb, d, spec, show_progress=False)
        out["build_s"] = round(time.perf_counter() - t0, 3)
        cpu = DenseIndex.load(d, names, spec)
        t0 = time.perf_counter()
        gpu = DenseIndex.load(d, names, spec, use_gpu=True)
        out["gpu_load_s"] = round(time.perf_counter() - t0, 3)
        out["on_gpu"] = any(gpu.on_gpu)
        rc, sc, out["cpu_search_s"] = timed_search(cpu, q, args.k)
        rg, sg, out["gpu_search_s"] = timed_search(gpu, q, args.k)
    out["rows_identical"] = float((rc == rg).all(axis=1).mean())
    out["top1_agree"] = float((rc[:, 0] == rg[:, 0]).mean())
    out["topk_overlap"] = float(np.mean([len(set(a) & set(b)) / args.k for a, b in zip(rc, rg, strict=True)]))
    out["score_max_abs_diff"] = float(np.abs(np.sort(sc, 1) - np.sort(sg, 1)).max())
    # the exact answer, in float64, for both sides
    exact = np.argmax(q.astype(np.float64) @ emb.T.astype(np.float64), axis=1)
    out["cpu_exact_top1"] = float((rc[:, 0] == exact).mean())
    out["gpu_exact_top1"] = float((rg[:, 0] == exact).mean())
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vectors", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="10,000 vectors of 64 dimensions, 32 queries")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    if args.tiny:
        args.vectors, args.dim, args.queries = 10_000, 64, 32
    if min(args.vectors, args.dim, args.queries, args.k) < 1 or args.k > args.vectors:
        p.error("--vectors, --dim, --queries and --k must be >= 1, and --k at most --vectors")
    out = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(gpu_tables.faiss_line(out))
    return out


if __name__ == "__main__":
    main()
