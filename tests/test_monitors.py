"""Training-health monitors: degeneracy score, tag faults, per-hop/per-dataset search stats, alarms,
best-checkpoint on a stop alarm, and the PNG dashboard (``sleuth dashboard``)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from agent.trajectory import Trajectory, Turn
from training.infra.monitors import (
    PHASES,
    Alarms,
    degeneracy_score,
    health_stats,
    malformed_tags,
    marked_timer,
    plot_dashboard,
    read_metrics,
    repeated_ngram_fraction,
)


def traj(texts, actions, hops=None, dataset=None, em=0.0, ok=True):
    t = Trajectory("q", "q", metadata={k: v for k, v in (("hops", hops), ("dataset", dataset)) if v is not None})
    t.turns = [Turn(index=i + 1, text=x, action=a) for i, (x, a) in enumerate(zip(texts, actions))]
    t.verdict = {"em": em, "format_ok": ok}
    t.stop_reason = "answer"
    return t


def test_repeated_ngrams():
    assert repeated_ngram_fraction(["a", "b", "c", "d", "e"]) == 0.0
    assert repeated_ngram_fraction(["x", "y", "z", "x", "y", "z", "x", "y", "z"]) == pytest.approx(1 - 3 / 7)
    assert repeated_ngram_fraction(["a"]) == 0.0


def test_malformed_tags():
    assert malformed_tags("<think> ok </think> <search> q </search>") == 0
    assert malformed_tags("<think> unclosed <search> q </search>") == 1
    assert malformed_tags("</answer> stray") == 1
    assert malformed_tags("<sear q") == 1
    assert malformed_tags("<foo> x </foo>") == 2  # unknown tag, opened and closed


def test_degeneracy_score_orders_clean_below_broken():
    clean = traj(["<think> find the town </think> <search> Kalo </search>", "<answer> Rutevo </answer>"],
                 ["search", "answer"])
    loop = traj(["<think> the the the the the the the the </think> <think> <think>"], ["invalid"])
    assert degeneracy_score(clean) == 0.0
    assert degeneracy_score(loop) > 0.5


def test_clean_turns_of_the_self_judge_and_function_call_protocols_have_no_tag_faults():
    """ReSeek's ``<judge>`` (agent.self_judge) and Qwen2.5's ``<tool_call>`` (agent.protocol=function_call) are
    protocol tags: a well-formed turn of either protocol is no fault, so a clean trajectory scores 0."""
    judged = traj(["<think> first </think> <search> Kalo </search>",
                   "<judge> useful </judge> <think> so </think> <answer> Rutevo </answer>"], ["search", "answer"])
    call = '<think> look it up </think>\n<tool_call>\n{"name": "search", "arguments": {"query": "Kalo"}}\n</tool_call>'
    called = traj([call, "<answer> Rutevo </answer>"], ["search", "answer"])
    assert malformed_tags("<judge> not useful </judge> <answer> x </answer>") == 0
    assert degeneracy_score(judged) == 0.0
    assert degeneracy_score(called) == 0.0
    assert malformed_tags("<tool_call> {} ") == 1  # unclosed: still a fault


def test_health_stats_split_by_hops_and_dataset():
    ts = [traj(["<search> a </search>", "<answer> x </answer>"], ["search", "answer"], hops=1, dataset="hotpotqa", em=1.0),
          traj(["<search> a </search>", "<search> b </search>", "<answer> y </answer>"], ["search", "search", "answer"],
               hops=2, dataset="hotpotqa"),
          traj(["junk"], ["invalid"], hops=2, dataset="nq", ok=False)]
    s = health_stats(ts)
    assert s["format_ok"] == pytest.approx(2 / 3)
    assert s["search_calls"] == pytest.approx(1.0)
    assert s["search_calls/hops=1"] == 1.0 and s["search_calls/hops=2"] == 1.0
    assert s["search_calls/dataset=hotpotqa"] == 1.5 and s["search_calls/dataset=nq"] == 0.0
    assert s["em/hops=1"] == 1.0 and s["em/hops=2"] == 0.0


def test_alarms_need_patience_and_stop():
    a = Alarms(min_format_ok=0.5, min_entropy=0.1, patience=2, action="stop")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert a.check(1, {"format_ok": 0.4, "entropy": 1.0}) == []
        assert a.check(2, {"format_ok": 0.9, "entropy": 1.0}) == []  # recovered: counter resets
        assert a.check(3, {"format_ok": 0.4, "entropy": 1.0}) == []
        fired = a.check(4, {"format_ok": 0.3, "entropy": 0.05})
    assert len(fired) == 1 and "format_ok" in fired[0] and not a.should_stop is False
    assert a.should_stop
    assert any("training-health alarm" in str(x.message) for x in w)
    warn = Alarms(min_entropy=0.1, patience=1, action="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert warn.check(1, {"entropy": 0.01}) and not warn.should_stop


def test_dashboard_png_and_cli(tmp_path):
    recs = [{"step": s, "reward": 0.1 * s, "em": 0.1, "format_ok": 1 - 0.1 * s, "degeneracy": 0.01 * s,
             "search_calls": 1.0, "search_calls/hops=2": 1.5, "response_tokens": 20, "entropy": 1.0 / s,
             "clip_frac": 0.01, "approx_kl": 0.001, **({"alarms": ["x"]} if s == 3 else {})} for s in (1, 2, 3)]
    recs.append({**recs[1], "reward": 9.0})  # a repeated step (after a resume): the last record wins
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3] and read_metrics(tmp_path)[1]["reward"] == 9.0
    png = plot_dashboard(tmp_path)
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from sleuth.cli import main

    out = tmp_path / "d.png"
    assert main(["dashboard", str(tmp_path), "--out", str(out)]) == 0 and out.exists()
    assert main(["dashboard", str(tmp_path / "missing")]) == 2


def test_stop_alarm_keeps_best_checkpoint(tiny_policy_dir, retriever, tmp_path):
    """An entropy alarm with action=stop ends the run early; checkpoints/best holds the best-eval weights."""
    from tests.conftest import run_rl
    from tests.test_trainer import load, make_cfg, varying_judge

    model, tok = load(tiny_policy_dir)
    scores = iter([0.5, 0.2, 0.1, 0.0])
    cfg = make_cfg("train.steps=4", "train.monitoring.eval_every=1", "train.monitoring.alarms.min_entropy=100", "train.monitoring.alarms.patience=2",
                   "train.monitoring.alarms.action=stop", "train.checkpoints.save_every=10")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run_rl(cfg, model, tok, retriever, [__import__("tests.conftest").conftest.QUESTIONS[0]], tmp_path,
                       judge=varying_judge, evaluate=lambda m: {"em": next(scores)})
    assert out["stopped"] and out["last"]["alarms"]
    best = json.loads((tmp_path / "checkpoints" / "best" / "best.json").read_text())
    assert best == {"from": "step_000001", "metric": 0.5}
    assert len(read_metrics(tmp_path)) == 2  # stopped after the second step


def test_read_metrics_ignores_a_torn_last_line(tmp_path):
    """A run killed mid-append (or still writing) leaves a last line without its newline: the dashboard reads
    the complete records; a broken line before the last still raises."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    assert read_metrics(tmp_path) == [{"step": 1, "reward": 0.5}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rew\n{"step": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(tmp_path)


