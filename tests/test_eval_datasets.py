"""Benchmark loaders: every format on small fixtures, the registry, sub-sampling and bad input."""

import json
from pathlib import Path

import pytest

from corpora.catalog import readable_file
from corpora.formats import DataFormatError, QAExample
from corpora.qa import detect_format, musique_hops, read_qa
from eval.datasets import (
    ALL,
    REGISTRY,
    UnknownBenchmarkError,
    expand_benchmarks,
    load_benchmark,
    resolve_data_dir,
    subsample,
)


def _jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


SEARCHR1 = [
    {"data_source": "nq", "prompt": [{"content": "who wrote hamlet", "role": "user"}], "ability": "QA",
     "reward_model": {"ground_truth": "Shakespeare, William Shakespeare", "style": "rule"},
     "extra_info": {"answer": ["Shakespeare", "William Shakespeare"], "index": 0, "question": "who wrote hamlet", "split": "test"}},
    # no extra_info.question/answer: question from the Search-R1 template, answers from {"target": [...]}
    {"data_source": "nq", "prompt": [{"content": "Answer the given question. ... <search> query </search> ... "
                                      "For example, <answer> Beijing </answer>. Question: capital of France?\n", "role": "user"}],
     "reward_model": {"ground_truth": {"target": ["Paris"]}, "style": "rule"}, "extra_info": {"index": 7, "split": "test"}},
]

HOTPOT_OFFICIAL = [
    {"_id": "5a8b57f25542995d1e6f1371", "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
     "answer": "yes", "type": "comparison", "level": "hard",
     "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
     "context": [["Scott Derrickson", ["Scott Derrickson is an American director."]], ["Ed Wood", ["Ed Wood was an American filmmaker."]]]},
]

TWOWIKI_OFFICIAL = [
    {"_id": "8813f87c0bdd11eba7f7acde48001122", "type": "compositional",
     "question": "Who is the mother of the director of film Polish-Russian War (Film)?", "answer": "Małgorzata Braunek",
     "supporting_facts": [["Polish-Russian War (film)", 1], ["Xawery Żuławski", 2]],
     "context": [["Polish-Russian War (film)", ["..."]], ["Xawery Żuławski", ["..."]]],
     "evidences": [["Polish-Russian War", "director", "Xawery Żuławski"], ["Xawery Żuławski", "mother", "Małgorzata Braunek"]]},
    {"_id": "028eaef60bdb11eba7f7acde48001122", "type": "bridge_comparison",
     "question": "Which film has the director born first, A or B?", "answer": "A",
     "supporting_facts": [["A", 0], ["B", 0], ["Dir A", 0], ["Dir B", 0]], "context": [], "evidences": []},
]

MUSIQUE_OFFICIAL = [
    {"id": "2hop__482757_12019", "question": "When was the institute that owned The Collegian founded?",
     "answer": "1960", "answer_aliases": ["in 1960"], "answerable": True,
     "paragraphs": [{"idx": 0, "title": "The Collegian", "paragraph_text": "...", "is_supporting": True},
                    {"idx": 1, "title": "Other", "paragraph_text": "...", "is_supporting": False}],
     "question_decomposition": [{"id": 482757, "question": "...", "answer": "...", "paragraph_support_idx": 0},
                                {"id": 12019, "question": "...", "answer": "1960", "paragraph_support_idx": 1}]},
    {"id": "3hop1__9285_5188_23307", "question": "q3?", "answer": "x", "answer_aliases": [], "answerable": True,
     "paragraphs": [], "question_decomposition": [{}, {}, {}]},
    {"id": "4hop3__1_2_3_4", "question": "unanswerable?", "answer": "y", "answer_aliases": [], "answerable": False,
     "paragraphs": [], "question_decomposition": [{}, {}, {}, {}]},
]


def test_searchr1_jsonl(tmp_path):
    ex = read_qa(_jsonl(tmp_path / "nq.jsonl", SEARCHR1), dataset="nq")
    assert [e.id for e in ex] == ["test_0", "test_7"]
    assert ex[0].question == "who wrote hamlet"
    assert ex[0].golden_answers == ["Shakespeare", "William Shakespeare"]  # the list, not the joined string
    assert ex[1].question == "capital of France?"
    assert ex[1].golden_answers == ["Paris"]
    assert all(isinstance(e, QAExample) and e.metadata["dataset"] == "nq" for e in ex)


def test_searchr1_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(SEARCHR1[0], extra_info={"answer": "Shakespeare", "index": 3, "question": "who wrote hamlet", "split": "dev"})]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (ex,) = read_qa(tmp_path / "d.parquet")
    assert (ex.id, ex.question, ex.golden_answers) == ("dev_3", "who wrote hamlet", ["Shakespeare"])


