"""LLM-as-judge accuracy in evaluation runs: record-level judging, aggregation, cache fingerprints, reports, CLI."""

import argparse
import json
import re

import pytest

from agent.judges import judge_answers
from agent.llm import Generation
from eval.metrics import aggregate, judge_score
from eval.report import format_summary, write_report
from eval.run import _live_postfix, judge_records, run_benchmarks
from sleuth.config import AgentConfig
from tests.test_eval_fakes import PASSAGES, CharTokenizer, KeywordRetriever, ScriptedLLM

_REF = re.compile(r"Reference answers: (.*)\n")
_PRED = re.compile(r"Predicted answer: (.*)\n")


class JudgeLLM:
    """A fake judge: "correct" when the prediction equals a reference (case-insensitive) or is in
    ``also_right``; an unparseable reply for "weird"; counts prompts and calls."""

    def __init__(self, name="judge-a", also_right=()):
        self.tokenizer = CharTokenizer()
        self.fingerprint = name
        self.also_right = set(also_right)
        self.prompts: list[str] = []
        self.calls = 0

    def generate(self, prompts, params):
        assert params.temperature == 0.0
        self.calls += 1
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            self.prompts.append(text)
            golds = [g.lower() for g in _REF.search(text).group(1).split("; ")]
            pred = _PRED.search(text).group(1)
            reply = ("hmm, not sure" if pred == "weird" else
                     "VERDICT: correct" if pred.lower() in golds or pred in self.also_right else "VERDICT: incorrect")
            out.append(Generation(self.tokenizer.encode(reply), reply))
        return out


def test_judge_answers_is_batched_and_applies_the_policy():
    judge = JudgeLLM(also_right={"the City of Light"})
    qs, golds = ["Capital of France?"] * 5, [["Paris"]] * 5
    preds = ["the City of Light", "Lyon", "weird", None, "paris"]
    out = judge_answers(judge, qs, golds, preds)
    assert judge.calls == 1 and len(judge.prompts) == 4  # one batch; the unanswered one is not sent
    assert [o["llm_verdict"] for o in out] == ["correct", "incorrect", "unparseable", "no_answer", "correct"]
    assert [o["llm_correct"] for o in out] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert out[2]["llm_raw"] == "hmm, not sure" and out[3]["llm_raw"] is None
    # "rule": an unparseable verdict falls back to the rule metric (EM of "weird" vs "weird" here)
    out = judge_answers(JudgeLLM(), ["q"] * 2, [["weird"], ["Paris"]], ["weird", "weird"], unparseable="rule")
    assert [o["llm_correct"] for o in out] == [1.0, 0.0] and {o["llm_verdict"] for o in out} == {"unparseable"}
    assert judge_answers(JudgeLLM(), [], [], []) == []
    with pytest.raises(ValueError, match="parallel"):
        judge_answers(JudgeLLM(), ["q"], [["a"]], [])
    with pytest.raises(ValueError, match="unparseable"):
        judge_answers(JudgeLLM(), ["q"], [["a"]], ["a"], unparseable="half")
    with pytest.raises(ValueError, match="fallback_metric"):
        judge_answers(JudgeLLM(), ["q"], [["a"]], ["a"], fallback_metric="bleu")


def test_judge_records_requires_the_question():
    recs = [{"id": "a", "question": "Capital?", "prediction": "Paris", "golden_answers": ["Paris"]}]
    assert judge_records(recs, JudgeLLM()) is recs and recs[0]["llm_correct"] == 1.0
    with pytest.raises(KeyError, match="'question'"):
        judge_records([{"id": "b", "prediction": "x", "golden_answers": ["y"]}], JudgeLLM())


def _rec(pred, llm_correct=None, verdict=None, **kw):
    r = {"id": pred, "prediction": pred, "golden_answers": ["Paris"], **kw}
    if llm_correct is not None:
        r.update(llm_correct=llm_correct, llm_verdict=verdict)
    return r


def test_aggregate_judge_accuracy_and_unparseable_rate():
    recs = [_rec("Paris", 1.0, "correct"), _rec("the capital", 1.0, "correct"), _rec("Lyon", 0.0, "incorrect"),
            _rec("weird", 0.0, "unparseable"), _rec(None, 0.0, "no_answer"), _rec("late")]  # last: not judged
    agg = aggregate(recs)
    assert agg["judge_acc"] == pytest.approx(2 / 5) and agg["n_judged"] == 5
    assert agg["judge_unparseable"] == pytest.approx(1 / 4)  # over the 4 answers sent to the judge
    assert agg["em"] == pytest.approx(1 / 6)  # rule metrics unchanged
    none = aggregate([_rec("Paris"), _rec("x")])
    assert none["judge_acc"] is None and none["judge_unparseable"] is None and none["n_judged"] == 0
    # the agent loop's own LLM judge (agent.judge: llm) counts when the record was not judged again
    agent_rec = _rec("Paris", verdict=None) | {"verdict": {"em": 1.0, "llm_correct": 0.0, "llm_verdict": "error"}}
    assert judge_score(agent_rec) == 0.0
    assert aggregate([agent_rec])["judge_unparseable"] == 1.0
    assert judge_score(agent_rec | {"llm_correct": 1.0, "llm_verdict": "correct"}) == 1.0  # eval judge wins
    assert judge_score({"verdict": {"em": 1.0}}) is None


