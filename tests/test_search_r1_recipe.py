"""The Search-R1 recipe (configs/search_r1_qwen2.5_3b*.yaml): the configs load with the schema and carry the
reference scripts' settings, and each runs two RL steps on CPU with a tiny stand-in policy, BM25 over the
shipped sample and the transformers backend in place of Qwen2.5-3B, e5 over wiki-18 and vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.config import load_config

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "configs" / "search_r1_qwen2.5_3b.yaml"
PPO = ROOT / "configs" / "search_r1_qwen2.5_3b_ppo.yaml"


def test_recipes_load_with_search_r1s_settings():
    g, p = load_config(GRPO), load_config(PPO)
    for c in (g, p):
        assert (c.policy.model, c.retrieval.method, c.retrieval.dense_model) == \
            ("Qwen/Qwen2.5-3B", "dense", "intfloat/e5-base-v2")
        assert (c.retrieval.top_k, c.agent.max_turns, c.agent.max_new_tokens, c.agent.max_obs_tokens) == (3, 4, 500, 500)
        assert (c.train.optim.lr, c.train.steps, c.train.rollout.questions_per_step, c.train.optim.lr_warmup_steps) == (1e-6, 1005, 512, 286)
        assert c.agent.reward == "em" and not c.sft.enabled and c.train.optim.gradient_checkpointing
    assert (g.train.algorithm.adv_estimator, g.train.rollout.group_size, g.train.algorithm.kl_coef, g.train.algorithm.kl_type, g.train.algorithm.kl_mode) == \
        ("grpo", 5, 0.001, "k3", "loss")
    assert (p.train.algorithm.adv_estimator, p.train.algorithm.critic, p.train.optim.critic_lr, p.train.rollout.group_size, p.train.algorithm.kl_mode) == \
        ("ppo", "separate", 1e-5, 1, "reward")


STAND_IN = ["data.corpus=null", "data.train=null", "data.test=null", "retrieval.method=bm25",
            "retrieval.build_dense=false", "policy.dtype=float32", "agent.backend.kind=transformers",
            "agent.max_new_tokens=16", "agent.max_obs_tokens=48", "agent.max_total_tokens=400", "train.steps=2",
            "train.rollout.questions_per_step=2", "train.checkpoints.save_every=1", "train.monitoring.eval_every=0"]


@pytest.mark.parametrize("config, group", [(GRPO, 2), pytest.param(PPO, 1, marks=pytest.mark.slow)], ids=["grpo", "ppo"])
def test_recipe_runs_two_steps_on_cpu_with_a_tiny_stand_in(config, group, tiny_policy_dir, tmp_path, monkeypatch):
    from sleuth.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    over = [f"out_dir={tmp_path}", f"retrieval.index_dir={tmp_path / 'index'}", f"policy.model={tiny_policy_dir}",
            f"train.rollout.group_size={group}", *STAND_IN]
    assert main(["train", "--config", str(config), *over]) == 0
    cfg = load_config(config, over)
    run = tmp_path / cfg.train.algorithm.adv_estimator
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["lr"] > 0 and s["lr"] < 1e-7 for s in steps)  # warming up from 1e-6 over 286 steps
    assert (run / "checkpoints" / "step_000002").is_dir()


def _wiki18(path: Path, records: list[dict], tar: bool = False) -> Path:
    """wiki-18 as JSONL, gzipped (``.gz``), or with ``tar`` as published: a tar archive (gzipped for ``.gz``)
    whose JSONL member follows another member."""
    import gzip
    import io
    import tarfile

    text = "".join(json.dumps(r) + "\n" for r in records)
    if tar:
        with tarfile.open(path, "w:gz" if path.suffix == ".gz" else "w") as t:
            for name, body in (("data00/README", b"no passages"), ("data00/wiki_dpr_100w/wiki_dump.jsonl",
                                                                     text.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                t.addfile(info, io.BytesIO(body))
    elif path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


WIKI = [{"id": "0", "contents": '"Aaron"\nAaron is a prophet in the Abrahamic religions.'},
        {"id": "1", "contents": '"Ab "Cd""\nA title with quotes of its own.'},
        {"id": "2", "contents": "a passage without a title line"}]


@pytest.mark.parametrize("name,tar", [("wiki-18.jsonl", False), ("wiki-18.jsonl.gz", False),
                                      ("wiki-18.jsonl.gz", True), ("wiki-18.tar", True)])
def test_wiki18_converts_as_it_is_with_the_title_beside(tmp_path, name, tar, capsys):
    """Plain, gzipped, and as published (a gzipped tar holding the JSONL, named wiki-18.jsonl.gz)."""
    from corpora.formats import read_corpus
    from sleuth.cli import main

    src = _wiki18(tmp_path / name, WIKI, tar)
    assert main(["corpus", "--wiki18", str(src), "--out", str(tmp_path / "c.jsonl")]) == 0
    got = read_corpus(tmp_path / "c.jsonl")
    assert [(p.id, p.title) for p in got] == [("0", "Aaron"), ("1", 'Ab "Cd"'), ("2", WIKI[2]["contents"])]
    assert [p.contents for p in got] == [r["contents"] for r in WIKI]  # unchanged: the title line stays
    assert got[0].text == "Aaron is a prophet in the Abrahamic religions."
    out = capsys.readouterr().out
    assert "3 wiki-18 passages" in out and "1 without a title line" in out and "row numbers" in out
    assert main(["corpus", "--wiki18", str(src), "--out", str(tmp_path / "c2.jsonl"), "--limit", "2"]) == 0
    assert len(read_corpus(tmp_path / "c2.jsonl")) == 2


def test_wiki18_bad_record_names_its_line_and_leaves_the_output_alone(tmp_path):
    import tarfile

    from corpora.formats import DataFormatError
    from corpora.wiki18 import convert_wiki18

    out = tmp_path / "c.jsonl"
    out.write_text("kept\n")
    src = _wiki18(tmp_path / "w.jsonl", [WIKI[0], {"id": None, "contents": "x"}])
    with pytest.raises(DataFormatError, match=r"w\.jsonl:2: field 'id'"):
        convert_wiki18(src, out)
    qa = _wiki18(tmp_path / "qa.jsonl", [{"id": "q", "question": "who?", "golden_answers": ["x"]}])
    with pytest.raises(DataFormatError, match="--qa-from"):
        convert_wiki18(qa, out)
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    with pytest.raises(DataFormatError, match=r"empty\.tar: a tar archive without a \.jsonl member"):
        convert_wiki18(empty, out)
    assert out.read_text() == "kept\n" and not list(tmp_path.glob("*.tmp"))
    stats = convert_wiki18(_wiki18(tmp_path / "w2.jsonl", [{"id": "7", "contents": '"T"\nx'}]), out)
    assert stats == {"passages": 1, "untitled": 0, "ids_are_rows": False}


def test_search_r1_questions_convert_to_training_data(tmp_path, capsys):
    # Search-R1's instruction, which its training prompts carry
    from agent.protocols.search_r1 import INSTRUCTION
    from corpora.qa import read_qa
    from sleuth.cli import main

    rows = [{"data_source": "nq", "prompt": [{"role": "user", "content": INSTRUCTION.format(question=f"q{i}?")}],
             "reward_model": {"ground_truth": {"target": [f"a{i}"]}, "style": "rule"},
             "extra_info": {"index": i, "split": "train"}} for i in range(3)]
    src = _wiki18(tmp_path / "train.jsonl", rows)
    assert main(["corpus", "--qa-from", str(src), "--qa-out", str(tmp_path / "qa.jsonl")]) == 0
    got = read_qa(tmp_path / "qa.jsonl")  # what data.train reads
    assert [(q.question, q.golden_answers) for q in got] == [(f"q{i}?", [f"a{i}"]) for i in range(3)]
    assert main(["corpus", "--qa-from", str(src)]) == 2 and "--qa-out" in capsys.readouterr().err
