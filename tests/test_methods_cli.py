"""Each search-agent method trains through ``sleuth train`` for one step with the tiny policy, on the synthetic
multi-hop task and on the shipped HotpotQA sample: AEPO (estimator), E-GRPO, IKEA, SSRL (rewards; SSRL with
the self-search engine), behaviour priming (SFT data). Bad settings fail before anything trains."""

from __future__ import annotations

import json

import pytest

from corpora import sample_paths
from corpora.synthetic import SyntheticSpec, write

METHODS = {  # method -> its overrides of `sleuth train`
    "aepo": ["train.algorithm.adv_estimator=aepo", "train.algorithm.options.entropy_target=1.0",
             "train.algorithm.options.resample_fraction=1.0", "train.algorithm.options.reinforce_samples=2",
             "agent.format_reward=0.1"],
    "egrpo": ["train.algorithm.reward=egrpo"],
    "ikea": ["train.algorithm.reward=ikea"],
    "ssrl": ["retrieval.method=self_search", "train.algorithm.reward=ssrl",
             "train.algorithm.reward_options.require_think=false", "agent.simulator.max_doc_tokens=8"],
    "priming": ["sft.enabled=true", "sft.data=primed", "sft.epochs=1", "sft.max_examples=3",
                "sft.data_options.n=2", "sft.data_options.pool_factor=2", "sft.data_options.required=[]",
                "sft.data_options.outcome=any"],
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The two tasks' data and BM25 indexes, built once: a small synthetic task and the shipped sample."""
    from retrieval.index import build_index

    root = tmp_path_factory.mktemp("method_tasks")
    synthetic = write(root / "synthetic", SyntheticSpec(n_train=12, n_test=4, seed=7))
    out = {"synthetic": ({k: str(v) for k, v in synthetic.items()}, root / "synthetic-index"),
           "sample": ({k: str(v) for k, v in sample_paths().items()}, root / "sample-index")}
    for paths, index in out.values():
        build_index(paths["corpus"], index, build_dense=False, show_progress=False)
    return out


def sleuth(capsys, *argv) -> tuple[int, str, str]:
    from sleuth.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def train_args(tasks, task, out, tiny_policy_dir, *extra):
    paths, index = tasks[task]
    return ["train", f"out_dir={out}", *(f"data.{k}={v}" for k, v in paths.items()), f"retrieval.index_dir={index}",
            f"policy.model={tiny_policy_dir}", "sft.enabled=false", "train.steps=1", "train.rollout.questions_per_step=2",
            "train.rollout.group_size=2", "agent.max_new_tokens=8", "agent.max_total_tokens=256",
            "agent.max_obs_tokens=48", *extra]


@pytest.mark.parametrize("task", ["synthetic", "sample"])
@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_trains_through_sleuth_train(method, task, tasks, tiny_policy_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = sleuth(capsys, *train_args(tasks, task, out, tiny_policy_dir, *METHODS[method]))
    assert code == 0, err
    run = out / ("aepo" if method == "aepo" else "grpo")
    (record,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trajs = [json.loads(x) for x in (run / "trajectories.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and trajs
    if method == "aepo":
        # the temperature follows the measured entropy; both questions re-sampled (the splice: its own test)
        assert record["aepo/temperature"] == (1.2 if record["aepo/entropy"] <= 1.0 else 0.8)
        assert 0 < record["aepo/entropy"] < 5.99 and record["aepo/resampled"] == 4.0
        assert record["aepo/selected"] <= (2.0 if record["aepo/entropy"] <= 1.0 else 1.0)
    elif method == "ikea":
        for t in trajs:
            searches = sum(turn["action"] == "search" for turn in t["turns"])
            if not t["verdict"]["format_ok"]:
                want = -1.0
            elif t["verdict"]["em"] == 1.0:
                want = 1.0 + 0.6 * (1 - min(searches, 3) / 3)
            else:
                want = 0.05 if searches else 0.0
            assert t["reward"] == pytest.approx(want) and "judge_reward" in t["verdict"]
    elif method in ("egrpo", "ssrl"):
        assert all("judge_reward" in t["verdict"] for t in trajs)
        assert all(0.0 <= t["reward"] <= 1.0 for t in trajs)
        if method == "ssrl":  # every document an episode read was written by the policy itself
            assert all(i.startswith("sim:useful:") for t in trajs for i in t["retrieved_ids"])
    else:
        primed = [json.loads(x) for x in (out / "sft_primed_trajectories.jsonl").read_text().splitlines()]
        assert len(primed) == 2 and (out / "sft" / "config.json").exists()


def test_primed_sft_data_show_the_behaviours_asked_for(tasks, tiny_policy_dir, tmp_path, capsys):
    """On the synthetic task the primed set holds only correct trajectories that verified their answer."""
    from agent.trajectory import Turn
    from corpora import read_qa
    from training.algos.priming import exhibited_behaviours

    out = tmp_path / "run"
    code, _, err = sleuth(capsys, *train_args(tasks, "synthetic", out, tiny_policy_dir, *METHODS["priming"][:-2],
                                              "sft.data_options.required=[verification]", "sft.data_options.behaviour_prob=1.0",
                                              "agent.max_new_tokens=24", "agent.max_turns=8", "train.steps=0"))
    assert code == 0, err
    primed = [json.loads(x) for x in (out / "sft_primed_trajectories.jsonl").read_text().splitlines()]
    assert len(primed) == 2
    chains = {ex.id: ex.metadata["chain"] for ex in read_qa(tasks["synthetic"][0]["train"])}
    for t in primed:
        turns = [Turn(**{k: v for k, v in turn.items() if k in Turn.__dataclass_fields__}) for turn in t["turns"]]
        chain = chains[t["question_id"]][: t["metadata"]["hops"] + 1]
        assert t["verdict"]["em"] == 1.0
        assert "verification" in exhibited_behaviours(t["question"], turns, chain[1:], t["answer"])


@pytest.mark.parametrize("extra, message", [
    (["train.algorithm.adv_estimator=aepo", "train.algorithm.options.entropy_target=6.5"],
     "AEPO's entropy target (nats, V=400) must lie in (0.0, 5.99"),
    (["train.algorithm.adv_estimator=aepo", "train.algorithm.options.entropy_targt=0.5"],
     "did you mean train.algorithm.options.entropy_target?"),
    (["train.algorithm.reward=ikea", "train.algorithm.reward_options.r_kb_plus=0.5"],
     "unknown option(s) 'r_kb_plus' of reward 'ikea'"),
    (["sft.enabled=true", "sft.data=primed", "sft.data_options.required=[honesty]"], "unknown behaviour(s) ['honesty']"),
])
def test_bad_method_settings_fail_before_anything_trains(extra, message, tasks, tiny_policy_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = sleuth(capsys, *train_args(tasks, "synthetic", out, tiny_policy_dir, "sft.enabled=true", *extra))
    assert code == 2 and message in err, err
    assert not (out / "sft").exists() and not (out / "aepo").exists()  # nothing built, nothing trained
