"""The whole path through the CLI, as a user runs it: index -> train (SFT + GRPO) -> resume -> eval -> ask."""

from __future__ import annotations

import json

import pytest

from sleuth.cli import main

pytestmark = pytest.mark.slow


def test_cli_end_to_end(tiny_data, tmp_path, capsys):
    idx, out = tmp_path / "index", tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"""
out_dir: {out}
data: {{corpus: {tiny_data / 'corpus.jsonl'}, train: {tiny_data / 'train.jsonl'}, test: {tiny_data / 'test.jsonl'}}}
retrieval: {{index_dir: {idx}, top_k: 2, build_dense: false}}
policy:
  tiny: {{vocab_size: 400, hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}}
agent: {{max_turns: 2, max_new_tokens: 16, max_total_tokens: 256, format_reward: 0.1}}
sft: {{epochs: 2, batch_size: 4}}
train: {{steps: 2, questions_per_step: 2, group_size: 2, save_every: 1}}
""")
    assert main(["index", "--corpus", str(tiny_data / "corpus.jsonl"), "--out", str(idx), "--no-dense"]) == 0
    assert main(["search", "designer of the Eiffel Tower", "-k", "2", "--index", str(idx)]) == 0
    assert "Eiffel" in capsys.readouterr().out
    assert main(["train", "--config", str(cfg)]) == 0
    metrics = (out / "grpo" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2 and "reward" in json.loads(metrics[0])
    # a second run without --resume refuses to overwrite; with --resume and more steps it continues
    assert main(["train", "--config", str(cfg)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["train", "--config", str(cfg), "--resume", "train.steps=3"]) == 0
    assert len((out / "grpo" / "metrics.jsonl").read_text().splitlines()) == 3
    ckpt = out / "grpo" / "checkpoints" / "step_000003"
    assert (ckpt / "config.json").exists()
    capsys.readouterr()
    assert main(["eval", "--config", str(cfg), "--model", str(ckpt)]) == 0
    (run,) = (out / "eval").glob("agent-*")
    (summary,) = json.loads((run / "summary.json").read_text())["benchmarks"].values()
    assert summary["n"] == 2 and 0.0 <= summary["em"] <= 1.0 and "| EM | F1 |" in capsys.readouterr().out
    assert len(list(run.glob("*.trajectories.jsonl"))) == 1  # the agent's episodes beside its predictions
    assert main(["ask", "What is the capital of France?", "--config", str(cfg), "--model", str(ckpt)]) == 0
    assert "answer:" in capsys.readouterr().out
