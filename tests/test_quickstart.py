"""`sleuth quickstart`'s two stages: the HotpotQA sample, then the synthetic multi-hop task where RL learns.
The parts are tested here on their own (config, SFT questions, tables, bootstrap interval, the order of the
stages and the final printout with the stages faked); the synthetic stage runs for real, on a small budget,
in the slow test at the end."""

from __future__ import annotations

import pytest

from agent.trajectory import Trajectory
from corpora.formats import QAExample


def _traj(hops: int, em: float, searches: int) -> Trajectory:
    from agent.trajectory import Turn

    t = Trajectory(question_id=f"q{hops}", question="?", golden_answers=["a"], metadata={"hops": hops})
    t.turns = [Turn(index=i + 1, text="", action="search", query="x") for i in range(searches)]
    t.verdict = {"em": em}
    return t


def test_synthetic_config_lives_under_the_quickstart_out_dir_unless_told_otherwise(tmp_path):
    from sleuth.commands.quickstart import SYNTHETIC_CONFIG, synthetic_config
    from sleuth.config import ConfigError, load_config

    cfg = load_config("configs/quickstart.yaml", [f"out_dir={tmp_path / 'qs'}"])
    syn = synthetic_config(cfg, SYNTHETIC_CONFIG, [])
    out = tmp_path / "qs" / "synthetic"
    assert syn.out_dir == str(out) and syn.retrieval.index_dir == str(out / "index")
    assert (syn.data.corpus, syn.data.train, syn.data.test) == tuple(str(out / "data" / f"{k}.jsonl")
                                                                     for k in ("corpus", "train", "test"))
    # the recipe of bench/learning.py's winning estimator, at the quickstart's budget
    alg = syn.train.algorithm
    assert (alg.adv_estimator, syn.train.steps, alg.ppo_epochs, syn.train.optim.lr) == ("evidence_igpo", 120, 2, 5e-4)
    assert (syn.train.rollout.questions_per_step, syn.train.rollout.group_size, syn.retrieval.top_k) == (8, 8, 1)
    assert (syn.sft.epochs, syn.sft.max_examples, syn.policy.tiny.hidden_size) == (80, 60, 64)
    # overrides: out_dir moves data and index with it; an explicit index or data path is kept
    syn = synthetic_config(cfg, SYNTHETIC_CONFIG, [f"out_dir={tmp_path / 'elsewhere'}", "train.steps=5"])
    assert syn.train.steps == 5 and syn.data.test == str(tmp_path / "elsewhere" / "data" / "test.jsonl")
    syn = synthetic_config(cfg, SYNTHETIC_CONFIG, ["retrieval.index_dir=idx", "data.test=t.jsonl"])
    assert syn.retrieval.index_dir == "idx" and syn.data.test == "t.jsonl" and syn.data.corpus is None
    with pytest.raises(ConfigError, match="train.stepz"):
        synthetic_config(cfg, SYNTHETIC_CONFIG, ["train.stepz=5"])


def test_sft_questions_show_every_hop_class_equally_on_the_synthetic_task():
    from sleuth.pipeline import sft_questions

    syn = [QAExample(f"s{i}", "?", ["a"], {"hops": h, "chain": ["x"] * (h + 1)})
           for i, h in enumerate([1, 1, 2, 3, 1, 2, 2, 3, 3, 1])]
    assert [q.id for q in sft_questions(syn, 6)] == ["s0", "s1", "s2", "s5", "s3", "s7"]  # 2 per class, by class
    assert [q.id for q in sft_questions(syn, 2)] == ["s0", "s2", "s3"]  # at least one of each
    assert len(sft_questions(syn, None)) == 10
    hotpot = [QAExample(f"h{i}", "?", ["a"], {"hops": 2}) for i in range(5)]  # no chain: the first ones
    assert [q.id for q in sft_questions(hotpot, 3)] == ["h0", "h1", "h2"] and len(sft_questions(hotpot, None)) == 5
    assert sft_questions([], 3) == []