def test_searchr1_parquet_rows_without_an_id_use_the_index(tmp_path):
    """Rows written together with rows that have an id get a null id column in parquet; every such row got
    the id 'None', so a file failed as 'duplicate question id'. A null id is no id: split_index is used."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    info = SEARCHR1[0]["extra_info"]
    rows = [dict(SEARCHR1[0], id="nq_a"), SEARCHR1[0], dict(SEARCHR1[0], extra_info=dict(info, index=8))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert [e.id for e in read_qa(tmp_path / "d.parquet")] == ["nq_a", "test_0", "test_8"]


def test_flashrag_jsonl_keeps_metadata(tmp_path):
    recs = [{"id": "test_1", "question": "q?", "golden_answers": ["a", "b"], "metadata": {"s_pop": 3}}]
    (ex,) = read_qa(_jsonl(tmp_path / "p.jsonl", recs), dataset="popqa")
    assert ex.golden_answers == ["a", "b"] and ex.metadata["s_pop"] == 3 and ex.metadata.get("hops") is None


def test_flashrag_2wiki_and_hotpotqa_metadata_give_hops_and_supporting_titles(tmp_path):
    """FlashRAG's exports keep the source's question type and supporting facts in ``metadata``."""
    recs = [{"id": f"d{i}", "question": "q?", "golden_answers": ["a"],
             "metadata": {"type": t, "supporting_facts": {"title": ["X", "Y", "X"], "sent_id": [0, 2, 1]}}}
            for i, t in enumerate(["bridge_comparison", "comparison", "other"])]
    path = _jsonl(tmp_path / "dev.jsonl", recs)
    ex = read_qa(path, dataset="2wikimultihopqa")
    assert [e.metadata.get("hops") for e in ex] == [4, 2, None] and ex[0].metadata["supporting_titles"] == ["X", "Y"]
    assert [e.metadata.get("hops") for e in read_qa(path, dataset="hotpotqa", hops=2)] == [2, 2, 2]


def test_source_ids_make_merged_search_r1_ids_unique(tmp_path):
    """Search-R1's merged files number every source from 0: with ``source_ids`` the id carries the source."""
    recs = [{"id": "train_0", "question": f"{s}?", "golden_answers": ["a"], "data_source": s} for s in ("nq", "hotpotqa")]
    path = _jsonl(tmp_path / "train.jsonl", recs)
    with pytest.raises(DataFormatError, match="duplicate question id 'train_0'"):
        read_qa(path)
    ex = read_qa(path, source_ids=True)
    assert [(e.id, e.metadata["dataset"], e.metadata["data_source"]) for e in ex] == [
        ("nq_train_0", "nq", "nq"), ("hotpotqa_train_0", "hotpotqa", "hotpotqa")]


def test_official_hotpotqa_json(tmp_path):
    p = tmp_path / "hotpot_dev_distractor_v1.json"
    p.write_text(json.dumps(HOTPOT_OFFICIAL))
    (ex,) = read_qa(p)
    assert ex.id == "5a8b57f25542995d1e6f1371" and ex.golden_answers == ["yes"]
    assert ex.metadata["hops"] == 2 and ex.metadata["type"] == "comparison" and ex.metadata["level"] == "hard"
    assert ex.metadata["supporting_titles"] == ["Scott Derrickson", "Ed Wood"]


def test_official_2wiki_json_hops_from_type(tmp_path):
    p = tmp_path / "dev.json"
    p.write_text(json.dumps(TWOWIKI_OFFICIAL))
    assert detect_format(TWOWIKI_OFFICIAL[0]) == "2wiki"
    ex = read_qa(p, dataset="2wikimultihopqa")
    assert [e.metadata["hops"] for e in ex] == [2, 4]
    assert ex[0].golden_answers == ["Małgorzata Braunek"]


def test_official_musique_jsonl(tmp_path):
    ex = read_qa(_jsonl(tmp_path / "musique_ans_v1.0_dev.jsonl", MUSIQUE_OFFICIAL), dataset="musique")
    assert [e.id for e in ex] == ["2hop__482757_12019", "3hop1__9285_5188_23307"]  # unanswerable skipped
    assert [e.metadata["hops"] for e in ex] == [2, 3]
    assert ex[0].golden_answers == ["1960", "in 1960"]
    assert ex[0].metadata["supporting_titles"] == ["The Collegian"]
    assert musique_hops("4hop3__1_2") == 4 and musique_hops("x", [1, 2]) == 2 and musique_hops("x") is None


