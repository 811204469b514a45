"""Benchmark and plan: dense indexes for wiki-18's 21M passages (Search-R1's corpus) with e5-base-v2 (768-d).

Search-R1 serves wiki-18 from one flat fp32 FAISS index on GPUs (``retrieval_launch.sh --faiss_gpu``): 21M x
768 x 4 bytes = 60 GiB, cloned onto every GPU, the memory its users run out of. This script measures, at
``--n`` passages (default 1M) on the machine it runs on, the build time, memory and search time of:

* ``flat fp32``: Sleuth's ``flat`` index (``IndexFlatIP``, exact; :func:`retrieval.dense.build_dense_shards`);
* ``flat fp16``: FAISS ``IndexScalarQuantizer`` fp16 (exact up to fp16 rounding; half the memory). Not a
  Sleuth index kind: faiss-gpu gives the same to a flat index cloned with ``useFloat16``;
* ``ivfpq``: Sleuth's ``ivfpq`` layout (``IVF{nlist},PQ{d/8}``, 8-bit codes, nprobe 32) with ``--ivf-nlist``
  lists (1,024; Sleuth's default 4 sqrt(n) would be 4,000, whose k-means takes tens of minutes on 2 cores),
  its training and adding timed apart;

and recall@k of the approximate ones against flat fp32. The vectors are synthetic (a mixture of
``--clusters`` Gaussian clusters, unit norm, fixed seed), not e5 embeddings of wiki-18: build and search times
and memory depend on N and d alone, so they carry over; IVF-PQ's recall depends on the data and is only
indicative. Then it extrapolates each to ``--target`` passages (21,015,324): memory and flat search linearly,
IVF-PQ by its cost model per Sleuth shard (``shard_size`` 10M: k-means training ~ train size x lists, adding ~
vectors x lists, search ~ nprobe x list length), and lays out GPU sharding (flat fp16 / fp32 over 1-8 GPUs:
memory per GPU, not measured here without a GPU). Encoding is estimated apart: the shipped MiniLM encoder's
passages/s on this CPU over sample passages, scaled by e5-base's FLOPs per token (8x: twice the layers, twice
the width), and a GPU figure from e5-base's FLOPs at an assumed effective rate.

Usage: ``python bench/index_plan.py [--n 1000000] [--queries 64] [--out bench/results/index_plan.json]``;
``--cpu-smoke`` runs 20,000 vectors and a few passages to check the script.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIKI18 = 21_015_324
DIM = 768  # e5-base-v2
GIB = 1024**3
E5_OVER_MINILM = (12 * 768**2) / (6 * 384**2)  # FLOPs per token: layers x width^2 (BERT-base vs MiniLM-L6)
E5_GFLOP_PER_PASSAGE = 2 * 110e6 * 160 / 1e9  # 2 x parameters x ~160 tokens of a 100-word passage
GPU_TFLOPS_ASSUMED = 100.0  # effective fp16 encoder throughput assumed for one H100 (not measured)


def synthetic(n: int, dim: int, clusters: int, points_seed: int, path: Path | None = None) -> np.ndarray:
    """``[n, dim]`` float32 unit vectors from a mixture of ``clusters`` Gaussian clusters (the same clusters
    for every call; the points drawn with ``points_seed``), memory-mapped at ``path`` when given, made in
    blocks so that memory stays at one block beside the result."""
    centers = np.random.default_rng(0).standard_normal((clusters, dim), dtype=np.float32)
    rng = np.random.default_rng(1 + points_seed)
    out = np.lib.format.open_memmap(path, "w+", np.float32, (n, dim)) if path else np.empty((n, dim), np.float32)
    for a in range(0, n, 65536):  # (the queries come from the same clusters with another points_seed)
        b = min(n, a + 65536)
        x = centers[rng.integers(0, clusters, b - a)] + 0.7 * rng.standard_normal((b - a, dim), dtype=np.float32)
        out[a:b] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def time_search(search, q: np.ndarray, k: int, repeats: int = 2) -> tuple[float, np.ndarray]:
    """Median seconds of ``search(q, k)`` over ``repeats`` (after one warm-up) and its result rows."""
    rows = search(q, k)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        search(q, k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rows


def recall(rows: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of the true top-k rows found, per query."""
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(rows, truth, strict=True)]))