def test_alarm_patience_and_nonfinite_count_survive_a_resume(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """1 step + resume stops where an uninterrupted run does: the alarm's count of steps below the threshold
    (and the count of skipped non-finite steps) is checkpointed, not restarted at 0."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import load, make_cfg, varying_judge
    from training.infra.checkpoint import latest_checkpoint

    over = ("train.monitoring.alarms.min_entropy=100", "train.monitoring.alarms.patience=2", "train.monitoring.alarms.action=stop")
    model, tok = load(tiny_policy_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_rl(make_cfg("train.steps=1", *over), model, tok, retriever, QUESTIONS[:2], tmp_path,
                 judge=varying_judge)
        state = json.loads((latest_checkpoint(tmp_path) / "trainer_state.json").read_text())
        assert state["alarms_below"] == {"entropy": 1} and state["nonfinite"] == 0
        model, tok = load_model_and_tokenizer(str(latest_checkpoint(tmp_path)), device="cpu")
        out = run_rl(make_cfg("train.steps=4", *over), model, tok, retriever, QUESTIONS[:2], tmp_path,
                       resume=True, judge=varying_judge)
    assert out["stopped"] and [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_truncated_judge_and_tool_call_tags_are_faults():
    """A cut ``</judge`` or ``<tool_call`` (no ``>``) was no fault: the truncated-name check knew only the
    Search-R1 tags, though ReSeek's judge tag and the function-call tag are known tags too."""
    assert malformed_tags("<judge>useful</judge>") == 0
    assert malformed_tags("<judge>useful</judge") == 2  # the cut closing tag, and <judge> left open
    assert malformed_tags("<tool_call") == 1 and malformed_tags("<judg") == 1


def test_the_dashboard_draws_the_time_of_every_phase(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    recs = [{"step": s, "reward": 0.1, **{f"timing/{p}_s": 0.1 * s + i for i, p in enumerate(PHASES)}} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to read it back
    plot_dashboard(tmp_path)
    (ax,) = [a for a in figs[0].axes if a.get_title() == "time per phase (s)"]
    assert [line.get_label() for line in ax.get_lines()] == [f"timing/{p}_s" for p in PHASES]
    assert list(ax.get_lines()[-1].get_ydata()) == [r[f"timing/{PHASES[-1]}_s"] for r in recs]


def test_marked_timer_adds_up_a_phase_timed_in_several_blocks_and_times_a_block_that_raised(monkeypatch):
    import training.infra.monitors as M

    clock = iter([10.0, 10.5, 20.0, 20.25, 30.0, 31.0])
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    timing: dict[str, float] = {}
    with marked_timer("log", timing):
        pass
    with marked_timer("log", timing):
        pass
    with pytest.raises(KeyError), marked_timer("update", timing):
        raise KeyError("boom")
    assert timing == {"timing/log_s": 0.75, "timing/update_s": 1.0}


def test_dashboard_of_a_run_directory_points_to_its_grpo_folder(tmp_path, capsys):
    """`sleuth dashboard runs/quickstart` (the run, not its grpo/ folder) said only "is it a training run
    directory?" though it is one; the error names the folder that holds the metrics."""
    from sleuth.cli import main

    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    assert main(["dashboard", str(tmp_path)]) == 2
    assert f"sleuth dashboard {tmp_path / 'grpo'}" in capsys.readouterr().err


def _hop_record(searches: dict[int, float], em: dict[int, float]) -> dict:
    return {**{f"search_calls/hops={h}": v for h, v in searches.items()}, **{f"em/hops={h}": v for h, v in em.items()}}


def test_search_plateau_alarm_fires_on_flat_searches_with_unequal_em():
    a = Alarms(search_flat=0.3, em_gap=0.2, window=3, patience=2)
    flat = _hop_record({1: 2.0, 2: 2.1, 3: 2.0}, {1: 0.9, 2: 0.5, 3: 0.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert a.check(1, dict(flat)) == [] and a.check(2, dict(flat)) == []  # window not full yet
        rec = dict(flat)
        assert a.check(3, rec) == []  # full window, first step of the condition: patience 2
        assert rec["alarm/hop_search_spread"] == pytest.approx(0.1) and rec["alarm/hop_em_spread"] == pytest.approx(0.9)
        fired = a.check(4, dict(flat))
    assert len(fired) == 1 and "search plateau" in fired[0] and "1/2/3" in fired[0]
    # searches that follow the hop count, or classes that succeed alike: no alarm
    for searches, em in (({1: 1.0, 2: 2.0, 3: 3.0}, {1: 0.9, 2: 0.5, 3: 0.0}), ({1: 2.0, 2: 2.0, 3: 2.0}, {1: 0.5, 2: 0.5, 3: 0.45})):
        b = Alarms(search_flat=0.3, em_gap=0.2, window=2, patience=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert [b.check(s, _hop_record(searches, em)) for s in range(1, 6)] == [[]] * 5
    # one hop class only: nothing to compare
    c = Alarms(search_flat=0.3, window=1, patience=1)
    assert c.check(1, _hop_record({2: 2.0}, {2: 0.5})) == []


def test_collapse_alarm_fires_when_the_held_out_metric_falls_below_its_best():
    a = Alarms(collapse_drop=0.1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert a.check(1, {"eval_em": 0.3}) == [] and a.check(2, {"reward": 1.0}) == []  # no eval this step
        assert a.check(3, {"eval_em": 0.5}) == []
        rec = {"eval_em": 0.45}
        assert a.check(4, rec) == [] and rec["alarm/collapse_gap"] == pytest.approx(0.05)  # inside the margin
        fired = a.check(5, {"eval_em": 0.35})
    assert len(fired) == 1 and "collapse" in fired[0] and "0.500 (step 3)" in fired[0]
    assert any("training-health alarm" in str(x.message) for x in w)
    # the best survives a resume
    b = Alarms(collapse_drop=0.1)
    b.restore_signals(json.loads(json.dumps(a.signal_state())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert b.check(6, {"eval_em": 0.38})
    # another metric can be watched, e.g. a held-out reward
    c = Alarms(collapse_drop=0.2, collapse_metric="eval_reward", action="stop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert c.check(1, {"eval_reward": 1.0, "eval_em": 0.0}) == [] and c.check(2, {"eval_reward": 0.7})
    assert c.should_stop


def test_dashboard_marks_plateau_and_collapse_alarms(tmp_path):
    from training.infra.monitors import alarm_kind

    recs = [{"step": s, "reward": 0.5, "search_calls/hops=1": 2.0, "search_calls/hops=2": 2.0, "em/hops=1": 0.8,
             "em/hops=2": 0.1, "alarm/hop_search_spread": 0.0, "alarm/hop_em_spread": 0.7,
             **({"eval_em": 0.6 - 0.1 * s, "alarm/collapse_gap": 0.1 * (s - 1)} if s % 2 else {}),
             **({"alarms": ["step 3: collapse: eval_em 0.300 is 0.200 below its best 0.500 (step 1)",
                            "step 3: search plateau: searches per episode 2.00-2.00 ..."]} if s == 3 else {})}
            for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert plot_dashboard(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [alarm_kind(m) for m in recs[2]["alarms"]] == ["collapse", "search plateau"]
    assert alarm_kind("step 2: entropy 0.010 below 0.1 for 2 steps") == "threshold"


def _format_breaking_judge(traj):
    """The provocation: reward the episodes that never give a valid answer."""
    ok = traj.answer is not None
    return (0.0 if ok else 1.0), {"em": 0.0, "f1": 0.0, "format_ok": ok}


def test_collapse_alarm_fires_on_a_provoked_collapse(tiny_policy_dir, retriever, tmp_path):
    """A real collapse: the tiny policy learns the answer format from oracle trajectories (SFT), then RL with
    a reward for breaking the format at a high learning rate destroys it; the held-out format validity
    (greedy, evaluated every step) falls from its best and the collapse alarm fires and stops the run."""
    from agent.backends.hf import TransformersLLM
    from agent.loop.batch import run_episodes
    from sleuth.config import SFTConfig
    from tests.conftest import PASSAGES, QUESTIONS, run_rl
    from tests.test_trainer import load, make_cfg
    from training.rollout.oracle import OracleLLM
    from training.sft import sft_train

    model, tok = load(tiny_policy_dir)
    cfg = make_cfg("train.steps=8", "train.monitoring.eval_every=1", "train.optim.lr=2e-3", "train.rollout.group_size=4",
                   "train.rollout.questions_per_step=4", "train.monitoring.alarms.collapse_drop=0.3",
                   "train.monitoring.alarms.collapse_metric=eval_format_ok", "train.monitoring.alarms.action=stop", "train.checkpoints.save_every=10")
    oracle = OracleLLM(tok, QUESTIONS, {p.id: p.title for p in PASSAGES})
    trajs = [t for t in run_episodes(QUESTIONS, oracle, retriever, cfg.agent, top_k=1, temperature=0.0)
             if t.verdict["format_ok"]]  # the oracle's episodes that fit the two turns
    torch.manual_seed(0)
    sft_train(model, tok, trajs * 8, SFTConfig(epochs=40, lr=1e-2, batch_size=8), seed=0,
              max_len=cfg.agent.max_total_tokens)

    def held_out(m):
        ts = run_episodes(QUESTIONS, TransformersLLM(m, tok), retriever, cfg.agent, top_k=1, temperature=0.0)
        return {"format_ok": sum(float(t.verdict.get("format_ok", False)) for t in ts) / len(ts)}

    assert held_out(model)["format_ok"] >= 0.75  # the warm start answers in the protocol's format

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=_format_breaking_judge,
                     evaluate=held_out)
    recs = read_metrics(tmp_path)
    fired = [m for r in recs for m in r.get("alarms", [])]
    assert out["stopped"] and any("collapse" in m and "eval_format_ok" in m for m in fired)
    assert max(r["alarm/collapse_gap"] for r in recs if "alarm/collapse_gap" in r) > 0.3