def test_official_musique_says_how_many_unanswerable_it_skipped(tmp_path, caplog):
    with caplog.at_level("INFO", logger="eval.datasets"):
        ex = read_qa(_jsonl(tmp_path / "musique_full_v1.0_dev.jsonl", MUSIQUE_OFFICIAL), dataset="musique")
    assert len(ex) == 2
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 1 and "1 unanswerable" in said[0] and "musique_full_v1.0_dev.jsonl" in said[0]


def test_searchr1_musique_export_has_no_hops(tmp_path):
    # the registered MuSiQue file is a Search-R1 export: ids test_<index>, no decomposition, so no hop count
    ex = read_qa(_jsonl(tmp_path / "dev.searchr1.jsonl", SEARCHR1), dataset="musique")
    assert [e.id for e in ex] == ["test_0", "test_7"] and all(e.metadata.get("hops") is None for e in ex)


def test_ircot_jsonl(tmp_path):
    rec = {"question_id": "q1", "question_text": "Q?", "answers_objects": [{"number": "", "spans": ["A"]}],
           "contexts": [{"id": "0", "title": "T", "paragraph_text": "p", "is_supporting": True}]}
    (ex,) = read_qa(_jsonl(tmp_path / "i.jsonl", [rec]))
    assert (ex.id, ex.golden_answers, ex.metadata["supporting_titles"]) == ("q1", ["A"], ["T"])


# -- bad input -----------------------------------------------------------------------------------------
def test_missing_field_names_field_and_line(tmp_path):
    recs = [{"id": "a", "question": "q", "golden_answers": ["x"]}, {"id": "b", "golden_answers": ["y"]}]
    with pytest.raises(DataFormatError, match=r":2: missing field 'question'"):
        read_qa(_jsonl(tmp_path / "f.jsonl", recs))


@pytest.mark.parametrize("question", [None, "", "   ", ["q"]])
def test_a_missing_or_blank_question_is_an_error_not_the_text_none(tmp_path, question):
    """``"question": null`` became the question "None" (str(None)) and a blank one went to the retriever, where
    a remote server answers 400 and stops the run; both are errors naming the file, line and field."""
    recs = [{"id": "a", "question": "q", "golden_answers": ["x"]}, {"id": "b", "question": question, "golden_answers": ["y"]}]
    path = _jsonl(tmp_path / "f.jsonl", recs)
    with pytest.raises(DataFormatError, match=r"f.jsonl:2: field 'question' must be a non-empty string"):
        read_qa(path)
    blank = json.loads(json.dumps(SEARCHR1[0]))
    blank["prompt"][0]["content"] = "Answer the question. <search> query </search> Question: "
    blank["extra_info"].pop("question", None)
    with pytest.raises(DataFormatError, match=r":1: empty question"):
        read_qa(_jsonl(tmp_path / "s.jsonl", [blank]))


@pytest.mark.parametrize("field,value", [
    ("golden_answers", [{"text": "Paris"}]),  # a SQuAD-style answer object
    ("golden_answers", [["Paris", "City of Light"]]),  # answers nested one list too deep
    ("golden_answers", [True]),
    ("id", None),
    ("id", ["a"]),
])
def test_a_golden_answer_or_id_that_is_no_text_is_an_error(tmp_path, field, value):
    """A golden answer that is an object, a list or a bool became its Python text (``"{'text': 'Paris'}"``),
    which no prediction matches, so the question silently scored 0; an id ``null`` became ``"None"``. Both
    are errors naming the file, line and field."""
    recs = [{"id": "a", "question": "q", "golden_answers": ["x"]},
            {"id": "b", "question": "q2", "golden_answers": ["y"]} | {field: value}]
    path = _jsonl(tmp_path / "f.jsonl", recs)
    with pytest.raises(DataFormatError, match=rf"f.jsonl:2: field '{field}'"):
        read_qa(path)


def test_searchr1_missing_answer_names_field_and_line(tmp_path):
    bad = json.loads(json.dumps(SEARCHR1[0]))
    del bad["extra_info"]["answer"]
    del bad["reward_model"]
    with pytest.raises(DataFormatError, match=r":2: missing field 'reward_model.ground_truth'"):
        read_qa(_jsonl(tmp_path / "s.jsonl", [SEARCHR1[0], bad]))


def test_bad_text_names_file_and_line(tmp_path):
    """A byte that is not UTF-8 names the line of the JSONL or JSON file that holds it."""
    good = b'{"id": "a", "question": "q", "golden_answers": ["x"]}\n'
    p = tmp_path / "u.jsonl"
    p.write_bytes(good + b'{"id": "b", "question": "caf\xe9", "golden_answers": ["y"]}\n')
    with pytest.raises(DataFormatError, match=r"u.jsonl:2: not valid UTF-8"):
        read_qa(p)
    p = tmp_path / "u.json"
    p.write_bytes(b'[{"id": "a", "question": "caf\xe9", "golden_answers": ["y"]}]')
    with pytest.raises(DataFormatError, match=r"u.json:1: not valid UTF-8"):
        read_qa(p)


