"""ARPO, REX-RAG and search self-play train through ``sleuth train`` (one step, the tiny policy) on the
synthetic task and on the shipped HotpotQA sample: the strategy runs in the trainer's rollout phase, its
statistics reach the step's record, and the update runs on what it produced."""

from __future__ import annotations

import json

import pytest

METHODS = {
    "arpo": ["train.rollout.strategy=arpo", "train.rollout.group_size=3",
             "train.rollout.strategy_options.global_samples=1", "train.rollout.strategy_options.branch_prob=1.0",
             "train.algorithm.adv_estimator=arpo", "train.algorithm.options.attribution=hard"],
    "rexrag": ["train.rollout.strategy=rexrag", "train.rollout.strategy_options.probe_prob=1.0"],
    "ssp": ["train.rollout.strategy=ssp", "train.rollout.strategy_options.proposals=2",
            "train.rollout.strategy_options.min_question_words=1", "train.rollout.strategy_options.min_searches=0"],
}
#: a key of each strategy's statistics in the step's record
STAT = {"arpo": "arpo/branches", "rexrag": "rexrag/probes", "ssp": "ssp/proposals"}


@pytest.fixture(scope="module")
def task_args(tmp_path_factory):
    """``sleuth train`` arguments of each task: the synthetic task (a small draw of task v1) and the shipped
    sample, each with its own index directory built by the first run that needs it."""
    from corpora.synthetic import SyntheticSpec, write

    root = tmp_path_factory.mktemp("tasks")
    paths = write(root / "synthetic", SyntheticSpec(n_train=12, n_test=4))
    synthetic = [f"data.{k}={v}" for k, v in paths.items()] + [f"retrieval.index_dir={root / 'synthetic_index'}",
                                                               "retrieval.top_k=1", "retrieval.build_dense=false"]
    sample = [f"retrieval.index_dir={root / 'sample_index'}", "retrieval.build_dense=false"]  # data.*: the sample
    return {"synthetic": synthetic, "sample": sample}


@pytest.mark.parametrize("task", ["synthetic", "sample"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_rollout_strategy_trains_through_sleuth_train(method, task, task_args, tiny_policy_dir, tmp_path):
    from sleuth.cli import main

    out = tmp_path / "run"
    rc = main(["train", f"out_dir={out}", f"policy.model={tiny_policy_dir}", "sft.enabled=false", "train.steps=1",
               "train.rollout.questions_per_step=2", "train.rollout.group_size=2", "agent.max_new_tokens=8",
               "agent.max_total_tokens=192", "agent.short_prompt=true", "eval.limit=2", *task_args[task],
               *METHODS[method]])
    assert rc == 0
    (metrics,) = out.glob("*/metrics.jsonl")
    (record,) = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert record["step"] == 1 and STAT[method] in record
    assert "pg_loss" in record and "skipped" not in record  # the update ran
    if method == "arpo":  # branch_prob 1: every tool step branches while the budget M = 3 lasts
        assert record["arpo/branches"] + record["arpo/refills"] == 2 * (3 - 1)
    if method == "ssp":
        assert record["ssp/proposals"] == 2 * 2
