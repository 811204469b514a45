"""Resumable, fingerprinted evaluation runs: only missing questions are computed, configs never mix."""

import json

import pytest

from eval.cache import CacheMismatchError, PredictionCache, fingerprint, path_manifest
from eval.datasets import UnknownBenchmarkError
from eval.report import format_summary
from eval.run import run_benchmarks
from sleuth.config import AgentConfig
from tests.test_eval_fakes import PASSAGES, KeywordRetriever, ScriptedLLM


class CountingMethod:
    """A fake method: answers "Paris" to everything, remembers which ids it computed; can crash."""

    def __init__(self, crash_after: int | None = None):
        self.computed: list[str] = []
        self.crash_after = crash_after

    def __call__(self, examples):
        if self.crash_after is not None and len(self.computed) >= self.crash_after:
            raise KeyboardInterrupt("simulated crash")
        self.computed.extend(e.id for e in examples)
        return [{"id": e.id, "prediction": "Paris", "golden_answers": e.golden_answers, "retrieved_ids": [],
                 "search_calls": 1, "turns": 1, "generated_tokens": 2, "wall_s": 0.01} for e in examples]


def _run(tmp_path, method_fn=None, limit=5, llm=None, **kw):
    return run_benchmarks(["sample"], "rag", limit, 0, tmp_path / "run", llm or ScriptedLLM(), KeywordRetriever(PASSAGES),
                          AgentConfig(), batch_size=kw.pop("batch_size", 2), progress=False, method_fn=method_fn, **kw)


def test_resumed_run_computes_only_missing_questions(tmp_path):
    first = CountingMethod()
    s1 = _run(tmp_path, first, limit=5)
    assert len(first.computed) == 5 and s1["benchmarks"]["sample"]["computed"] == 5

    again = CountingMethod()
    s2 = _run(tmp_path, again, limit=5)
    assert again.computed == [] and s2["benchmarks"]["sample"]["computed"] == 0
    assert s2["fingerprint"] == s1["fingerprint"] and s2["benchmarks"]["sample"]["n"] == 5

    extended = CountingMethod()
    s3 = _run(tmp_path, extended, limit=12)  # a larger limit contains the smaller sub-sample
    assert len(extended.computed) == 7 and not set(extended.computed) & set(first.computed)
    assert s3["benchmarks"]["sample"]["n"] == 12


def test_crashed_run_resumes_after_last_saved_batch(tmp_path):
    crashing = CountingMethod(crash_after=4)  # batches of 2: two batches saved, the third crashes
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, crashing, limit=8)
    resumed = CountingMethod()
    s = _run(tmp_path, resumed, limit=8)
    assert len(resumed.computed) == 4 and not set(resumed.computed) & set(crashing.computed)
    assert s["benchmarks"]["sample"]["n"] == 8


def test_resume_with_a_real_method_makes_no_llm_calls(tmp_path):
    llm = ScriptedLLM()
    s1 = _run(tmp_path, llm=llm, limit=4, batch_size=4)
    assert llm.calls == 1
    llm2 = ScriptedLLM()
    s2 = _run(tmp_path, llm=llm2, limit=4, batch_size=4)
    assert llm2.calls == 0 and s2["benchmarks"]["sample"]["em"] == s1["benchmarks"]["sample"]["em"]
    rec = json.loads((tmp_path / "run" / f"rag-{s1['fingerprint']}" / "predictions" / "sample.jsonl").read_text().splitlines()[0])
    assert rec["method"] == "rag" and rec["fingerprint"] == s1["fingerprint"] and rec["hops"] == 2
    assert rec["supporting_ids"] and rec["retrieved_ids"] and rec["question"]


def test_a_different_config_gets_its_own_cache(tmp_path):
    a, b = CountingMethod(), CountingMethod()
    s1 = _run(tmp_path, a, limit=3)
    s2 = _run(tmp_path, b, limit=3, top_k=5)  # different option -> different fingerprint -> recomputed
    assert s1["fingerprint"] != s2["fingerprint"] and len(b.computed) == 3
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(
        [f"rag-{s1['fingerprint']}", f"rag-{s2['fingerprint']}"])
    c = CountingMethod()  # a different agent config
    s3 = run_benchmarks(["sample"], "rag", 3, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                        AgentConfig(max_turns=2), progress=False, method_fn=c)
    assert s3["fingerprint"] not in (s1["fingerprint"], s2["fingerprint"]) and len(c.computed) == 3


