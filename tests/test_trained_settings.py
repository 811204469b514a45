"""A model knows how it was trained: the agent and retrieval settings are saved beside the weights (every
checkpoint, the SFT model) and ``sleuth ask/eval/serve --model DIR`` run it under them, unless a setting is
given explicitly (used, with a warning naming it); without a model, the commands say the policy is untrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.config import load_config
from sleuth.trained_settings import (
    save_trained_settings,
    settings_of,
    untrained_note,
    with_trained_settings,
)
from tests.conftest import PASSAGES, QUESTIONS
from training.infra.checkpoint import SETTINGS_FILE, read_settings

QUICK = ["agent.max_doc_chars=100", "agent.max_new_tokens=40", "agent.max_total_tokens=768", "agent.max_turns=3",
         "retrieval.top_k=2", "agent.protocol=function_call", "agent.short_prompt=false", "agent.reward=f1"]


def trained_dir(tmp_path: Path, overrides=QUICK) -> Path:
    d = tmp_path / "model"
    save_trained_settings(load_config(None, overrides), d)
    return d


def test_the_settings_saved_are_the_agents_and_retrievals_not_where_it_runs(tmp_path):
    cfg = load_config(None, [*QUICK, "agent.backend.kind=openai", "agent.judge=llm", "retrieval.method=simulated",
                             "eval.temperature=0.5", "retrieval.index_dir=elsewhere"])
    s = settings_of(cfg)
    assert s["agent"]["max_doc_chars"] == 100 and s["agent"]["protocol"] == "function_call"
    assert s["agent"]["external_timeout_s"] == 120.0 and s["agent"]["kind"] == "builtin"
    assert not {"backend", "simulator", "judge", "llm_judge", "max_batch"} & set(s["agent"])
    assert s["retrieval"] == {"top_k": 2} and s["eval"] == {"temperature": 0.5}  # no simulated search to evaluate with
    assert read_settings(save_trained_settings(cfg, tmp_path / "m").parent) == json.loads(json.dumps(s))


def test_a_model_brings_its_settings_and_an_explicit_one_wins_with_a_warning(tmp_path):
    model = trained_dir(tmp_path)
    said: list[str] = []
    cfg = with_trained_settings(load_config(None, ["agent.max_new_tokens=64", "agent.max_doc_chars=100"]), model,
                                said.append)
    assert (cfg.agent.max_doc_chars, cfg.agent.max_total_tokens, cfg.agent.max_turns) == (100, 768, 3)
    assert (cfg.retrieval.top_k, cfg.agent.protocol, cfg.agent.short_prompt) == (2, "function_call", False)
    assert cfg.agent.max_new_tokens == 64  # given explicitly: used as given ...
    (applied, warning) = said  # ... and named, with the trained value; an explicit equal value is no warning
    assert applied.startswith(f"using the settings {model} was trained with ({SETTINGS_FILE}): ")
    assert "agent.max_total_tokens=768" in applied and "agent.max_new_tokens" not in applied
    assert warning.startswith("warning: agent.max_new_tokens=64 as given, but") and "agent.max_new_tokens=40" in warning
    # a dense model nobody chose stays unchosen (an index is then searched with the model it was built with)
    assert cfg.retrieval.chosen_dense_model() is None and cfg.retrieval.index_dir == "runs/index"
    # the settings of a config file count as explicit too
    conf = tmp_path / "c.yaml"
    conf.write_text("agent:\n  max_doc_chars: 300\n")
    said.clear()
    cfg = with_trained_settings(load_config(conf, []), model, said.append)
    assert cfg.agent.max_doc_chars == 300 and cfg.agent.max_new_tokens == 40
    assert any(m.startswith("warning: agent.max_doc_chars=300 as given") for m in said)


def test_no_settings_file_leaves_the_config_and_a_damaged_one_is_named(tmp_path):
    cfg = load_config(None, [])
    said: list[str] = []
    assert with_trained_settings(cfg, tmp_path, said.append) is cfg and said == []
    assert with_trained_settings(cfg, "Qwen/Qwen2.5-3B-Instruct", said.append) is cfg  # a hub id
    (tmp_path / SETTINGS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{SETTINGS_FILE} does not parse"):
        with_trained_settings(cfg, tmp_path)
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({"agent": {"max_turns": 0}}))
    with pytest.raises(ValueError, match="holds settings this version does not take .*max_turns"):
        with_trained_settings(cfg, tmp_path)
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({"agent": {"a_key_of_a_later_version": 1, "max_turns": 2}}))
    assert with_trained_settings(cfg, tmp_path, said.append).agent.max_turns == 2


def test_the_untrained_note_names_the_trained_checkpoint_when_there_is_one(tmp_path):
    cfg = load_config(None, [f"out_dir={tmp_path}"])
    note = untrained_note(cfg, None)
    assert note.startswith("note: no --model given (nor policy.model): this is the untrained tiny policy")
    assert "train one with `sleuth quickstart`" in note
    ckpts = tmp_path / "grpo" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "latest").write_text("step_000002")
    assert untrained_note(cfg, None).endswith(f"for the trained one pass --model {ckpts / 'latest'}")
    assert untrained_note(cfg, "some/model") is None
    assert untrained_note(load_config(None, ["policy.model=x"]), None) is None


@pytest.fixture()
def split_data(tmp_path):
    """The fixture corpus with train and test questions that do not overlap (the quickstart checks)."""
    from corpora.formats import write_jsonl

    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "corpus.jsonl", PASSAGES)
    write_jsonl(d / "train.jsonl", QUESTIONS[2:])
    write_jsonl(d / "test.jsonl", QUESTIONS[:2])
    return d


TINY = ["policy.tiny.vocab_size=400", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1",
        "policy.tiny.num_heads=2", "policy.tiny.num_kv_heads=1", "policy.tiny.intermediate_size=64"]


def test_eval_of_a_checkpoint_without_a_config_reproduces_the_quickstarts_own_table(split_data, tmp_path, capsys):
    """The quickstart (its config: max_doc_chars 100, max_new_tokens 40, ...), shortened; then ``sleuth eval
    --qa test --model <its GRPO checkpoint>`` with no config at all scores the same numbers as the quickstart's
    own after-GRPO evaluation (greedy: the same episodes, token for token in count), because the checkpoint
    carries the settings."""
    from sleuth.cli import main

    out = tmp_path / "qs"
    common = [f"data.corpus={split_data / 'corpus.jsonl'}", f"data.train={split_data / 'train.jsonl'}",
              f"data.test={split_data / 'test.jsonl'}", f"retrieval.index_dir={tmp_path / 'index'}", *TINY]
    # the HotpotQA stages only: the synthetic stage's own policy and checkpoints are not what is checked here
    assert main(["quickstart", "--skip-synthetic", "--config", "configs/quickstart.yaml", f"out_dir={out}", *common,
                 "sft.epochs=1", "train.steps=2", "train.rollout.questions_per_step=2", "train.rollout.group_size=2",
                 "train.checkpoints.save_every=1", "eval.limit=2"]) == 0
    ckpt = out / "grpo" / "checkpoints" / "step_000002"
    for d in (ckpt, out / "grpo" / "checkpoints" / "step_000001", out / "sft"):
        assert read_settings(d)["agent"]["max_doc_chars"] == 100, d
    assert read_settings(ckpt)["agent"]["max_new_tokens"] == 40
    own = json.loads((out / "eval" / "after GRPO.json").read_text())
    capsys.readouterr()
    assert main(["eval", "--qa", str(split_data / "test.jsonl"), "--model", str(out / "grpo" / "checkpoints" / "latest"),
                 "--index", str(tmp_path / "index"), "--out", str(tmp_path / "ev")]) == 0
    err = capsys.readouterr().err
    assert "agent.max_doc_chars=100" in err and "agent.max_new_tokens=40" in err and "warning" not in err
    (run,) = [p for p in (tmp_path / "ev").iterdir() if p.is_dir()]
    (got,) = json.loads((run / "summary.json").read_text())["benchmarks"].values()
    for key in ("n", "em", "f1", "search_calls", "turns", "generated_tokens"):
        assert got[key] == pytest.approx(own[key]), key
    # an explicit setting that differs is used, and named
    assert main(["eval", "--qa", str(split_data / "test.jsonl"), "--model", str(ckpt), "--index",
                 str(tmp_path / "index"), "--out", str(tmp_path / "ev2"), "agent.max_doc_chars=50"]) == 0
    assert "warning: agent.max_doc_chars=50 as given, but" in capsys.readouterr().err


def test_ask_without_a_model_says_the_policy_is_untrained(bm25_index, tmp_path, capsys):
    from sleuth.cli import main

    assert main(["ask", "What is the capital of France?", "--index", str(bm25_index), f"out_dir={tmp_path}", *TINY,
                 "agent.max_new_tokens=4", "agent.max_turns=1"]) == 0
    err = capsys.readouterr().err
    assert "note: no --model given (nor policy.model): this is the untrained tiny policy" in err
