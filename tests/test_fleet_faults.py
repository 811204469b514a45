"""Faults of a fleet run (slow: engine server processes): an engine SIGKILLed in the middle of a step's rollout
is taken out of rotation, named, its episodes rerun on the other engine and the run goes on; restarted at its
URL it rejoins only after a verified push. With every engine down a step fails with an error naming the
engines, after the retry waits. An asynchronous fleet run of engines the trainer starts (a count) resumes
from its checkpoint: the engines get the checkpoint's weights before the first step and no engine process is
left running."""

from __future__ import annotations

import json
import logging
import time

import httpx2
import pytest

from tests.conftest import QUESTIONS, run_rl
from tests.test_fleet_sync import EngineProcs

pytestmark = pytest.mark.slow


def cfg_for(engines, *extra):
    from tests.test_trainer import make_cfg

    return make_cfg(f"train.rollout.engines={json.dumps(engines)}", "train.rollout.engine_model=tiny",
                    "train.rollout.sync_probe_tol=1e-4", "train.rollout.retry_waits=[0.2, 0.4]",
                    "train.rollout.sync_timeout_s=60", "train.rollout.engine_timeout_s=60", *extra)


@pytest.fixture()
def procs(tiny_policy_dir, tmp_path):
    logs = tmp_path / "engine_logs"
    logs.mkdir()
    p = EngineProcs(tiny_policy_dir, logs, 2)
    yield p
    p.close()


def test_an_engine_killed_mid_step_is_replaced_and_rejoins_after_a_verified_push(procs, tiny_policy_dir, retriever,
                                                                                 tmp_path, caplog):
    from tests.test_trainer import load, varying_judge

    killed = []

    def judge(traj):  # the first episode judged in step 2: engine 1 is killed while the others still run
        if steps == [1] and not killed:
            procs.kill(1)
            killed.append(time.time())
        return varying_judge(traj)

    records, steps = [], []

    def on_step(step, record):
        steps.append(step)
        records.append(record)
        if step == 2:
            procs.start(1)  # the launcher restarts it, at the same URL, from the initial weights

    model, tok = load(tiny_policy_dir)
    with caplog.at_level(logging.WARNING, logger="agent.backends.fleet"):
        res = run_rl(cfg_for(procs.urls, "train.steps=4", "train.rollout.questions_per_step=4"), model, tok,
                     retriever, QUESTIONS, tmp_path / "run", judge=judge, on_step=on_step)
    assert killed and steps == [1, 2, 3, 4] and res["last"]
    u1 = procs.urls[1]
    out = [r.getMessage() for r in caplog.records if f"rollout engine {u1} taken out of rotation" in r.getMessage()]
    assert len(out) == 1, [r.getMessage() for r in caplog.records]
    rejoined = [r.getMessage() for r in caplog.records if f"rollout engine {u1} rejoins the rotation" in r.getMessage()]
    assert rejoined == [f"rollout engine {u1} rejoins the rotation at weight version 3"]
    assert records[0]["sync/engines_in_rotation"] == 2
    assert records[1]["sync/engines_pushed"] == 1 and records[1]["sync/engines_in_rotation"] == 1  # the step went on
    assert records[1]["rollout_dropped"] == 0  # every episode of the killed engine ran again on the other
    for rec in records[2:]:  # restarted: pushed, verified, back in rotation
        assert rec["sync/engines_pushed"] == 2 == rec["sync/engines_verified"] == rec["sync/engines_in_rotation"]
    info = httpx2.get(u1 + "/v1/models").json()["data"][0]
    assert info["weight_version"] == "4"


def test_every_engine_down_fails_the_step_naming_them_after_the_retry_waits(procs, tiny_policy_dir, retriever,
                                                                            tmp_path):
    from tests.test_trainer import load, varying_judge

    def on_step(step, record):
        procs.kill(0)
        procs.kill(1)

    model, tok = load(tiny_policy_dir)
    t0 = []
    with pytest.raises(RuntimeError) as err:
        run_rl(cfg_for(procs.urls, "train.steps=3"), model, tok, retriever, QUESTIONS, tmp_path / "run",
               judge=varying_judge, on_step=lambda s, r: (on_step(s, r), t0.append(time.time())))
    waited = time.time() - t0[0]
    msg = str(err.value)
    assert "episodes of this rollout failed" in msg and "rollout engines are out of rotation" in msg, msg
    assert all(u in msg for u in procs.urls)
    assert waited < 120  # bounded: the fleet's retry waits, then the episode reruns' waits


def test_an_async_fleet_run_of_started_engines_resumes_from_its_checkpoint(tiny_policy_dir, retriever, tmp_path,
                                                                           caplog):
    from agent.backends.hf import load_model_and_tokenizer
    from tests.test_trainer import load, make_cfg, varying_judge
    from training.infra.checkpoint import latest_checkpoint

    cfg = ["train.rollout.engines=2", "train.rollout.asynchronous=true", "train.rollout.max_staleness=1",
           "train.rollout.sync_probe_tol=1e-4", "train.rollout.sync_timeout_s=60"]
    model, tok = load(tiny_policy_dir)
    with caplog.at_level(logging.INFO, logger="training.rollout.fleet_run"):
        first = run_rl(make_cfg(*cfg, "train.steps=2"), model, tok, retriever, QUESTIONS, tmp_path / "run",
                       judge=varying_judge)
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("started 2 rollout engines")]
    assert len(started) == 1
    urls = started[0].split(": ", 1)[1].split(", ")
    ckpt = latest_checkpoint(tmp_path / "run")
    assert first["start_step"] == 0 and ckpt.name == "step_000002"
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    assert 2 <= saved["data_position"] <= 2 * 2 + 2  # the frontier: questions in flight are generated again
    assert len(sorted((tmp_path / "run" / "engines").glob("engine*.log"))) == 2

    records = []
    model, tok = load_model_and_tokenizer(str(ckpt), device="cpu")
    again = run_rl(make_cfg(*cfg, "train.steps=3"), model, tok, retriever, QUESTIONS, tmp_path / "run", resume=True,
                   judge=varying_judge, on_step=lambda s, r: records.append(r))
    assert again["start_step"] == 2 and len(records) == 1
    rec = records[0]
    assert rec["sync/engines_verified"] == 2 and rec["async/staleness_max"] <= 1
    assert rec["offpolicy/turn_staleness_max"] <= 1  # no turn labelled with a version of the interrupted run
    assert latest_checkpoint(tmp_path / "run").name == "step_000003"
    for url in urls:  # the engines the trainer started are gone
        with pytest.raises(httpx2.TransportError):
            httpx2.get(url + "/health", timeout=5)