def _run(tmp_path, judge=None, options=None, llm=None, limit=4):
    return run_benchmarks(["sample"], "rag", limit, 0, tmp_path / "run", llm or ScriptedLLM(), KeywordRetriever(PASSAGES),
                          AgentConfig(), top_k=1, batch_size=2, progress=False, judge_llm=judge, judge_options=options)


def test_judged_runs_never_share_a_cache_with_unjudged_or_other_judges(tmp_path):
    plain = _run(tmp_path)
    a = _run(tmp_path, JudgeLLM("judge-a"))
    b = _run(tmp_path, JudgeLLM("judge-b"))
    a_rule = _run(tmp_path, JudgeLLM("judge-a"), {"unparseable": "rule"})
    fps = {plain["fingerprint"], a["fingerprint"], b["fingerprint"], a_rule["fingerprint"]}
    assert len(fps) == 4 and len(list((tmp_path / "run").iterdir())) == 4
    assert plain["benchmarks"]["sample"]["judge_acc"] is None
    m = a["benchmarks"]["sample"]
    # the fake judge agrees with EM on these answers
    assert m["judge_acc"] == pytest.approx(m["em"]) and m["n_judged"] == 4 and m["judge_unparseable"] == 0.0
    man = json.loads((tmp_path / "run" / f"rag-{a['fingerprint']}" / "fingerprint.json").read_text())["manifest"]
    assert man["judge"]["model"]["fingerprint"] == "judge-a" and man["judge"]["options"]["unparseable"] == "zero"
    assert "judge" not in json.loads((tmp_path / "run" / f"rag-{plain['fingerprint']}" / "fingerprint.json").read_text())["manifest"]


def test_judged_records_are_cached_and_resume_without_judging(tmp_path):
    judge = JudgeLLM()
    s1 = _run(tmp_path, judge, limit=4)
    assert judge.calls == 2 and len(judge.prompts) == 4  # one judge call per computed batch of 2
    lines = (tmp_path / "run" / f"rag-{s1['fingerprint']}" / "predictions" / "sample.jsonl").read_text().splitlines()
    assert all(json.loads(x)["llm_verdict"] in ("correct", "incorrect") for x in lines)
    judge2, llm2 = JudgeLLM(), ScriptedLLM()
    s2 = _run(tmp_path, judge2, llm=llm2, limit=6)  # extends the run: only the 2 new questions
    assert s2["fingerprint"] == s1["fingerprint"] and llm2.calls == 1 and len(judge2.prompts) == 2
    assert s2["benchmarks"]["sample"]["n_judged"] == 6


def test_judging_an_unjudged_run_reuses_its_predictions(tmp_path):
    plain = _run(tmp_path, limit=4)
    llm, judge = ScriptedLLM(), JudgeLLM()
    judged = _run(tmp_path, judge, llm=llm, limit=6)  # 4 predictions reused, 2 computed, all 6 judged
    assert len(llm.prompts) == 2 and len(judge.prompts) == 6  # rag: one prompt per computed question
    m = judged["benchmarks"]["sample"]
    assert m["computed"] == 2 and m["n_judged"] == 6 and judged["fingerprint"] != plain["fingerprint"]

    def read(summary):
        path = tmp_path / "run" / f"rag-{summary['fingerprint']}" / "predictions" / "sample.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()]

    old, new = {r["id"]: r for r in read(plain)}, {r["id"]: r for r in read(judged)}
    assert all(new[i]["prediction"] == old[i]["prediction"] and new[i]["fingerprint"] == judged["fingerprint"]
               for i in old)
    assert all("llm_verdict" in r for r in new.values()) and not any("llm_verdict" in r for r in old.values())


def test_unparseable_policy_in_a_run(tmp_path):
    def weird(examples):
        return [{"id": e.id, "prediction": "weird" if i % 2 else e.golden_answers[0], "golden_answers": e.golden_answers,
                 "retrieved_ids": [], "search_calls": 0, "turns": 1, "generated_tokens": 1, "wall_s": 0.0}
                for i, e in enumerate(examples)]

    kw = {"top_k": 1, "batch_size": 4, "progress": False, "method_fn": weird}
    zero = run_benchmarks(["sample"], "rag", 4, 0, tmp_path, ScriptedLLM(), KeywordRetriever(PASSAGES), AgentConfig(),
                          judge_llm=JudgeLLM(), **kw)["benchmarks"]["sample"]
    assert zero["judge_acc"] == 0.5 and zero["judge_unparseable"] == 0.5
    with pytest.raises(ValueError, match="unparseable"):
        _run(tmp_path, JudgeLLM(), {"unparseable": "maybe"})
    with pytest.raises(ValueError, match="unknown judge option"):
        _run(tmp_path, JudgeLLM(), {"temperature": 1.0})
    # a bad fallback metric or verdict length fails before any prediction is computed (not after a batch)
    for bad in ({"fallback_metric": "bleu"}, {"max_new_tokens": 0}):
        llm = ScriptedLLM()
        with pytest.raises(ValueError, match=next(iter(bad))):
            _run(tmp_path, JudgeLLM(), bad, llm=llm)
        assert llm.calls == 0
    with pytest.raises(ValueError, match="without a judge_llm"):
        _run(tmp_path, None, {"unparseable": "rule"})


