"""MaxScore top-k (retrieval.maxscore) on small impact matrices with exact answers: ties go to the lower row
(as Lucene breaks them), pruning never changes the top-k (integer impacts make every score and every tie exact,
so the reference order is fully determined), threads split the batch and nothing else, and the term-id check
holds on both sides. Small enough to run with the kernels compiled or as plain Python
(``NUMBA_DISABLE_JIT=1``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from retrieval.maxscore import default_threads, max_impacts, search


def csc(columns: list[dict[int, float]]):
    """bm25s's CSC impact arrays from ``{doc: impact}`` per term: ``(data, indices, indptr, maxs)``."""
    indptr = np.zeros(len(columns) + 1, np.int64)
    indptr[1:] = np.cumsum([len(c) for c in columns])
    indices = np.array([d for c in columns for d in sorted(c)], np.int32)
    data = np.array([c[d] for c in columns for d in sorted(c)], np.float32)
    return data, indices, indptr, max_impacts(data, indptr)


def reference(columns, query, n_docs, k):
    """Exhaustive top-k: score desc, then row asc; unmatched slots -1 / 0."""
    score = np.zeros(n_docs)
    hit = np.zeros(n_docs, bool)
    for t in query:
        for d, x in columns[t].items():
            score[d] += x
            hit[d] = True
    order = sorted(np.flatnonzero(hit), key=lambda d: (-score[d], d))[:k]
    return order + [-1] * (k - len(order)), [score[d] for d in order] + [0.0] * (k - len(order))


def test_max_impacts():
    *_, maxs = csc([{0: 1.0, 3: 2.5}, {}, {1: 0.5}, {}])
    assert maxs.dtype == np.float32 and maxs.tolist() == [2.5, 0.0, 0.5, 0.0]
    assert max_impacts(np.zeros(0, np.float32), np.zeros(3, np.int64)).tolist() == [0.0, 0.0]


def test_equal_scores_keep_the_lower_row():
    cols = [{0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, {1: 2.0, 3: 2.0}, {2: 1.0, 4: 3.0}]
    arrs = csc(cols)
    rows, scores = search(*arrs, [[0]], 1)
    assert rows.tolist() == [[0]] and scores.tolist() == [[1.0]]
    rows, _ = search(*arrs, [[0]], 3)
    assert rows.tolist() == [[0, 1, 2]]
    rows, scores = search(*arrs, [[0, 1]], 3)  # scores 1, 3, 1, 3
    assert rows.tolist() == [[1, 3, 0]] and scores.tolist() == [[3.0, 3.0, 1.0]]
    rows, scores = search(*arrs, [[0, 1, 2]], 5)  # scores 1, 3, 2, 3, 3
    assert rows.tolist() == [[1, 3, 4, 2, 0]] and scores.tolist() == [[3.0, 3.0, 3.0, 2.0, 1.0]]
    rows, scores = search(*arrs, [[2, 0, 1]], 2)  # the same query in another term order
    assert rows.tolist() == [[1, 3]]
    rows, scores = search(*arrs, [[0, 0]], 2)  # a repeated term counts twice
    assert rows.tolist() == [[0, 1]] and scores.tolist() == [[2.0, 2.0]]


def test_unmatched_slots_empty_queries_and_terms_without_postings():
    arrs = csc([{0: 1.0, 2: 2.0}, {}])
    rows, scores = search(*arrs, [[0], [1], []], 4)
    assert rows.tolist() == [[2, 0, -1, -1], [-1] * 4, [-1] * 4]
    assert scores.tolist() == [[2.0, 1.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]
    rows, scores = search(*arrs, [], 3)
    assert rows.shape == (0, 3) and scores.shape == (0, 3) and rows.dtype == np.int64 and scores.dtype == np.float32


def test_term_ids_are_checked_on_both_sides():
    arrs = csc([{0: 1.0}, {1: 1.0}, {2: 1.0}])
    assert search(*arrs, [[2]], 1)[0].tolist() == [[2]]  # V - 1: the last term
    assert search(*arrs, [[0]], 1)[0].tolist() == [[0]]
    for bad, shown in (([3], "0..3"), ([-1], "-1..0"), ([1, 3], "0..3")):
        with pytest.raises(IndexError, match=rf"term ids must be in \[0, 3\), got {shown}"):
            search(*arrs, [[0], bad], 1)


def _random_columns(rng, n_docs, vocab):
    """Integer impacts (1..4, weighted by a Zipf-like document frequency): every sum is exact in float32, and
    ties are everywhere."""
    cols = []
    for t in range(vocab):
        df = max(1, int(n_docs * 0.7 / (t + 1) ** 0.8))
        docs = rng.choice(n_docs, size=df, replace=False)
        hi = 1 + min(3, t // 3)
        cols.append({int(d): float(rng.integers(1, hi + 1)) for d in docs})
    return cols


@pytest.mark.parametrize("seed", range(3))
def test_pruned_top_k_is_the_exhaustive_one_with_ties_to_the_lower_row(seed):
    rng = np.random.default_rng(seed)
    n_docs, vocab = 120, 24
    cols = _random_columns(rng, n_docs, vocab)
    arrs = csc(cols)
    queries = [rng.integers(0, vocab, size=int(rng.integers(1, 6))).tolist() for _ in range(30)]
    queries += [[vocab - 1], [0, 0, vocab - 1], [5, 5, 5]]
    for k in (1, 2, 5, 17, 130):
        rows, scores = search(*arrs, queries, k)
        for q, r, s in zip(queries, rows, scores, strict=True):
            want_rows, want_scores = reference(cols, q, n_docs, k)
            assert r.tolist() == want_rows, (q, k)
            assert s.tolist() == want_scores, (q, k)


def test_threads_split_the_batch_and_nothing_else():
    rng = np.random.default_rng(7)
    cols = _random_columns(rng, 80, 16)
    arrs = csc(cols)
    queries = [rng.integers(0, 16, size=int(rng.integers(1, 4))).tolist() for _ in range(13)]
    one = search(*arrs, queries, 4, n_threads=1)
    for n_threads in (2, 3, 40):
        got = search(*arrs, queries, 4, n_threads=n_threads)
        assert (got[0] == one[0]).all() and (got[1] == one[1]).all()
    with ThreadPoolExecutor(2) as pool:
        got = search(*arrs, queries, 4, n_threads=3, pool=pool)
        assert (got[0] == one[0]).all() and (got[1] == one[1]).all()
        assert pool.submit(lambda: 5).result() == 5  # a pool passed in is left running
    single = search(*arrs, queries[:1], 4, n_threads=8)  # one query: one thread
    assert (single[0] == one[0][:1]).all()
    for n_threads in (0, -2):  # fewer than one thread asked for: the calling thread alone
        got = search(*arrs, queries, 4, n_threads=n_threads)
        assert (got[0] == one[0]).all() and (got[1] == one[1]).all()
    assert default_threads() >= 1