def test_paired_interval_is_the_mean_difference_with_a_bootstrap_band():
    from sleuth.commands.quickstart import paired_interval

    assert paired_interval([0.0] * 10, [1.0] * 10) == (1.0, 1.0, 1.0)  # no spread: the band is the mean
    d, lo, hi = paired_interval([0.0] * 50 + [1.0] * 50, [1.0] * 50 + [0.0] * 50)
    assert d == 0.0 and -0.25 < lo < -0.1 and 0.1 < hi < 0.25  # +-1 per question: sd 1, 95% ~ +-0.196
    d, lo, hi = paired_interval([0.0] * 90, [1.0] * 30 + [0.0] * 60)
    assert d == pytest.approx(1 / 3) and 0.2 < lo < d < hi < 0.45
    assert paired_interval([0.0, 1.0], [1.0, 1.0], seed=3) == paired_interval([0.0, 1.0], [1.0, 1.0], seed=3)
    with pytest.raises(ValueError, match="equally long"):
        paired_interval([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="non-empty"):
        paired_interval([], [])


def test_hop_table_gives_em_and_searches_per_hop_class_before_and_after():
    from sleuth.commands.quickstart import hop_table

    before = [_traj(1, 1.0, 1), _traj(1, 0.0, 1), _traj(2, 0.0, 2), _traj(3, 0.0, 2)]
    after = [_traj(1, 1.0, 1), _traj(1, 1.0, 1), _traj(2, 1.0, 2), _traj(3, 0.0, 3)]
    table, numbers = hop_table(before, after)
    assert table.splitlines() == [
        "| hop class | n | EM after SFT | EM after RL | searches after SFT | searches after RL |",
        "|---|---|---|---|---|---|",
        "| 1-hop | 2 | 50.0 | 100.0 | 1.00 | 1.00 |",
        "| 2-hop | 1 | 0.0 | 100.0 | 2.00 | 2.00 |",
        "| 3-hop | 1 | 0.0 | 0.0 | 2.00 | 3.00 |",
        "| all | 4 | 25.0 | 75.0 | 1.50 | 1.75 |"]
    assert numbers["all"] == {"n": 4, "em_sft": 0.25, "em_rl": 0.75, "searches_sft": 1.5, "searches_rl": 1.75}


def _fake_stages(monkeypatch, calls: list, threads: list | None = None):
    import torch

    import sleuth.commands.quickstart as qs

    def hotpot(cfg, log, t0):
        calls.append(("hotpotqa", cfg.out_dir))
        (threads if threads is not None else []).append(torch.get_num_threads())
        return "HotpotQA title", "| hotpot table |", "What it proves: hotpot"

    def synthetic(cfg, log):
        calls.append(("synthetic", cfg.out_dir, cfg.train.steps))
        (threads if threads is not None else []).append(torch.get_num_threads())
        return "Synthetic title", "| synthetic table |", "What it proves: synthetic"

    monkeypatch.setattr(qs, "run_hotpotqa", hotpot)
    monkeypatch.setattr(qs, "run_synthetic", synthetic)


def test_quickstart_runs_both_stages_and_prints_both_tables(tmp_path, monkeypatch, capsys):
    import torch

    from sleuth.cli import main

    calls: list = []
    threads: list = []
    _fake_stages(monkeypatch, calls, threads)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["quickstart", f"out_dir={tmp_path}", "train.steps=3", "synthetic.train.steps=7"]) == 0
        assert threads == [1, 1] and torch.get_num_threads() == 2  # one torch thread in both stages, then restored
    finally:
        torch.set_num_threads(before)
    assert calls == [("hotpotqa", str(tmp_path)), ("synthetic", str(tmp_path / "synthetic"), 7)]
    out = capsys.readouterr().out
    assert out.index("| hotpot table |") < out.index("What it proves: hotpot") < out.index("| synthetic table |") \
        < out.index("What it proves: synthetic")
    calls.clear()
    assert main(["quickstart", f"out_dir={tmp_path}", "--skip-synthetic"]) == 0
    assert calls == [("hotpotqa", str(tmp_path))] and "synthetic table" not in capsys.readouterr().out
    calls.clear()  # a bad key of the synthetic stage is refused before the first stage runs
    assert main(["quickstart", f"out_dir={tmp_path}", "synthetic.train.stepz=1"]) == 2
    assert calls == [] and "train.stepz" in capsys.readouterr().err


@pytest.mark.slow
def test_the_synthetic_stage_end_to_end_on_a_small_budget(tmp_path, monkeypatch):
    """The real stage: task v1 written, index, the tiny policy, the chain-oracle SFT, evaluation, RL
    (evidence_igpo), evaluation; results.md / results.json; a second run reuses every stage."""
    import json

    from sleuth.commands.quickstart import SYNTHETIC_CONFIG, run_synthetic, synthetic_config
    from sleuth.config import load_config

    cfg = load_config("configs/quickstart.yaml", [f"out_dir={tmp_path}"])
    syn = synthetic_config(cfg, SYNTHETIC_CONFIG, ["sft.epochs=2", "train.steps=2", "train.questions_per_step=2",
                                                   "train.group_size=2", "train.save_every=1"])
    logs: list[str] = []
    title, table, proves = run_synthetic(syn, logs.append)
    out = tmp_path / "synthetic"
    assert (out / "data" / "test.jsonl").exists() and (out / "sft" / "config.json").exists()
    assert (out / "evidence_igpo" / "checkpoints" / "step_000002").is_dir()
    result = json.loads((out / "results.json").read_text())
    assert set(result["by_hops"]) == {"1-hop", "2-hop", "3-hop", "all"} and result["by_hops"]["all"]["n"] == 90
    assert sum(result["by_hops"][f"{h}-hop"]["n"] for h in (1, 2, 3)) == 90
    assert (out / "results.md").read_text() == table + "\n" and "2 evidence_igpo steps" in title
    assert "paired bootstrap interval" in proves and result["cpu_s"] > 0
    sft_oracle = [json.loads(x) for x in (out / "oracle_trajectories.jsonl").read_text().splitlines()]
    assert len(sft_oracle) == 60 and all(t["verdict"]["em"] == 1.0 for t in sft_oracle)
    logs.clear()
    run_synthetic(syn, logs.append)  # reuses data, index, SFT and the finished RL run
    assert any("SFT: reusing" in m for m in logs) and not any("writing the synthetic" in m for m in logs)
