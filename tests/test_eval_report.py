"""`sleuth report`: tables benchmarks x methods, plots and JSON from evaluation runs."""

import argparse
import json
import math

import pytest

from eval.report import build_report, find_summaries, to_markdown, write_report
from eval.run import run_benchmarks
from sleuth.commands import report as report_cmd
from sleuth.config import AgentConfig
from tests.test_eval_fakes import PASSAGES, KeywordRetriever, ScriptedLLM


def _fake(answer_right: bool, calls: int):
    def fn(examples):
        return [{"id": e.id, "prediction": e.golden_answers[0] if answer_right and i % 2 == 0 else "wrong",
                 "golden_answers": e.golden_answers, "retrieved_ids": list(e.metadata.get("supporting_ids") or [])[:1],
                 "search_calls": calls, "turns": calls + 1, "generated_tokens": 5, "wall_s": 0.5}
                for i, e in enumerate(examples)]
    return fn


@pytest.fixture
def runs(tmp_path):
    qa = tmp_path / "musique_mini.jsonl"
    qa.write_text("".join(json.dumps({"id": f"{h}hop__{i}", "question": f"q{i}?", "golden_answers": ["a"],
                                      "metadata": {"hops": h}}) + "\n" for i, h in enumerate([2, 2, 3, 4])))
    for method, right, calls in [("direct", False, 0), ("rag", True, 1)]:
        run_benchmarks(["sample", str(qa)], method, 4, 0, tmp_path / "run", ScriptedLLM(), KeywordRetriever(PASSAGES),
                       AgentConfig(), progress=False, method_fn=_fake(right, calls), batch_size=4)
    return tmp_path / "run", qa