def test_foreign_records_are_refused(tmp_path):
    s = _run(tmp_path, CountingMethod(), limit=2)
    pred = tmp_path / "run" / f"rag-{s['fingerprint']}" / "predictions" / "sample.jsonl"
    lines = pred.read_text().splitlines()
    foreign = json.loads(lines[0]) | {"fingerprint": "0123456789ab"}
    pred.write_text("\n".join([json.dumps(foreign), *lines[1:]]) + "\n")
    with pytest.raises(CacheMismatchError, match="refusing to mix"):
        _run(tmp_path, CountingMethod(), limit=2)


def test_tampered_fingerprint_file_is_refused(tmp_path):
    man = {"method": "rag", "x": 1}
    cache = PredictionCache(tmp_path, "rag", man)
    (cache.dir / "fingerprint.json").write_text(json.dumps({"fingerprint": "ffffffffffff"}))
    with pytest.raises(CacheMismatchError, match="refusing"):
        PredictionCache(tmp_path, "rag", man)


def test_torn_last_line_is_ignored_then_dropped(tmp_path):
    cache = PredictionCache(tmp_path, "direct", {"m": 1})
    cache.append("nq", [{"id": "a", "prediction": "x", "golden_answers": ["x"]}])
    with open(cache.path("nq"), "a") as f:
        f.write('{"id": "b", "predic')  # crash mid-write
    assert list(cache.load("nq")) == ["a"]
    cache.append("nq", [{"id": "c", "prediction": "y", "golden_answers": ["y"]}])
    assert list(cache.load("nq")) == ["a", "c"]
    with open(cache.path("nq"), "a") as f:
        f.write("garbage\n")
    cache.append("nq", [{"id": "d", "prediction": "y", "golden_answers": ["y"]}])
    with pytest.raises(CacheMismatchError, match="not valid JSON"):
        cache.load("nq")


def test_torn_last_line_cut_inside_a_utf8_character_is_ignored(tmp_path):
    # records are written as UTF-8 (TriviaQA aliases in Arabic, Cyrillic...); a crash can cut a character
    cache = PredictionCache(tmp_path, "direct", {"m": 1})
    cache.append("triviaqa", [{"id": "a", "prediction": "x", "golden_answers": ["Аргентина"]}])
    line = (json.dumps({"id": "b", "golden_answers": ["Аргентина"]}, ensure_ascii=False) + "\n").encode()
    with open(cache.path("triviaqa"), "ab") as f:
        f.write(line[: line.index("Аргентина".encode()) + 1])  # crash mid-character
    assert list(cache.load("triviaqa")) == ["a"]
    cache.append("triviaqa", [{"id": "c", "prediction": "y", "golden_answers": ["y"]}])
    assert list(cache.load("triviaqa")) == ["a", "c"]


def test_append_waits_for_another_process_writing_the_same_cache_file(tmp_path):
    """Two runs of one config on one benchmark append to one file; a batch another process is still writing
    (no newline yet) is not a torn line to cut: append waits for its writer's lock."""
    import fcntl
    import threading
    import time

    cache = PredictionCache(tmp_path, "direct", {"m": 1})
    cache.append("nq", [{"id": "a", "prediction": "x", "golden_answers": ["x"]}])
    other = json.dumps({"id": "b", "prediction": "x", "golden_answers": ["x"], "method": "direct",
                        "fingerprint": cache.fingerprint, "benchmark": "nq"}).encode() + b"\n"
    with open(cache.path("nq"), "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # the other process, mid-batch
        f.write(other[:10])
        f.flush()
        t = threading.Thread(target=cache.append, args=("nq", [{"id": "c", "prediction": "y", "golden_answers": ["y"]}]))
        t.start()
        time.sleep(0.3)
        f.write(other[10:])
    t.join(10)
    assert list(cache.load("nq")) == ["a", "b", "c"]


def test_two_runs_creating_one_cache_folder_at_once_both_succeed(tmp_path, monkeypatch):
    """Two processes (here threads) starting the same new config at once both write fingerprint.json: each
    through its own temp file, so neither finds its temp file renamed away by the other."""
    import threading
    from pathlib import Path

    barrier = threading.Barrier(2, timeout=10)
    real_replace = Path.replace

    def replace_after_both_wrote(self, target):
        if self.name.startswith("fingerprint"):
            barrier.wait()  # both temp files written before either is renamed
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace_after_both_wrote)
    errors = []

    def start():
        try:
            PredictionCache(tmp_path, "rag", {"method": "rag", "x": 1})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["fingerprint.json", "predictions"]