def test_summary_postfix_and_report_show_the_judge_only_when_present(tmp_path):
    plain = _run(tmp_path)
    assert "LLM-judge" not in format_summary(plain)
    judged = _run(tmp_path, JudgeLLM())
    table = format_summary(judged)
    assert "| LLM-judge | unparseable |" in table.splitlines()[0] and "| sample | 4 |" in table
    assert "judge" in _live_postfix([{"prediction": "a", "golden_answers": ["a"], "llm_correct": 1.0}])
    assert "judge" not in _live_postfix([{"prediction": "a", "golden_answers": ["a"]}])

    plain_dir = tmp_path / "run" / f"rag-{plain['fingerprint']}"
    md = write_report([plain_dir], tmp_path / "rep_plain")["markdown"].read_text()
    assert "LLM-judge" not in md and "## EM (%)" in md
    paths = write_report([plain_dir, tmp_path / "run" / f"rag-{judged['fingerprint']}"], tmp_path / "rep")
    md = paths["markdown"].read_text()
    assert "## LLM-judge accuracy (%)" in md and "*unparseable verdicts*" in md
    rep = json.loads(paths["json"].read_text())
    labels = rep["methods"]
    assert rep["judge_acc"]["sample"][labels[0]] is None and rep["judge_acc"]["sample"][labels[1]] is not None
    assert md.index("## cover-EM") < md.index("## LLM-judge") < md.index("## Efficiency")


def test_cli_judge_model(tmp_path, monkeypatch, capsys):
    from sleuth import pipeline
    from sleuth.commands import evaluate

    judge = JudgeLLM("cli-judge")
    loaded = []

    def fake_load_llm(cfg, model_path=None, **kw):
        loaded.append(model_path)
        return judge if model_path == "my-judge" else ScriptedLLM()

    monkeypatch.setattr(pipeline, "load_llm", fake_load_llm)
    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: KeywordRetriever(PASSAGES))
    p = argparse.ArgumentParser()
    evaluate.add_arguments(p)
    args = p.parse_args(["--benchmarks", "sample", "--method", "search_o1", "--limit", "2", "--judge-model", "my-judge",
                         "--out", str(tmp_path / "ev"), "eval.judge_unparseable=rule", f"out_dir={tmp_path}"])
    assert evaluate.run(args) == 0
    assert loaded == [None, "my-judge"] and len(judge.prompts) >= 1
    (summary_path,) = (tmp_path / "ev").glob("search_o1-*/summary.json")
    s = json.loads(summary_path.read_text())
    assert s["benchmarks"]["sample"]["n_judged"] == 2
    man = json.loads((summary_path.parent / "fingerprint.json").read_text())["manifest"]
    assert man["judge"]["options"]["unparseable"] == "rule" and man["judge"]["model"]["files"] == {"name": "my-judge"}


def test_cli_judge_model_on_the_agent_path(tmp_path, monkeypatch, capsys):
    """``sleuth eval --judge-model`` without ``--benchmarks``: the agent's trajectories are judged and the
    summary JSON carries ``judge_acc``, ``n_judged`` and ``judge_unparseable``."""
    from sleuth import pipeline
    from sleuth.commands import evaluate

    judge = JudgeLLM("cli-judge")
    monkeypatch.setattr(pipeline, "load_llm", lambda cfg, model_path=None, **kw: judge if model_path == "my-judge" else ScriptedLLM())
    monkeypatch.setattr(pipeline, "open_retriever", lambda cfg, index=None: KeywordRetriever(PASSAGES))
    p = argparse.ArgumentParser()
    evaluate.add_arguments(p)
    args = p.parse_args(["--limit", "3", "--judge-model", "my-judge", "--out", str(tmp_path / "ev"), f"out_dir={tmp_path}"])
    assert evaluate.run(args) == 0
    (path,) = (tmp_path / "ev").glob("agent-*/summary.json")
    (s,) = json.loads(path.read_text())["benchmarks"].values()
    assert s["n_judged"] == 3 and 0.0 <= s["judge_acc"] <= 1.0
    assert 1 <= len(judge.prompts) <= 3 and "LLM-judge accuracy (my-judge)" in capsys.readouterr().out
