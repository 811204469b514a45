"""The trainer in fleet mode on one process (``train.rollout.engines``): two engine servers of the tiny policy
in this process; every step's push verified on every engine; an engine left on old weights caught after the
first update, named and taken out while the run goes on with the other; bad fleet settings refused before
the first step (an unreachable engine, another model, another tokenizer, a bucket size of 0, asynchronous
rollouts in a combination that cannot run); each turn's weight version and the per-turn rollout correction."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import QUESTIONS, run_rl
from tests.test_agent_fakes import ServerThread
from tests.test_fleet_engine import make_engine

SKIPPED = "model.layers.0.self_attn.v_proj.weight"  # a Hugging Face name (the engines' and the push's)


def cfg_for(urls, *extra):
    from tests.test_trainer import make_cfg

    return make_cfg(f"train.rollout.engines={urls!r}".replace("'", '"'), "train.rollout.sync_probe_tol=1e-4",
                    "train.rollout.retry_waits=[0.1]", "train.rollout.sync_bucket_bytes=32768",
                    "train.rollout.sync_timeout_s=60", *extra)


@pytest.fixture()
def two_engines(tiny_policy_dir):
    """A good engine and one whose loader misses one weight (it keeps serving its old value)."""
    good, skipping = make_engine(tiny_policy_dir), make_engine(tiny_policy_dir)
    skipping.weights.own[SKIPPED] = skipping.weights.own[SKIPPED].clone()
    with ServerThread(good.app) as s0, ServerThread(skipping.app) as s1:
        yield (good, s0.url), (skipping, s1.url)


def test_an_engine_left_on_old_weights_is_caught_after_the_update_named_and_the_run_goes_on(
        two_engines, tiny_policy_dir, retriever, tmp_path, caplog):
    from agent.trajectory import load_trajectories
    from tests.test_trainer import load, varying_judge

    (good, good_url), (skipping, bad_url) = two_engines
    model, tok = load(tiny_policy_dir)
    records = []
    with caplog.at_level(logging.WARNING, logger="agent.backends.fleet"):
        res = run_rl(cfg_for([good_url, bad_url]), model, tok, retriever, QUESTIONS, tmp_path / "run",
                     on_step=lambda s, r: records.append(r), judge=varying_judge)
    assert res["start_step"] == 0 and len(records) == 2
    # step 1: both took the push, the probe caught the engine that skipped a weight; step 2: it is up, so it is
    # pushed again as a candidate to rejoin, fails again and stays out; the good one runs every step's weights
    for rec in records:
        assert rec["sync/engines_pushed"] == 2 and rec["sync/engines_verified"] == 1
        assert rec["sync/engines_failed"] == 1 and rec["sync/engines_in_rotation"] == 1
        assert rec["sync/probe_lp_diff_mean"] <= 1e-4
    named = [r.getMessage() for r in caplog.records if bad_url in r.getMessage()]
    assert len(named) == 1 and "does not run the trainer's weights" in named[0], named
    assert not any(good_url in r.getMessage() for r in caplog.records)
    assert good.weights.version == skipping.weights.version == "2"  # the version it says, not what it runs
    # the good engine holds exactly the trained weights
    want = model.state_dict()
    assert all(torch.equal(good.weights.own[k], want[k]) for k in good.weights.own)
    stale = dict(skipping.weights.model.named_parameters())[SKIPPED]  # the weight its loader missed
    assert not torch.equal(stale, want[SKIPPED])
    # every turn records the weights that generated it: those pushed before step 1 (0), after its update (1)
    by_step: dict[int, set] = {}
    for t in load_trajectories(tmp_path / "run" / "trajectories.jsonl"):
        by_step.setdefault(t.metadata["step"], set()).update(turn.weight_version for turn in t.turns)
    assert by_step == {1: {0}, 2: {1}}
    assert records[0]["offpolicy/turn_staleness_max"] == 0.0 == records[1]["offpolicy/turn_staleness_max"]


@pytest.fixture()
def one_engine(tiny_policy_dir):
    srv = make_engine(tiny_policy_dir)
    with ServerThread(srv.app) as st:
        yield srv, st.url


@pytest.mark.parametrize("case", ["unreachable", "model", "tokenizer"])
def test_a_bad_engine_is_refused_before_the_first_step_naming_it(case, one_engine, tiny_policy_dir, retriever,
                                                               tmp_path):
    from agent.backends.fleet import FleetError
    from tests.test_trainer import load

    srv, url = one_engine
    urls, extra, match = [url], ["train.rollout.engine_model=tiny"], None
    if case == "unreachable":
        from training.rollout.fleet_run import free_ports

        dead = f"http://127.0.0.1:{free_ports(1)[0]}"
        urls, match = [url, dead], f"{dead} is unreachable"
    elif case == "model":
        extra, match = ["train.rollout.engine_model=policy-7b"], f"{url} serves model 'tiny', not 'policy-7b'"
    else:
        srv.fingerprint = "0" * 64  # as an engine whose tokenizer maps ids to other strings
        match = f"{url} serves 'tiny' with another tokenizer"
    model, tok = load(tiny_policy_dir)
    steps = []
    with pytest.raises(FleetError, match=match):
        run_rl(cfg_for(urls, *extra), model, tok, retriever, QUESTIONS, tmp_path / "run",
               on_step=lambda s, r: steps.append(s))
    assert steps == [] and not (tmp_path / "run" / "checkpoints").exists()
    assert srv.weights.version == "0"  # nothing was pushed


def test_fleet_settings_that_cannot_run_are_refused_before_anything_starts(tiny_policy_dir, retriever, tmp_path,
                                                                           monkeypatch):
    import pydantic

    from sleuth.config import ConfigError
    from tests.test_trainer import load, make_cfg
    from training.config import TrainConfig
    from training.trainer import check_setup, check_world

    url = "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match=r"train.rollout.sync_bucket_bytes: Input should be greater than or equal to 1"):
        cfg_for([url], "train.rollout.sync_bucket_bytes=0")
    with pytest.raises(ConfigError, match="sync_transport=disk needs train.rollout.sync_shared_dir"):
        cfg_for([url], "train.rollout.sync_transport=disk")
    with pytest.raises(pydantic.ValidationError, match="listed twice"):
        TrainConfig(rollout={"engines": [url, url + "/v1"]})
    with pytest.raises(pydantic.ValidationError, match="count of engines"):
        TrainConfig(rollout={"engines": 0})
    # asynchronous rollouts under torchrun need a fleet; with one, not an estimator that scores the full policy
    colocated = TrainConfig(rollout={"asynchronous": True, "questions_per_step": 4})
    with pytest.raises(ValueError, match="needs a fleet of rollout engines"):
        check_world(colocated, 2)
    check_world(colocated.updated({"rollout.engines": [url]}), 2)  # accepted
    igpo = colocated.updated({"rollout.engines": [url], "algorithm.adv_estimator": "igpo"})
    with pytest.raises(ValueError, match="gold_probs"):
        check_world(igpo, 2)
    check_world(igpo, 1)  # one process holds the full policy
    cfg = make_cfg(f'train.rollout.engines=["{url}"]', "train.rollout.asynchronous=true")
    with pytest.raises(ValueError, match="LoRA"):
        check_setup(cfg.train.updated({"optim.lora": True}), cfg.agent)
    with pytest.raises(ValueError, match="agent.kind=builtin"):
        check_setup(cfg.train, cfg.agent.model_copy(update={"kind": "external"}))
    # a count of engines to start under a torchrun of two nodes: their 127.0.0.1 is not rank 0's
    from training.rollout import fleet_run

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    state = type("S", (), {"world_size": 2})()
    with pytest.raises(ValueError, match="other 1 node"):
        fleet_run.engine_urls(state, TrainConfig(rollout={"engines": 2}), None, None)
    # and a run refuses them before its first step (nothing written)
    model, tok = load(tiny_policy_dir)
    with pytest.raises(ValueError, match="LoRA"):
        run_rl(make_cfg(f'train.rollout.engines=["{url}"]', "train.optim.lora=true"), model, tok, retriever,
               QUESTIONS, tmp_path / "run")
    assert not (tmp_path / "run").exists()