def test_unknown_benchmark_fails_before_any_work(tmp_path):
    m = CountingMethod()
    with pytest.raises(UnknownBenchmarkError, match="known: nq, triviaqa"):
        run_benchmarks(["sample", "hotpot-qa"], "rag", 2, 0, tmp_path / "run", ScriptedLLM(), None, AgentConfig(),
                       progress=False, method_fn=m)
    assert m.computed == [] and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="unknown evaluation method 'reflexion'.*registered: direct, rag, ircot"):
        run_benchmarks(["sample"], "reflexion", 2, 0, tmp_path / "run", ScriptedLLM(), None, AgentConfig(), progress=False)


def test_summary_merges_benchmarks_and_formats(tmp_path):
    qa = tmp_path / "mine.jsonl"
    qa.write_text(json.dumps({"id": "x1", "question": "Capital of France?", "golden_answers": ["Paris"]}) + "\n")
    _run(tmp_path, CountingMethod(), limit=3)
    s = run_benchmarks([str(qa)], "rag", None, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                       AgentConfig(), progress=False, method_fn=CountingMethod())
    assert set(s["benchmarks"]) == {"sample", str(qa)}
    assert s["benchmarks"][str(qa)]["em"] == 1.0 and s["benchmarks"][str(qa)]["multihop"] is False
    on_disk = json.loads((tmp_path / "run" / f"rag-{s['fingerprint']}" / "summary.json").read_text())
    assert set(on_disk["benchmarks"]) == set(s["benchmarks"])
    table = format_summary(s)
    assert "| sample | 3 |" in table and "| 100.0 |" in table


def test_summary_keeps_benchmarks_another_run_wrote_meanwhile(tmp_path):
    """Two `sleuth eval` processes on one run dir and config, other benchmarks: each writes its benchmark
    into summary.json; the one that finishes last must not drop what the other wrote while it ran."""
    qa = tmp_path / "mine.jsonl"
    qa.write_text(json.dumps({"id": "x1", "question": "Capital of France?", "golden_answers": ["Paris"]}) + "\n")
    other = CountingMethod()

    def meanwhile(examples):  # the other process finishes its benchmark while this one computes
        if not other.computed:
            run_benchmarks([str(qa)], "rag", None, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                           AgentConfig(), progress=False, method_fn=other)
        return CountingMethod()(examples)

    s = _run(tmp_path, meanwhile, limit=3)
    on_disk = json.loads((tmp_path / "run" / f"rag-{s['fingerprint']}" / "summary.json").read_text())
    assert set(on_disk["benchmarks"]) == {"sample", str(qa)}


def test_fingerprint_and_manifests(tmp_path):
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    f = tmp_path / "corpus.jsonl"
    f.write_text("x")
    m1 = path_manifest(f)
    f.write_text("y")
    assert path_manifest(f) != m1
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps({"fingerprint": "abc", "created": "now"}))
    assert path_manifest(tmp_path / "idx")["manifest"] == {"fingerprint": "abc"}  # volatile keys dropped
    with pytest.raises(FileNotFoundError):
        path_manifest(tmp_path / "nope")


def test_cached_predictions_of_other_questions_are_not_reused(tmp_path):
    """The same benchmark name (or QA path) read from another data dir, or an edited file, can reuse
    question ids for other questions: their cached predictions must be recomputed, not scored."""
    def write(qa_dir, question, answer):
        qa_dir.mkdir(parents=True, exist_ok=True)
        (qa_dir / "qa.jsonl").write_text(
            json.dumps({"id": "q1", "question": question, "golden_answers": [answer]}) + "\n"
            + json.dumps({"id": "q2", "question": "Capital of Italy?", "golden_answers": ["Rome"]}) + "\n")
        return str(qa_dir / "qa.jsonl")

    qa = write(tmp_path / "data", "Capital of France?", "Paris")
    first = CountingMethod()
    s1 = run_benchmarks([qa], "rag", None, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                        AgentConfig(), progress=False, method_fn=first)
    assert s1["benchmarks"][qa]["em"] == 0.5
    write(tmp_path / "data", "Capital of Germany?", "Berlin")  # same path and ids, another question
    again = CountingMethod()
    s2 = run_benchmarks([qa], "rag", None, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                        AgentConfig(), progress=False, method_fn=again)
    assert again.computed == ["q1"] and s2["benchmarks"][qa]["computed"] == 1
    assert s2["benchmarks"][qa]["em"] == 0.0  # scored against Berlin, not the stale Paris record