def bench_flat(emb: np.ndarray, q: np.ndarray, k: int, work: Path) -> tuple[dict, np.ndarray]:
    from retrieval.dense import DenseIndex, DenseIndexSpec, build_dense_shards

    spec = DenseIndexSpec(kind="flat", shard_size=len(emb))
    t0 = time.perf_counter()
    names = build_dense_shards(emb, work, spec, show_progress=False)
    build = time.perf_counter() - t0
    idx = DenseIndex.load(work, names, spec)
    s, rows = time_search(lambda x, kk: idx.search_rows(x, kk)[0], q, k)
    size = sum((work / n).stat().st_size for n in names)
    return {"build_s": build, "bytes": size, "search_s": s, "recall": 1.0}, rows


def bench_fp16(emb: np.ndarray, q: np.ndarray, k: int, truth: np.ndarray) -> dict:
    import faiss

    idx = faiss.IndexScalarQuantizer(emb.shape[1], faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    t0 = time.perf_counter()
    for a in range(0, len(emb), 65536):
        idx.add(np.ascontiguousarray(emb[a : a + 65536]))
    build = time.perf_counter() - t0
    s, rows = time_search(lambda x, kk: idx.search(x, kk)[1], q, k)
    return {"build_s": build, "bytes": idx.sa_code_size() * idx.ntotal, "search_s": s, "recall": recall(rows, truth)}


def bench_ivfpq(emb: np.ndarray, q: np.ndarray, k: int, truth: np.ndarray, nlist: int, nprobe: int) -> dict:
    """Sleuth's ``ivfpq`` layout (``IVF{nlist},PQ{d/8}``, 8-bit codes, no polysemous training) with ``nlist``
    lists trained on 39 points per list, its k-means and its adding timed apart for the cost model."""
    import faiss

    m = emb.shape[1] // 8
    idx = faiss.index_factory(emb.shape[1], f"IVF{nlist},PQ{m}", faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(idx))
    ivf.do_polysemous_training = False
    train_size = min(len(emb), 39 * nlist)
    take = np.sort(np.random.default_rng(0).choice(len(emb), size=train_size, replace=False))
    t0 = time.perf_counter()
    idx.train(np.ascontiguousarray(emb[take]))
    train = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in range(0, len(emb), 65536):
        idx.add(np.ascontiguousarray(emb[a : a + 65536]))
    add = time.perf_counter() - t0
    ivf.nprobe = nprobe
    s, rows = time_search(lambda x, kk: idx.search(x, kk)[1], q, k)
    size = idx.sa_code_size() * idx.ntotal + 8 * idx.ntotal + nlist * emb.shape[1] * 4  # codes, ids, centroids
    return {"build_s": train + add, "train_s": train, "add_s": add, "bytes": size, "search_s": s,
            "recall": recall(rows, truth), "nlist": nlist, "train_size": train_size, "nprobe": nprobe, "pq_m": m}


def encode_rate(n_passages: int) -> dict:
    """Passages/s of the shipped MiniLM encoder on this CPU over ``n_passages`` sample passages."""
    from corpora import read_corpus
    from corpora.sample import sample_paths
    from retrieval.encoder import Encoder

    texts = [p.contents for p in read_corpus(sample_paths()["corpus"])[:n_passages]]
    enc = Encoder(device="cpu")
    enc.encode_passages(texts[:32])
    t0 = time.perf_counter()
    enc.encode_passages(texts, batch_size=64)
    dt = time.perf_counter() - t0
    return {"model": enc.name, "passages": len(texts), "passages_per_s": len(texts) / dt}


def extrapolate(res: dict, n: int, target: int, k: int, queries: int) -> dict:
    """Each index at ``target`` passages from its measurement at ``n`` (see the module docstring)."""
    from retrieval.dense import DenseIndexSpec, ivf_nlist, ivf_train_size, shard_bounds

    f = target / n
    out = {}
    for name in ("flat_fp32", "flat_fp16"):
        r = res[name]
        out[name] = {"gib": r["bytes"] * f / GIB, "build_s": r["build_s"] * f,
                     "ms_per_query": 1e3 * r["search_s"] * f / queries}
    iv = res["ivfpq"]
    spec = DenseIndexSpec(kind="ivfpq")  # Sleuth's defaults: shards of at most 10M vectors, 4 sqrt(n) lists
    shards = [b - a for a, b in shard_bounds(target, spec.shard_size)]
    m = DIM // 8
    # k-means ~ training points x lists; adding ~ vectors x (lists + 256 PQ centroids); a query ~ the coarse
    # search over the lists (at the flat index's measured rate) + the codes of nprobe lists (the rest of the
    # measured time, per code)
    train = iv["train_s"] * sum(ivf_train_size(spec, s) * ivf_nlist(spec, s) for s in shards) / (
        iv["train_size"] * iv["nlist"])
    add = iv["add_s"] * sum(s * (ivf_nlist(spec, s) + 256) for s in shards) / (n * (iv["nlist"] + 256))
    flat_s_per_flop = res["flat_fp32"]["search_s"] / (queries * n * DIM)
    coarse = flat_s_per_flop * iv["nlist"] * DIM
    per_code = max(iv["search_s"] / queries - coarse, 0.0) / (iv["nprobe"] * n / iv["nlist"])
    query = sum(flat_s_per_flop * ivf_nlist(spec, s) * DIM + per_code * spec.nprobe * s / ivf_nlist(spec, s)
                for s in shards)
    out["ivfpq"] = {"gib": (target * (m + 8) + sum(ivf_nlist(spec, s) for s in shards) * DIM * 4) / GIB,
                    "build_s": train + add, "train_s": train, "add_s": add, "ms_per_query": 1e3 * query,
                    "shards": len(shards), "nlist_per_shard": ivf_nlist(spec, shards[0]), "nprobe": spec.nprobe}
    out["gpu_sharded"] = {f"{g} GPU{'s' if g > 1 else ''}": {"fp16_gib_per_gpu": target * DIM * 2 / g / GIB,
                                                            "fp32_gib_per_gpu": target * DIM * 4 / g / GIB}
                          for g in (1, 2, 4, 8)}
    return out


def encoding_estimate(rate: dict, target: int) -> dict:
    e5_cpu = rate["passages_per_s"] / E5_OVER_MINILM
    gpu_s = target * E5_GFLOP_PER_PASSAGE / (GPU_TFLOPS_ASSUMED * 1e3)
    return {"minilm_cpu_passages_per_s": rate["passages_per_s"], "e5_cpu_passages_per_s_est": e5_cpu,
            "e5_cpu_hours_est": target / e5_cpu / 3600, "e5_gpu_hours_est": gpu_s / 3600,
            "gpu_assumption": f"{E5_GFLOP_PER_PASSAGE:.0f} GFLOP per passage at {GPU_TFLOPS_ASSUMED:.0f} TFLOP/s"}


def print_table(out: dict) -> None:
    m, x = out["measured"], out["extrapolated"]
    n, t = out["n"], out["target"]
    print(f"\n{out['date']}, {out['machine']}, faiss {out['faiss']}, {out['threads']} threads; synthetic {out['dim']}-d "
          f"vectors; search: {out['queries']} queries, top-{out['k']}")
    print(f"| index | build s ({n:,}) | GiB ({n:,}) | ms/query ({n:,}) | recall@{out['k']} | GiB ({t:,}) | "
          f"build ({t:,}) | ms/query ({t:,}) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("flat_fp32", "flat_fp16", "ivfpq"):
        r, e = m[name], x[name]
        build = f"{e['build_s'] / 60:.1f} min"
        print(f"| {name} | {r['build_s']:.1f} | {r['bytes'] / GIB:.2f} | {1e3 * r['search_s'] / out['queries']:.1f} "
              f"| {r['recall']:.3f} | {e['gib']:.1f} | {build} | {e['ms_per_query']:.0f} |")
    for g, v in x["gpu_sharded"].items():
        print(f"GPU-sharded flat over {g}: {v['fp16_gib_per_gpu']:.1f} GiB per GPU in fp16, "
              f"{v['fp32_gib_per_gpu']:.1f} in fp32")
    if "encoding" in out:
        e = out["encoding"]
        print(f"encoding {t:,} passages with e5-base-v2: ~{e['e5_cpu_hours_est']:.0f} h on this CPU "
              f"(MiniLM measured {e['minilm_cpu_passages_per_s']:.0f} passages/s, / {E5_OVER_MINILM:.0f}); "
              f"~{e['e5_gpu_hours_est']:.1f} h on one GPU ({e['gpu_assumption']}, assumed)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="passages (vectors) measured")
    p.add_argument("--target", type=int, default=WIKI18, help="passages extrapolated to (wiki-18)")
    p.add_argument("--queries", type=int, default=64, help="queries per search call")
    p.add_argument("--k", type=int, default=3, help="top-k (Search-R1: 3)")
    p.add_argument("--clusters", type=int, default=4096, help="Gaussian clusters of the synthetic vectors")
    p.add_argument("--ivf-nlist", type=int, default=1024, help="IVF lists of the measured IVF-PQ index")
    p.add_argument("--nprobe", type=int, default=32, help="IVF lists searched per query (Sleuth's default)")
    p.add_argument("--encode-passages", type=int, default=256, help="sample passages timed for encoding (0: skip)")
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_index_plan"), help="scratch folder (removed)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "index_plan.json"))
    p.add_argument("--cpu-smoke", action="store_true", help="20,000 vectors, 64 passages: check the script")
    args = p.parse_args(argv)
    for name in ("n", "target", "queries", "k", "clusters", "ivf_nlist", "nprobe"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.encode_passages < 0:
        p.error("--encode-passages must be >= 0")
    if args.cpu_smoke:
        args.n, args.clusters, args.ivf_nlist = 20_000, 64, 64
        args.encode_passages = min(args.encode_passages, 64)
    if 39 * args.ivf_nlist > args.n or 256 > args.n:
        p.error("--n must hold 39 training points per IVF list and 256 per PQ centroid")
    return args


def main(argv: list[str] | None = None) -> dict:
    import faiss

    args = parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "flat").mkdir(parents=True)
    out = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "argv": sys.argv[1:] if argv is None
           else list(argv), "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "faiss": faiss.__version__,
           "threads": faiss.omp_get_max_threads(), "n": args.n, "target": args.target, "dim": DIM,
           "queries": args.queries, "k": args.k, "synthetic": {"clusters": args.clusters, "seed": 0}, "measured": {}}
    try:
        emb = synthetic(args.n, DIM, args.clusters, 0, work / "emb.npy")
        q = synthetic(args.queries, DIM, args.clusters, 1)  # the same clusters, other points
        out["measured"]["flat_fp32"], truth = bench_flat(emb, q, args.k, work / "flat")
        shutil.rmtree(work / "flat")
        out["measured"]["flat_fp16"] = bench_fp16(emb, q, args.k, truth)
        out["measured"]["ivfpq"] = bench_ivfpq(emb, q, args.k, truth, args.ivf_nlist, args.nprobe)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["extrapolated"] = extrapolate(out["measured"], args.n, args.target, args.k, args.queries)
    if args.encode_passages:
        out["encoding"] = encoding_estimate(encode_rate(args.encode_passages), args.target)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print_table(out)
    return out


if __name__ == "__main__":
    main()
