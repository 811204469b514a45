"""Retrieval benchmark: quality on HotpotQA and speed on synthetic corpora, against pyserini when installed.

Quality: recall@1/5/10 of the supporting paragraphs (fraction of each question's supporting ids in the
top k, averaged) for the 400 HotpotQA dev questions of the shipped sample (train + test) over their pooled
corpus, for BM25, dense (MiniLM) and hybrid RRF; top-10 overlap of our BM25 with pyserini's BM25 (same
k1=0.9, b=0.4) when the ``lucene`` extra is installed.

Speed: queries/s and p50/p99 latency at batch 1 and batch 256, in-process and through the HTTP server,
for BM25 on synthetic corpora (Zipfian words, 60-word passages) of the sizes given, and pyserini on the
same corpus in the same run. The server's overhead at batch 256 is measured three ways, the first two with
:func:`time_blocks` (blocks of calls per path, alternating): steady state (calls back to back), gapped (each
call after the same idle gap, as a rollout worker calls retrieval between generation turns) and per-call
alternation (in-process and server calls alternate back to back, which leaves the server idle through
every in-process call; reported, not judged: see :func:`time_blocks`). Dense speed is measured on the sample corpus
(embedding 1M passages on a 2-core CPU is out of reach).

    .venv/bin/python bench/retrieval.py [--sizes 10000 100000 1000000] [--no-lucene] [--no-dense]

Prints a table and writes ``bench/results/retrieval.json`` (``--out`` elsewhere); ``--markdown`` also
updates the "Retrieval" section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from corpora.formats import write_jsonl
from corpora.qa import read_qa
from corpora.sample import sample_paths
from retrieval.index import build_index, load_retriever

RESULTS = ROOT / "bench" / "results" / "retrieval.json"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
WORK = ROOT / "runs" / "bench_retrieval"
#: idle gap before each call in the gapped server-overhead measurement (seconds)
GAP_S = 0.02
#: rounds of the steady-state measurement (:func:`time_blocks`); at 10k passages 5 rounds gave a run-to-run
#: spread of +2% to +20% in the server overhead on the 2-vCPU VM, 10 rounds +5% to +9% (stop 13)
STEADY_ROUNDS = 10
#: calls per block (the first ones not counted) of the gapped measurement, which sleeps GAP_S before each
GAPPED_BLOCK, GAPPED_WARMUP = 20, 2


def recall_at(ranked: list[list[str]], gold: list[list[str]], ks=(1, 5, 10)) -> dict[str, float]:
    out = {}
    for k in ks:
        vals = [len(set(r[:k]) & set(g)) / len(g) for r, g in zip(ranked, gold) if g]
        out[f"recall@{k}"] = round(float(np.mean(vals)), 4)
    return out


def _lat(ts: list[float], n_queries: int) -> dict[str, float]:
    """q/s and p50/p99 latency of timed calls ``ts``; ``calls`` is how many: of fewer than 100, the p99 is
    (interpolated towards) the slowest call."""
    a = np.asarray(ts)
    return {
        "qps": round(n_queries / a.sum(), 1),
        "p50_ms": round(float(np.percentile(a, 50)) * 1000, 2),
        "p99_ms": round(float(np.percentile(a, 99)) * 1000, 2),
        "calls": len(a),
    }


def time_search(search, queries: list[str], batch: int, k: int, n_batches: int) -> dict[str, float]:
    """Latency per call of ``search(batch_of_queries, k)`` over ``n_batches`` calls (after one warm-up)."""
    return time_paired([search], queries, batch, k, n_batches)[0]


def nth_batch(queries: list[str], i: int, batch: int) -> list[str]:
    """The ``i``-th batch of ``batch`` queries, cycling through ``queries``."""
    return [queries[(i * batch + j) % len(queries)] for j in range(batch)]


def time_paired(
    searches: list, queries: list[str], batch: int, k: int, n_batches: int, gap_s: float = 0.0
) -> list[dict[str, float]]:
    """Like :func:`time_search` for several search functions, alternating them on the same batches so that
    load changes on a shared machine hit all of them alike (the server-overhead comparison). ``gap_s``
    seconds of sleep before every timed call give each path the same idle gap."""
    for search in searches:
        search(queries[:batch], k)  # warm-up (and numba's JIT compilation)
    ts: list[list[float]] = [[] for _ in searches]
    for i in range(n_batches):
        qs = nth_batch(queries, i, batch)
        for search, t_list in zip(searches, ts):
            if gap_s:
                time.sleep(gap_s)
            t = time.perf_counter()
            search(qs, k)
            t_list.append(time.perf_counter() - t)
    return [_lat(t_list, batch * n_batches) for t_list in ts]


def time_blocks(
    searches: list,
    queries: list[str],
    batch: int,
    k: int,
    rounds: int = STEADY_ROUNDS,
    block: int = 40,
    warmup: int = 5,
    gap_s: float = 0.0,
) -> list[dict[str, float]]:
    """Latency of several search functions as a client uses each one: every function runs ``block``
    consecutive calls (the first ``warmup`` not counted), each after ``gap_s`` seconds of sleep, in turn, for
    ``rounds`` rounds, so slow drifts of a shared machine still hit all of them; within a round every function
    searches the same batches, so no path gets cheaper queries. ``gap_s`` 0 is steady state
    (back to back); a gap is a rollout worker calling retrieval between generation turns.

    Why not alternate single calls (:func:`time_paired`): that leaves the server process idle through each
    in-process call (and, with a gap, through two gaps as well), while the in-process path idles only through
    its own gap (the client was busy with the server's reply just before). On the 2-vCPU VM any idle time
    slows the next search: the server's search, timed inside the server, took 6.8 ms back to back and
    8.8-9.4 ms after an 18 ms gap, and an in-process batch took 12.2 ms back to back and 16.8 ms after a 20 ms
    sleep. In blocks, each path idles only through its own gaps (and the server through its client's parse
    of the previous reply), as in a deployment, which uses one path, not both in turn."""
    ts: list[list[float]] = [[] for _ in searches]
    for r in range(rounds):
        for search, t_list in zip(searches, ts):
            for j in range(block):
                qs = nth_batch(queries, r * block + j, batch)  # every path gets the same batches in a round
                if gap_s:
                    time.sleep(gap_s)
                t = time.perf_counter()
                search(qs, k)
                if j >= warmup:
                    t_list.append(time.perf_counter() - t)
    n = rounds * (block - warmup)
    return [_lat(t_list, batch * n) for t_list in ts]


class _Server:
    """``create_app`` + uvicorn in a separate process (as deployed) on a free 127.0.0.1 port."""

    def __init__(self, index_dir: Path, method: str = "bm25", bm25_backend: str = "maxscore"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from retrieval.index import load_retriever\n"
            "from retrieval.server import ServerLimits, create_app, serve\n"
            f"serve(create_app(load_retriever({str(index_dir)!r}, {method!r}, "
            f"**({{'bm25_backend': {bm25_backend!r}}} if {method!r} == 'bm25' else {{'n_threads': 2}})), "
            "ServerLimits(max_topk=1000)), "
            f"port={self.port})\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code])

    def __enter__(self):
        import httpx2

        url = f"http://127.0.0.1:{self.port}"
        for _ in range(1200):
            try:
                if httpx2.get(url + "/health", timeout=1).status_code == 200:
                    return url
            except httpx2.TransportError:
                time.sleep(0.1)
            if self.proc.poll() is not None:
                raise RuntimeError("retrieval server process exited")
        self.__exit__()  # (a with-block whose __enter__ raises never calls __exit__)
        raise RuntimeError("retrieval server did not start in 120 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def synthetic_corpus(path: Path, n: int, seed: int = 0, vocab: int = 50_000, words: int = 60) -> list[str]:
    """Write ``n`` passages of Zipf-distributed pseudo-words; return 2,000 queries (5 words from a
    random passage each)."""
    rng = np.random.default_rng(seed)
    syll = ["ka", "to", "ri", "mu", "sen", "lo", "va", "dri", "ne", "qu", "bel", "ox", "tam", "pi", "zor"]
    lex = ["".join(rng.choice(syll, size=rng.integers(2, 5))) + str(i % 97) for i in range(vocab)]
    p = 1.0 / np.arange(1, vocab + 1) ** 1.05
    p /= p.sum()
    queries = []
    q_rows = set(rng.choice(n, size=min(2000, n), replace=False).tolist())

    def gen():
        for i in range(n):
            ids = rng.choice(vocab, size=words, p=p)
            text = " ".join(lex[j] for j in ids)
            if i in q_rows:
                queries.append(" ".join(lex[j] for j in rng.choice(ids, size=5)))
            yield {"id": f"s{i}", "title": f"Doc {i}", "contents": f"Doc {i}\n{text}"}

    qfile = path.with_suffix(".queries.json")
    if path.exists() and qfile.exists():
        return json.loads(qfile.read_text())
    if not path.exists():
        write_jsonl(path, gen())
    else:  # regenerate queries deterministically without rewriting the corpus
        for _ in gen():
            pass
    qfile.write_text(json.dumps(queries))
    return queries


def quality(args, out: dict, lucene) -> None:
    paths = sample_paths()
    qa = read_qa(paths["test"]) + read_qa(paths["train"])
    questions = [q.question for q in qa]
    gold = [q.metadata.get("supporting_ids", []) for q in qa]
    idx = WORK / "index_sample"
    man = build_index(paths["corpus"], idx, build_dense=not args.no_dense, show_progress=True)
    res: dict = {
        "corpus": "corpora/sample/corpus.jsonl",
        "passages": man["num_passages"],
        "questions": len(qa),
    }
    ranked: dict[str, list[list[str]]] = {}
    methods = ["bm25"] + ([] if args.no_dense else ["dense", "hybrid"])
    for m in methods:
        r = load_retriever(idx, m)
        r.search(questions[:1], 10)  # warm-up: numba's JIT (or loading its cache), the encoder's first call
        t = time.perf_counter()
        hits = r.search(questions, 10)
        dt = time.perf_counter() - t
        ranked[m] = [[h.id for h in hs] for hs in hits]
        res[m] = {**recall_at(ranked[m], gold), "search_s_all_questions": round(dt, 3)}
        if m == "dense":
            res[m]["model"] = man["dense"]["model"]
            res[m]["speed_sample_corpus"] = {
                f"batch{b}": time_search(r.search, questions, b, 10, nb) for b, nb in ((1, 100), (256, 4))
            }
    if lucene is not None:
        lidx = WORK / "lucene_sample"
        lucene.build_lucene_index(paths["corpus"], lidx, threads=2)
        ls = lucene.LuceneBM25Retriever(lidx, k1=0.9, b=0.4)
        lr = [[h.id for h in hs] for hs in ls.search(questions, 10)]
        res["pyserini_bm25"] = recall_at(lr, gold)
        res["bm25_top10_overlap_with_pyserini"] = round(
            float(np.mean([len(set(a) & set(b)) / len(b) if b else float(not a) for a, b in zip(ranked["bm25"], lr)])), 4
        )
        res["bm25_top1_agreement_with_pyserini"] = round(
            float(np.mean([bool(a) and bool(b) and a[0] == b[0] for a, b in zip(ranked["bm25"], lr)])), 4
        )
    out["quality"] = res


# --backends choice -> the name in tables: Sleuth's BM25 (MaxScore top-k, the default), bm25s's exhaustive
# retrieval (numpy, numba), and Lucene behind Sleuth's interface (retrieval.method: lucene)
NAMES = {"maxscore": "sleuth-maxscore", "numpy": "bm25s-numpy", "numba": "bm25s-numba", "lucene": "sleuth-lucene"}


def speed(args, out: dict, lucene) -> None:
    from retrieval.client import RemoteRetriever

    backends = list(args.backends)
    if lucene is None and "lucene" in backends:
        backends.remove("lucene")
    rows = []
    for n in args.sizes:
        corpus = WORK / f"synthetic_{n}.jsonl"
        queries = synthetic_corpus(corpus, n)
        idx = WORK / f"index_synthetic_{n}"
        man = build_index(corpus, idx, build_dense=False, show_progress=False, build_lucene="lucene" in backends)
        # an index kept from an earlier run is reused; its manifest keeps the original build time
        row = {"passages": n, "bm25s_build_s": round(man["build_seconds"], 1), "bm25s_index_reused": man["reused"]}
        for be in backends:
            name = NAMES[be]
            method = "lucene" if be == "lucene" else "bm25"
            r = load_retriever(idx, method, bm25_backend=be) if method == "bm25" else load_retriever(idx, method, n_threads=2)
            with _Server(idx, method, bm25_backend=be) as url, RemoteRetriever(url, timeout=600) as client:
                for path, fn in (("inproc", r.search), ("server", client.search)):
                    row[f"{name}_{path}_b1"] = time_search(fn, queries, 1, 10, args.n_single)
                # batch 256: in-process and server calls alternate on the same batches (paired)
                a, b = time_paired([r.search, client.search], queries, 256, 10, args.n_batches)
                row[f"{name}_inproc_b256"], row[f"{name}_server_b256"] = a, b
                row[f"{name}_server_overhead_b256_p50"] = round(b["p50_ms"] / a["p50_ms"] - 1, 3)
                if be in ("maxscore", "lucene"):  # the serving backends (bm25s's exhaustive ones are references)
                    # batch 256 in steady state (blocks of consecutive calls per path, alternating) and gapped
                    # (each call after the same idle gap): see time_blocks
                    for mode, (a, b) in (
                        ("steady", time_blocks([r.search, client.search], queries, 256, 10, args.rounds)),
                        ("gapped", time_blocks(
                            [r.search, client.search], queries, 256, 10, args.rounds, GAPPED_BLOCK, GAPPED_WARMUP,
                            GAP_S,
                        )),
                    ):
                        row[f"{name}_inproc_b256_{mode}"], row[f"{name}_server_b256_{mode}"] = a, b
                        row[f"{name}_server_overhead_b256_p50_{mode}"] = round(b["p50_ms"] / a["p50_ms"] - 1, 3)
            del r
        if lucene is not None:
            lidx = WORK / f"lucene_synthetic_{n}"
            reused = (lidx / "sleuth_source.json").exists()  # build_lucene_index skips an index of this corpus
            t = time.perf_counter()
            lucene.build_lucene_index(corpus, lidx, threads=2)
            row["pyserini_build_s"] = None if reused else round(time.perf_counter() - t, 1)
            row["pyserini_index_reused"] = reused
            ls = lucene.LuceneBM25Retriever(lidx, k1=0.9, b=0.4, threads=2)
            for b, nb in ((1, args.n_single), (256, args.n_batches)):
                row[f"pyserini_inproc_b{b}"] = time_search(ls.search, queries, b, 10, nb)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["speed"] = rows


def table(out: dict) -> str:
    lines = []
    q = out.get("quality")
    if q:
        lines += [
            (
                f"Quality: {q['questions']} HotpotQA dev questions over {q['passages']} pooled passages "
                "(recall of supporting paragraphs)"
            ),
            "",
            "| retriever | recall@1 | recall@5 | recall@10 |",
            "|---|---|---|---|",
        ]
        for m in ("bm25", "dense", "hybrid", "pyserini_bm25"):
            if m in q:
                name = {"dense": f"dense ({q['dense'].get('model', '')})"}.get(m, m)
                lines.append(f"| {name} | {q[m]['recall@1']} | {q[m]['recall@5']} | {q[m]['recall@10']} |")
        if "bm25_top10_overlap_with_pyserini" in q:
            lines += [
                "",
                (
                    f"Top-10 overlap of our BM25 with pyserini BM25 (k1=0.9, b=0.4): "
                    f"{q['bm25_top10_overlap_with_pyserini']} (top-1 agreement "
                    f"{q['bm25_top1_agreement_with_pyserini']})"
                ),
            ]
        if "dense" in q and "speed_sample_corpus" in q["dense"]:
            s = q["dense"]["speed_sample_corpus"]
            lines += [
                "",
                (
                    f"Dense (MiniLM on CPU, flat IP) on the sample: batch 1 {s['batch1']['qps']} q/s "
                    f"(p50 {s['batch1']['p50_ms']} ms); batch 256 {s['batch256']['qps']} q/s"
                ),
            ]
    if out.get("speed"):
        lines += [
            "",
            "Speed: BM25 top-10 on synthetic corpora; q/s (p50 / p99 ms per call). sleuth-maxscore is the default",
            "(`retrieval.bm25_backend: maxscore`, exact top-k with MaxScore pruning over bm25s's index);",
            "bm25s-numpy/-numba are bm25s's exhaustive retrieval (`bm25_backend: numpy|numba`); sleuth-lucene is",
            "`retrieval.method: lucene` (Lucene behind Sleuth's interface and server); pyserini is pyserini's own",
            "searcher as users run it. sleuth-maxscore and Lucene search with 2 threads, bm25s with 1.",
            "",
            "| passages | backend | path | batch 1 | batch 256 |",
            "|---|---|---|---|---|",
        ]
        calls = {
            b: sorted({v["calls"] for r in out["speed"] for key, v in r.items()
                       if key.endswith(f"_b{b}") and isinstance(v, dict) and "calls" in v})
            for b in (1, 256)
        }
        if calls[1] or calls[256]:
            n1, n256 = ("/".join(map(str, calls[b])) or "-" for b in (1, 256))
            lines[-3:-3] = [
                "",
                f"Timed calls per cell: {n1} calls at batch 1 and {n256} at batch 256"
                + (
                    "; a p99 of fewer than 100 calls is (interpolated towards) the slowest call."
                    if min(calls[1] + calls[256]) < 100
                    else "."
                ),
            ]
        for row in out["speed"]:
            for be, path in [(b, p) for b in NAMES.values() for p in ("inproc", "server")] + [("pyserini", "inproc")]:
                if f"{be}_{path}_b1" not in row:
                    continue
                cells = []
                for b in (1, 256):
                    s = row[f"{be}_{path}_b{b}"]
                    cells.append(f"{s['qps']} ({s['p50_ms']} / {s['p99_ms']})")
                lines.append(f"| {row['passages']:,} | {be} | {path} | {cells[0]} | {cells[1]} |")
        lines += [
            "",
            "Server overhead at batch 256 (p50 through the server / p50 in-process - 1), by corpus size, as",
            "steady / gapped / per-call: steady state (blocks of 40 calls back to back per path, alternating, "
            + f"{out.get('steady_rounds', 5)} rounds),",
            f"gapped (the same with blocks of {GAPPED_BLOCK}, each call after a {GAP_S * 1000:.0f} ms idle gap) and "
            + "per-call alternation (back to",
            "back; the table above's batch-256 column; reported, not judged: it leaves the server idle through every",
            "in-process call, see `time_blocks`):",
            "",
        ]
        for be in NAMES.values():
            key = f"{be}_server_overhead_b256_p50"
            cells = [
                f"{r['passages']:,}: {_pct(r.get(key + '_steady'))} / {_pct(r.get(key + '_gapped'))} / {_pct(r[key])}"
                for r in out["speed"]
                if key in r
            ]
            if cells:
                lines.append(f"- {be}: " + ", ".join(cells))
    lines += targets(out)
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def targets(out: dict) -> list[str]:
    """The retrieval targets checked against this run's numbers (markdown bullets)."""
    res = []
    q = out.get("quality") or {}
    if "bm25_top10_overlap_with_pyserini" in q:
        v = q["bm25_top10_overlap_with_pyserini"]
        res.append(f"- top-10 overlap with pyserini >= 0.9: {v} ({'met' if v >= 0.9 else 'NOT met'})")
    if all(m in q for m in ("bm25", "dense", "hybrid")):
        best = max(q["bm25"]["recall@10"], q["dense"]["recall@10"])
        v = q["hybrid"]["recall@10"]
        res.append(f"- hybrid recall@10 >= the better part ({best}): {v} ({'met' if v >= best else 'NOT met'})")
    for r in out.get("speed", []):
        if "pyserini_inproc_b256" in r:
            ref = r["pyserini_inproc_b256"]["qps"]
            cells = []
            for be in NAMES.values():
                if f"{be}_inproc_b256" in r:
                    v = r[f"{be}_inproc_b256"]["qps"]
                    cells.append(f"{be} {v / ref:.2f}x ({'met' if v >= ref else 'NOT met'})")
            res.append(f"- {r['passages']:,} passages, batch-256 q/s vs pyserini: " + ", ".join(cells))
        cells = []
        for be in NAMES.values():
            key = f"{be}_server_overhead_b256_p50"
            if key in r:
                v, g, w = r.get(key + "_steady"), r.get(key + "_gapped"), r[key]
                if v is None:  # reference backends: per-call alternation only
                    cells.append(f"{be} {_pct(w)} per-call ({'met' if w <= 0.10 else 'NOT met'})")
                    continue
                ok = v <= 0.10 and g is not None and g <= 0.10
                cells.append(
                    f"{be} {_pct(v)} steady, {_pct(g)} gapped ({'met' if ok else 'NOT met'}; per-call {_pct(w)})"
                )
        if cells:
            res.append(f"- {r['passages']:,} passages, server adds <= 10% at batch 256: " + ", ".join(cells))
    return ["", "Targets:", "", *res] if res else []


def _shown(path: Path) -> str:
    """``path`` as the markdown names it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write_markdown(out: dict, text: str) -> None:
    head = (
        f"## Retrieval\n\n{out['date']}, {out['machine']}. `python bench/retrieval.py "
        f"{' '.join(out['argv'])}`; raw numbers in `{out.get('json', 'bench/results/retrieval.json')}`.\n\n"
    )
    body = (
        head + text + "\n" + ("\n" + "\n".join(f"- {n}" for n in out["notes"]) + "\n" if out["notes"] else "")
    )
    old = RESULTS_MD.read_text() if RESULTS_MD.exists() else "# Benchmark results\n"
    if "## Retrieval" in old:
        # a function as the replacement: the section is literal text (a note's backslash is no escape)
        old = re.sub(r"## Retrieval\n.*?(?=\n## |\Z)", lambda _: body.rstrip() + "\n", old, flags=re.DOTALL)
    else:
        old = old.rstrip() + "\n\n" + body
    RESULTS_MD.write_text(old)


def main(argv=None) -> int:
    from sleuth.commands.common import positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=positive_int, nargs="*", default=[10_000, 100_000])
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--no-lucene", action="store_true")
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--backends", nargs="*", default=["maxscore", "numpy", "lucene"], choices=list(NAMES),
                   help="speed sweep: Sleuth's BM25 (maxscore), bm25s's exhaustive retrieval (numpy, numba) "
                   "and Sleuth's lucene method")
    p.add_argument("--n-single", type=positive_int, default=200, help="batch-1 calls timed")
    p.add_argument("--n-batches", type=positive_int, default=40, help="batch-256 calls timed (per path, per-call pairs)")
    p.add_argument(
        "--rounds", type=positive_int, default=STEADY_ROUNDS, help="rounds of the steady-state and gapped measurements"
    )
    p.add_argument("--markdown", action="store_true", help="update the Retrieval section of bench/RESULTS.md")
    p.add_argument("--out", type=Path, default=RESULTS, help="the JSON results file (default: %(default)s)")
    p.add_argument("--clean", action="store_true", help="delete the bench work dir afterwards")
    args = p.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    out: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores (shared), "
        f"Python {platform.python_version()}",
        "argv": argv if argv is not None else sys.argv[1:],
        "notes": [],
        "load_average_at_start": os.getloadavg(),
        "steady_rounds": args.rounds,
        "json": _shown(args.out),
    }
    lucene = None
    if not args.no_lucene:
        try:
            from retrieval import lucene as lucene_mod

            lucene_mod.setup_jvm()
            lucene = lucene_mod
            out["pyserini_version"] = lucene_mod.pyserini_version()
        except Exception as e:  # noqa: BLE001 (the comparison is optional; say why it was skipped)
            out["notes"].append(f"pyserini comparison skipped: {type(e).__name__}: {e}")
    if not args.no_quality:
        quality(args, out, lucene)
    if args.sizes:
        speed(args, out, lucene)
    text = table(out)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    if args.markdown:
        write_markdown(out, text)
    if args.clean:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