def test_cached_predictions_are_scored_with_the_current_supporting_ids_and_hops(tmp_path):
    """supporting_ids and hops describe the question, not the prediction: a QA file that gains them (or
    corrects them) after its predictions were cached must be scored with the file's current values."""
    qa = tmp_path / "qa.jsonl"

    def write(meta):
        qa.write_text(json.dumps({"id": "q1", "question": "Capital of France?", "golden_answers": ["Paris"],
                                  "metadata": meta}) + "\n")

    def run(method):
        return run_benchmarks([str(qa)], "rag", None, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                              AgentConfig(), progress=False, method_fn=method)

    def retrieving(examples):
        return [{"id": e.id, "prediction": "Paris", "golden_answers": e.golden_answers, "retrieved_ids": ["p1", "p9"]}
                for e in examples]

    write({})
    s1 = run(retrieving)
    assert s1["benchmarks"][str(qa)]["recall"] is None and s1["benchmarks"][str(qa)]["by_hops"] == {}
    write({"supporting_ids": ["p1", "p2"], "hops": 2})
    again = CountingMethod()
    s2 = run(again)
    assert again.computed == []  # the prediction is reused...
    m = s2["benchmarks"][str(qa)]
    assert m["recall"] == 0.5 and m["n_recall"] == 1  # ...and scored against the file's supporting ids
    assert m["by_hops"] == {"2": {"n": 1, "em": 1.0, "f1": 1.0, "cover_em": 1.0}}


def test_a_method_may_return_non_string_ids(tmp_path):
    """Records are matched to their batch by str(id); a method that returns int ids must not crash the run."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"id": str(i), "question": f"q{i}?", "golden_answers": ["Paris"]}) + "\n"
                          for i in range(3)))

    def int_ids(examples):
        return [{"id": int(e.id), "prediction": "Paris", "golden_answers": e.golden_answers} for e in examples]

    s = run_benchmarks([str(qa)], "rag", None, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                       AgentConfig(), progress=False, method_fn=int_ids, batch_size=2)
    assert s["benchmarks"][str(qa)]["n"] == 3 and s["benchmarks"][str(qa)]["em"] == 1.0


def test_runs_against_different_retrieval_servers_do_not_share_a_cache(tmp_path):
    """With retrieval.url the retriever is a RemoteRetriever, which has no index manifest: runs against two
    servers (another URL, or the same URL serving another index) had one fingerprint, so the second reused
    the first's predictions. The URL and the index the server reports are now part of the fingerprint."""
    from retrieval.client import RemoteRetriever

    def remote(url, health):
        r = RemoteRetriever(url)
        r.health = health
        return r

    def served(index, uptime):
        return lambda: {"status": "ok", "uptime_s": uptime, "queries": uptime, "method": "bm25", "index": index}

    def no_health():
        raise ValueError("retrieval server rejected the request (HTTP 404): Not Found")

    local = tmp_path / "index"  # retrieval.index_dir, unused with retrieval.url
    local.mkdir()
    (local / "manifest.json").write_text('{"num_passages": 3}')

    def fp(retriever):
        return run_benchmarks(["sample"], "rag", 2, 0, tmp_path / "run", ScriptedLLM(), retriever, AgentConfig(),
                              progress=False, method_fn=CountingMethod(), index_dir=local)["fingerprint"]

    a = fp(remote("http://127.0.0.1:8001", served("runs/index_a", 1.0)))
    assert fp(remote("http://127.0.0.1:8001/", served("runs/index_a", 50.0))) == a  # counters are not identity
    assert fp(remote("http://127.0.0.1:8001", served("runs/index_b", 1.0))) != a
    assert fp(remote("http://127.0.0.1:8002", served("runs/index_a", 1.0))) != a
    assert fp(remote("http://127.0.0.1:8003", no_health)) != fp(remote("http://127.0.0.1:8004", no_health))