def test_report_tables_plots_json(runs, tmp_path):
    run_dir, qa = runs
    paths = write_report([run_dir], tmp_path / "rep")
    md = paths["markdown"].read_text()
    assert "## EM (%)" in md and "## F1 (%)" in md and "| benchmark | n | direct | rag |" in md
    assert "| sample | 4 | 0.0 | 50.0 |" in md  # rag answers every other question right
    assert "| **average** | | 0.0 | 50.0 |" in md
    assert "## Recall of supporting paragraphs (%)" in md
    assert "| rag | 8 | 1.00 | 2.00 | 5.00 | 0.50 |" in md
    for key in ("em_vs_search_calls", "em_by_hops"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(paths["json"].read_text())
    assert rep["em"]["sample"] == {"direct": 0.0, "rag": 0.5}
    # the multi-hop file has hop counts 2, 2, 3, 4; rag is right on questions 0 and 2 (hops 2 and 3)
    assert rep["by_hops"][str(qa)]["rag"] == {"2": 0.5, "3": 1.0, "4": 0.0}
    assert rep["efficiency"]["direct"]["search_calls"] == 0.0


def test_same_method_twice_gets_distinct_columns(runs, tmp_path):
    run_dir, _ = runs
    run_benchmarks(["sample"], "rag", 4, 0, tmp_path / "run2", ScriptedLLM(), KeywordRetriever(PASSAGES),
                   AgentConfig(max_turns=2), progress=False, method_fn=_fake(True, 2))
    rep = build_report(find_summaries([run_dir, tmp_path / "run2"]))
    assert len(rep["methods"]) == 3 and sum(m.startswith("rag (") for m in rep["methods"]) == 2


def test_report_command(runs, tmp_path, capsys):
    run_dir, _ = runs
    p = argparse.ArgumentParser()
    report_cmd.add_arguments(p)
    assert report_cmd.run(p.parse_args([str(run_dir), "--out", str(tmp_path / "out")])) == 0
    out = capsys.readouterr().out
    assert "| sample |" in out and (tmp_path / "out" / "report.md").exists()


def test_report_without_runs_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no evaluation summary"):
        write_report([tmp_path / "empty"], tmp_path / "o")
    with pytest.raises(FileNotFoundError, match="not found"):
        write_report([tmp_path / "missing"], tmp_path / "o")


def test_same_config_in_two_run_dirs_of_one_name_is_not_merged(tmp_path):
    """Two runs of one config (same fingerprint) in run dirs with the same base name must stay two columns,
    each with its own numbers, not one label whose values come from whichever run was read last."""
    for sub, right in (("a", True), ("b", False)):
        run_benchmarks(["sample"], "rag", 4, 0, tmp_path / sub / "eval", ScriptedLLM(), KeywordRetriever(PASSAGES),
                       AgentConfig(), progress=False, method_fn=_fake(right, 1), batch_size=4)
    rep = build_report(find_summaries([tmp_path / "a" / "eval", tmp_path / "b" / "eval"]))
    assert len(set(rep["methods"])) == 2
    assert sorted(rep["em"]["sample"].values()) == [0.0, 0.5]
    folder = next((tmp_path / "a" / "eval").iterdir())  # a run dir and its own folder: one run, one column
    assert len(find_summaries([tmp_path / "a" / "eval", folder])) == 1


def test_average_is_over_the_same_benchmarks_for_every_method(runs, tmp_path):
    """A method that lacks a benchmark of the table has no average (an average over fewer benchmarks is not
    comparable with the others'), instead of the mean over the benchmarks it has."""
    run_dir, qa = runs
    run_benchmarks(["sample"], "ircot", 4, 0, run_dir, ScriptedLLM(), KeywordRetriever(PASSAGES), AgentConfig(),
                   progress=False, method_fn=_fake(True, 2), batch_size=4)
    rep = build_report(find_summaries([run_dir]))
    assert rep["em"]["sample"]["ircot"] == 0.5 and rep["em"][str(qa)]["ircot"] is None
    assert rep["average"]["em"]["ircot"] is None
    assert rep["average"]["em"]["rag"] is not None


def test_runs_over_different_questions_are_flagged(runs, tmp_path):
    """Columns scored on different questions of a benchmark (another --limit or seed) are not silently shown
    under one n: the n cell lists each run's n and is marked."""
    run_dir, _ = runs
    run_benchmarks(["sample"], "ircot", 6, 0, run_dir, ScriptedLLM(), KeywordRetriever(PASSAGES), AgentConfig(),
                   progress=False, method_fn=_fake(True, 2), batch_size=4)
    rep = build_report(find_summaries([run_dir]))
    assert rep["same_questions"]["sample"] is False
    md = to_markdown(rep)
    assert "| sample | 4/6* |" in md and "different questions" in md
    run_dir2 = tmp_path / "only"
    for method in ("direct", "rag"):
        run_benchmarks(["sample"], method, 4, 0, run_dir2, ScriptedLLM(), KeywordRetriever(PASSAGES), AgentConfig(),
                       progress=False, method_fn=_fake(True, 1), batch_size=4)
    md = to_markdown(build_report(find_summaries([run_dir2])))
    assert "| sample | 4 |" in md and "different questions" not in md


def test_unreadable_summary_is_named(tmp_path):
    bad = tmp_path / "run" / "rag-0123456789ab"
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text('{"method": "rag", "benchm')  # e.g. copied while being written
    with pytest.raises(ValueError, match="summary.json"):
        find_summaries([tmp_path / "run"])


@pytest.mark.parametrize("text", ['[1, 2]', '{"method": "rag"}', '{"method": "rag", "fingerprint": "f", "benchmarks": 3}'])
def test_a_json_file_that_is_no_summary_is_named(tmp_path, text):
    bad = tmp_path / "run" / "rag-0123456789ab"
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text(text)
    with pytest.raises(ValueError, match="summary.json: not an evaluation summary"):
        find_summaries([tmp_path / "run"])


def test_em_by_hops_axis_starts_at_zero_when_every_em_is_zero(tmp_path, monkeypatch):
    """A panel whose bars are all 0 got matplotlib's default symmetric limits (a negative EM axis)."""
    import matplotlib.pyplot as plt

    from eval.report import plot_em_by_hops

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    rep = {"methods": ["direct", "rag"], "by_hops": {"hotpotqa": {"direct": {"2": 0.0}, "rag": {"2": 0.0}},
                                                     "sample": {"direct": {"2": 0.0, "3": 0.5}, "rag": {}}}}
    assert plot_em_by_hops(rep, tmp_path / "h.png")
    (fig,) = figs
    assert [ax.get_ylim()[0] for ax in fig.axes] == [0.0, 0.0]
    assert all(ax.get_ylim()[1] > 0 for ax in fig.axes)
    # "rag" has no hop data for "sample": no bar there, where a 0 would read as "scored 0"
    heights = [p.get_height() for p in fig.axes[1].patches]
    assert heights[:2] == [0.0, 50.0] and all(math.isnan(h) for h in heights[2:]) and len(heights) == 4


def test_report_of_an_eval_qa_folder_says_which_eval_writes_runs(tmp_path):
    """`sleuth eval --qa FILE --out DIR` writes DIR/<name>.json and .md, not the <method>-<fingerprint> runs
    that `sleuth report` reads; the error said only "written by `sleuth eval`"."""
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "qa.json").write_text(json.dumps({"metrics": {"em": 0.0}}))
    with pytest.raises(FileNotFoundError, match="--benchmarks"):
        find_summaries([tmp_path / "ev"])