def test_official_json_missing_field_names_record(tmp_path):
    bad = dict(HOTPOT_OFFICIAL[0])
    del bad["answer"]
    p = tmp_path / "h.json"
    p.write_text(json.dumps([HOTPOT_OFFICIAL[0] | {"_id": "other"}, bad]))
    with pytest.raises(DataFormatError, match=r"h.json:1: element 2: missing field 'answer'"):
        read_qa(p)


def test_bad_json_and_duplicates(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text('{"id": "a", "question": "q", "golden_answers": ["x"]}\n{not json\n')
    with pytest.raises(DataFormatError, match=r"b.jsonl:2: not valid JSON"):
        read_qa(p)
    recs = [{"id": "a", "question": "q", "golden_answers": ["x"]}] * 2
    with pytest.raises(DataFormatError, match="duplicate question id 'a'"):
        read_qa(_jsonl(tmp_path / "d.jsonl", recs))
    with pytest.raises(DataFormatError, match="golden_answers"):
        read_qa(_jsonl(tmp_path / "e.jsonl", [{"id": "a", "question": "q", "golden_answers": []}]))


def test_unknown_benchmark_lists_known_names():
    with pytest.raises(UnknownBenchmarkError) as e:
        load_benchmark("hotpot_qa_v2")
    for name in ALL:
        assert name in str(e.value)
    with pytest.raises(UnknownBenchmarkError):
        expand_benchmarks(["nq,nope"])


# -- registry, data dir, sub-sampling ------------------------------------------------------------------
def test_expand_benchmarks():
    assert expand_benchmarks(["all"]) == list(ALL)
    assert expand_benchmarks(["2wiki,HotpotQA", "hotpotqa", "sample"]) == ["2wikimultihopqa", "hotpotqa", "sample"]
    assert expand_benchmarks("my/qa.jsonl") == ["my/qa.jsonl"]


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("SLEUTH_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert resolve_data_dir() == tmp_path / "cache" / "sleuth" / "data"  # where `sleuth data get` writes
    monkeypatch.setenv("SLEUTH_DATA_DIR", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert resolve_data_dir("/x") == Path("/x")
    # a registry name rooted at the data dir
    (tmp_path / "bamboogle").mkdir()
    _jsonl(tmp_path / "bamboogle" / "test.searchr1.jsonl", SEARCHR1)
    ex = load_benchmark("bamboogle")
    assert len(ex) == 2 and all(e.metadata["hops"] == 2 and e.metadata["dataset"] == "bamboogle" for e in ex)
    with pytest.raises(FileNotFoundError, match="SLEUTH_DATA_DIR") as e:
        load_benchmark("nq")
    assert "fetch it with `sleuth data get nq`" in str(e.value) and f"data dir {tmp_path} " in str(e.value)
    _jsonl(tmp_path / "bamboogle" / "test.jsonl", [{"id": "b0", "question": "Who?", "golden_answers": ["Me"]}])
    assert [e.id for e in load_benchmark("bamboogle")] == ["b0"]  # what `sleuth data get` wrote comes first


def test_sample_benchmark_is_shipped():
    ex = load_benchmark("sample")
    assert len(ex) == 100 and REGISTRY["sample"].multihop
    assert all(e.metadata["supporting_ids"] and e.metadata["hops"] == 2 for e in ex)


def test_subsample_deterministic_nested_ordered():
    ex = [QAExample(id=str(i), question="q", golden_answers=["a"]) for i in range(50)]
    a, b = subsample(ex, 10, seed=3), subsample(ex, 10, seed=3)
    assert [e.id for e in a] == [e.id for e in b]
    assert [int(e.id) for e in a] == sorted(int(e.id) for e in a)  # file order kept
    assert {e.id for e in a} < {e.id for e in subsample(ex, 20, seed=3)}  # a larger limit extends
    assert {e.id for e in a} != {e.id for e in subsample(ex, 10, seed=4)}
    assert len(subsample(ex, None)) == 50 and len(subsample(ex, 500)) == 50
    with pytest.raises(ValueError):
        subsample(ex, 0)


@pytest.mark.skipif(not all(readable_file(n) for n in ALL),
                    reason="the real benchmark files are absent: no mirror beside the checkout and none fetched "
                    "(SLEUTH_DATA_DIR, `sleuth data get benchmarks`)")
def test_real_benchmarks_load_with_limit():
    for name in ALL:
        ex = load_benchmark(name, limit=5, seed=0)
        assert len(ex) == 5 and all(e.question and e.golden_answers for e in ex), name