def test_models_served_over_an_openai_api_do_not_share_a_cache(tmp_path):
    """describe_llm read a model name only from model.config or a model_name attribute; the OpenAI-compatible
    backend keeps its served model name in ``model`` (a string) and has a base_url, so two served models (3B
    and 7B with one tokenizer, or two servers) got one fingerprint and the second reused the first's
    predictions when run_benchmarks was called without model_dir (the Python API, or the judge)."""
    from agent.backends.openai import OpenAICompatibleLLM
    from eval.cache import describe_llm
    from tests.test_eval_fakes import CharTokenizer

    def fp(url, model):
        llm = OpenAICompatibleLLM(url, model, CharTokenizer())
        return run_benchmarks(["sample"], "direct", 2, 0, tmp_path / "run", llm, None, AgentConfig(),
                              progress=False, method_fn=CountingMethod())["fingerprint"]

    a = fp("http://127.0.0.1:8001/v1", "Qwen/Qwen2.5-3B-Instruct")
    assert fp("http://127.0.0.1:8001/v1", "Qwen/Qwen2.5-7B-Instruct") != a
    assert fp("http://127.0.0.1:8002/v1", "Qwen/Qwen2.5-3B-Instruct") != a
    assert fp("http://127.0.0.1:8001/v1", "Qwen/Qwen2.5-3B-Instruct") == a
    assert describe_llm(ScriptedLLM()) == {"class": "tests.test_eval_fakes.ScriptedLLM",
                                          "tokenizer": {"class": "CharTokenizer", "vocab_size": None,
                                                        "name_or_path": None}}  # no model attribute: as before


@pytest.mark.parametrize("line", ['["a list"]', '"text"', "null", "{}"])
def test_a_cache_line_that_is_not_a_record_is_a_clear_error(tmp_path, line):
    """A cache line that is JSON but not a record (an array, a string, null) crashed with AttributeError,
    and a record of this config without an id with KeyError; each is a CacheMismatchError naming the line."""
    man = {"method": "rag", "x": 1}
    cache = PredictionCache(tmp_path, "rag", man)
    cache.append("sample", [{"id": "q1", "pred": "a"}])
    if line == "{}":
        line = json.dumps({"method": "rag", "fingerprint": cache.fingerprint})
    with open(cache.path("sample"), "a") as f:
        f.write(line + "\n")
    cache.append("sample", [{"id": "q2", "pred": "b"}])
    with pytest.raises(CacheMismatchError, match="sample.jsonl:2"):
        cache.load("sample")


class FailingOnceMethod(CountingMethod):
    """A fake agent method whose first call fails every episode (a dead retrieval server): error records."""

    def __call__(self, examples):
        recs = super().__call__(examples)
        if len(self.computed) <= len(examples):  # the first call
            for r in recs:
                r.update(prediction=None, stop_reason="error", error="ConnectionError: retrieval server down")
        return recs


def test_failed_episodes_are_counted_and_recomputed_on_the_next_run(tmp_path):
    """An episode that ended on an error (scored 0) is not a finished question: the summary counts it, and the
    next run computes it again instead of reusing the failure from the cache."""
    method = FailingOnceMethod()
    s1 = _run(tmp_path, method, limit=3, batch_size=3)
    assert s1["benchmarks"]["sample"]["errors"] == 3 and s1["benchmarks"]["sample"]["em"] == 0.0
    s2 = _run(tmp_path, method, limit=3, batch_size=3)
    assert s2["benchmarks"]["sample"]["computed"] == 3 and s2["benchmarks"]["sample"]["errors"] == 0
    assert len(method.computed) == 6
    s3 = _run(tmp_path, method, limit=3, batch_size=3)  # now the cache holds the good records: nothing to do
    assert s3["benchmarks"]["sample"]["computed"] == 0 and s3["benchmarks"]["sample"]["errors"] == 0


def test_cli_a_malformed_benchmark_file_fails_before_the_index_and_the_model_load(tmp_path, monkeypatch):
    """``sleuth eval --benchmarks FILE`` with a bad line names it before minutes of loading the index and the
    model, as an unknown name or a missing file already did."""
    import argparse

    from corpora.formats import DataFormatError
    from sleuth import pipeline
    from sleuth.commands import evaluate

    def must_not_load(*a, **kw):
        raise AssertionError("loaded the index or the model before reading the questions")

    monkeypatch.setattr(pipeline, "load_llm", must_not_load)
    monkeypatch.setattr(pipeline, "open_retriever", must_not_load)
    qa = tmp_path / "bad.jsonl"
    qa.write_text('{"id": "a", "question": "q?", "golden_answers": ["x"]}\n{"id": "b", "question": "q2?"}\n')
    p = argparse.ArgumentParser()
    evaluate.add_arguments(p)
    args = p.parse_args(["--benchmarks", str(qa), "--method", "rag", "--out", str(tmp_path / "ev"), f"out_dir={tmp_path}"])
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: missing field 'golden_answers'"):
        evaluate.run(args)
