"""Exact top-k BM25 with MaxScore dynamic pruning over bm25s's impact matrix.

bm25s stores BM25 as precomputed per-(term, document) scores ("impacts") in a CSC matrix: for term ``t`` the
documents ``indices[indptr[t]:indptr[t+1]]`` (sorted ascending) and their scores ``data[...]``. bm25s then
scores every document that any query term touches and selects the top-k over all documents, so a query with
one common word costs O(corpus). Lucene (and so pyserini) prunes instead; this module does the same.

Algorithm: document-at-a-time MaxScore (Turtle & Flood, 1995, "Query evaluation: strategies and
optimizations"; the variant in PISA and Lucene's ``MaxScoreBulkScorer``). Query terms are sorted by their
largest impact ``u``. Once the current k-th best score ``theta`` exceeds the sum of ``u`` over the
lowest-impact terms, those terms are *non-essential*: a document that contains only them cannot enter the
top-k, so candidates come from the *essential* terms' postings alone (usually the rare ones), and
non-essential terms are only probed (galloping search) for candidates whose upper bound still beats
``theta``. The result is the exhaustive top-k: same scores up to float32 summation order (bounds carry a
1e-5 relative slack so rounding never prunes a true top-k document), ties broken by the lower row first as
Lucene does.

Kernels are numba-compiled (``cache=True``: compiled once per install, several seconds, then loaded from the
cache) and release the GIL, so :func:`search` splits a batch over threads.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np

_SLACK = np.float32(1e-5)  # relative slack on pruning bounds (float32 summation order differs by ~1e-7)


def max_impacts(data: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """Largest impact per term: float32 ``[V]`` from ``data`` float32 ``[nnz]`` and ``indptr`` int ``[V+1]``
    (0 for terms without postings)."""
    starts = np.asarray(indptr[:-1])
    nonempty = np.asarray(indptr[1:]) > starts
    out = np.zeros(len(starts), np.float32)
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(np.asarray(data), starts[nonempty])
    return out


@nb.njit(cache=True, nogil=True)
def _seek(indices, lo, hi, d):  # pragma: no cover - compiled
    """First position in ``[lo, hi)`` whose document is ``>= d`` (galloping, then binary search)."""
    step = 1
    while lo + step < hi and indices[lo + step] < d:
        lo += step
        step *= 2
    top = min(hi, lo + step + 1)
    while lo < top:
        mid = (lo + top) >> 1
        if indices[mid] < d:
            lo = mid + 1
        else:
            top = mid
    return lo


@nb.njit(cache=True, nogil=True)
def _query(data, indices, indptr, terms, weights, u, k, out_rows, out_scores):  # pragma: no cover - compiled
    m = len(terms)
    order = np.argsort(u)
    pos = np.empty(m, np.int64)
    ends = np.empty(m, np.int64)
    w = np.empty(m, np.float32)
    cum = np.empty(m, np.float32)  # cum[j]: most that terms 0..j can add together
    c = np.float32(0.0)
    for i in range(m):
        t = terms[order[i]]
        pos[i] = indptr[t]
        ends[i] = indptr[t + 1]
        w[i] = weights[order[i]]
        c += u[order[i]] * (np.float32(1.0) + _SLACK)
        cum[i] = c
    hs = np.zeros(k, np.float32)
    hd = np.full(k, -1, np.int64)
    hn = 0
    hmin = 0
    theta = np.float32(0.0)
    none = np.int64(1) << 62
    p = 0  # terms p..m-1 are essential
    while p < m:
        d = none
        for j in range(p, m):
            if pos[j] < ends[j] and indices[pos[j]] < d:
                d = np.int64(indices[pos[j]])
        if d == none:
            break
        s = np.float32(0.0)
        for j in range(p, m):
            if pos[j] < ends[j] and indices[pos[j]] == d:
                s += w[j] * data[pos[j]]
                pos[j] += 1
        for j in range(p - 1, -1, -1):
            if s + cum[j] <= theta:
                break
            q = _seek(indices, pos[j], ends[j], d)
            pos[j] = q
            if q < ends[j] and indices[q] == d:
                s += w[j] * data[q]
        if hn < k:
            hs[hn] = s
            hd[hn] = d
            hn += 1
            if hn < k:
                continue
        elif s > theta:
            hs[hmin] = s
            hd[hmin] = d
        else:
            continue
        hmin = 0  # the heap changed: find its new minimum (k is small; a scan beats a heap here)
        for i in range(1, k):
            if hs[i] < hs[hmin] or (hs[i] == hs[hmin] and hd[i] > hd[hmin]):
                hmin = i
        theta = hs[hmin]
        while p < m and cum[p] <= theta * (np.float32(1.0) - _SLACK):
            p += 1
    for i in range(hn):  # best first; equal scores by lower row
        out_rows[i] = hd[i]
        out_scores[i] = hs[i]
    for i in range(1, hn):
        j = i
        while j > 0 and (out_scores[j] > out_scores[j - 1]
                         or (out_scores[j] == out_scores[j - 1] and out_rows[j] < out_rows[j - 1])):
            out_scores[j], out_scores[j - 1] = out_scores[j - 1], out_scores[j]
            out_rows[j], out_rows[j - 1] = out_rows[j - 1], out_rows[j]
            j -= 1
    for i in range(hn, k):
        out_rows[i] = -1
        out_scores[i] = 0.0


@nb.njit(cache=True, nogil=True)
def _batch(data, indices, indptr, maxs, q_ptr, q_terms, q_w, k, out_rows, out_scores):  # pragma: no cover
    for qi in range(len(q_ptr) - 1):
        a, b = q_ptr[qi], q_ptr[qi + 1]
        u = np.empty(b - a, np.float32)
        for i in range(b - a):
            u[i] = q_w[a + i] * maxs[q_terms[a + i]]
        _query(data, indices, indptr, q_terms[a:b], q_w[a:b], u, k, out_rows[qi], out_scores[qi])


def search(
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    maxs: np.ndarray,
    queries: list[list[int]],
    k: int,
    n_threads: int = 1,
    pool: ThreadPoolExecutor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` rows and scores for each query, exactly as exhaustive BM25 would rank them.

    ``data`` float32 ``[nnz]``, ``indices`` int32 ``[nnz]`` (ascending within each term), ``indptr`` int64
    ``[V+1]``: bm25s's score matrix; ``maxs`` float32 ``[V]`` from :func:`max_impacts`; ``queries``: term
    ids per query (a repeated term counts once per occurrence; ids must be ``< V``). Returns ``(rows int64
    [Q, k], scores float32 [Q, k])``, best first; slots without a matching document are row -1, score 0.
    With ``n_threads > 1`` the batch is split into ``4 n_threads`` parts, worked off by the calling thread
    and ``n_threads - 1`` threads of ``pool`` (made for the call if ``None``). Raises
    ``IndexError`` for a term id outside ``[0, V)`` (checked before the compiled kernel runs).
    """
    n = len(queries)
    rows = np.empty((n, k), np.int64)
    scores = np.empty((n, k), np.float32)
    if n == 0:
        return rows, scores
    lengths = np.fromiter((len(q) for q in queries), np.int64, n)
    flat = np.fromiter((t for q in queries for t in q), np.int64, int(lengths.sum()))
    if len(flat) and (flat.min() < 0 or flat.max() >= len(maxs)):
        raise IndexError(f"term ids must be in [0, {len(maxs)}), got {flat.min()}..{flat.max()}")
    # one (term, weight) per distinct term of each query, terms without postings dropped
    key, counts = np.unique(np.repeat(np.arange(n), lengths) * len(maxs) + flat, return_counts=True)
    q_terms = key % len(maxs)
    keep = maxs[q_terms] > 0
    q_terms, q_w, owner = q_terms[keep], counts[keep].astype(np.float32), (key // len(maxs))[keep]
    q_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(owner, minlength=n), out=q_ptr[1:])
    args = (np.asarray(data), np.asarray(indices), np.asarray(indptr), maxs)
    threads = max(1, min(n_threads, n))
    if threads == 1:
        _batch(*args, q_ptr, q_terms, q_w, k, rows, scores)
        return rows, scores
    # dynamic split: 4 parts per thread, pulled by the pool's threads and by the calling thread itself (one
    # wake-up less, and a slow part no longer holds up a fixed half: p90 latency at batch 256 drops ~30%)
    n_parts = min(n, 4 * threads)
    bounds = np.linspace(0, n, n_parts + 1).astype(np.int64)
    todo, lock = iter(range(n_parts)), threading.Lock()

    def work():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            a, b = bounds[i], bounds[i + 1]
            _batch(*args, q_ptr[a:b + 1] - q_ptr[a], q_terms[q_ptr[a]:q_ptr[b]], q_w[q_ptr[a]:q_ptr[b]], k,
                   rows[a:b], scores[a:b])

    ex = pool or ThreadPoolExecutor(threads - 1)
    try:
        helpers = [ex.submit(work) for _ in range(threads - 1)]
        work()
        for f in helpers:
            f.result()
    finally:
        if pool is None:
            ex.shutdown()
    return rows, scores


def default_threads() -> int:
    """Threads for a batch search when none are asked for: the cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
