"""A fleet of two engine server processes (``sleuth serve-engine`` on the tiny policy) with the trainer's weight
sync (training.rollout.fleet_sync): greedy episodes over the fleet token-identical to the in-process backend's;
a push over gloo and over shared disk, in buckets, verified on every engine; an engine left on old weights
caught by the probe and named while the push to the other stands; an engine killed mid-request (its requests
rerun on the other, the engine out of rotation, named) that rejoins only after a verified sync once restarted;
and the sync settings refused."""

from __future__ import annotations

import copy
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest
import torch

from agent.backends.fleet import Fleet, wait_until_up
from agent.backends.hf import TransformersLLM, sequence_logprobs
from agent.llm import SamplingParams, encode
from agent.loop.batch import run_episodes
from tests.conftest import QUESTIONS
from tests.test_agent_fakes import ServerThread
from training.rollout.fleet_sync import FleetSync, FullState, SyncSettings, buckets
from training.rollout.weight_sync import probe_ids

ROOT = Path(__file__).resolve().parents[1]
TIGHT = 1e-4  # fp32 on the CPU: the same weights score the probe alike to ~1e-6


class EngineProcs:
    """``sleuth serve-engine`` processes on free ports; :meth:`kill` and :meth:`start` one by index."""

    def __init__(self, model_dir: Path, logs: Path, n: int):
        self.model_dir, self.logs = model_dir, logs
        self.ports = []
        for _ in range(n):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.ports.append(s.getsockname()[1])
        self.procs: list[subprocess.Popen | None] = [None] * n
        for i in range(n):
            self.start(i, wait=False)
        for i in range(n):
            self.wait(i)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self, i: int, wait: bool = True) -> None:
        log = open(self.logs / f"engine{i}.log", "ab")  # noqa: SIM115 - the process writes it
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs[i] = subprocess.Popen(
            [sys.executable, "-m", "sleuth.cli", "serve-engine", "--model", str(self.model_dir), "--served-model-name",
             "tiny", "--port", str(self.ports[i]), "--threads", "1", "--device", "cpu"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait(i)

    def wait(self, i: int) -> None:
        try:
            wait_until_up(self.urls[i], 240, f"engine {i}")
        except TimeoutError:
            raise RuntimeError((self.logs / f"engine{i}.log").read_text()[-2000:]) from None

    def kill(self, i: int) -> None:
        p = self.procs[i]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


@pytest.fixture(scope="module")
def engines(tiny_policy_dir, tmp_path_factory):
    procs = EngineProcs(tiny_policy_dir, tmp_path_factory.mktemp("engine_logs"), 2)
    yield procs
    procs.close()


@pytest.fixture()
def trainer_model(tiny_policy_dir):
    """The trainer's policy: the tiny policy moved by an "update" (every weight + 0.01)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model


def _fleet(urls, tok):
    return Fleet(urls, tok, "tiny", backoff_s=0.05, max_retries=1, retry_waits=(0.1,), timeout_s=120)


def _sync(fleet, model, tok, version, **settings):
    ids = probe_ids(tok)
    sync = FleetSync(fleet, SyncSettings(**{"bucket_bytes": 32 * 1024, "timeout_s": 60, **settings}), rank=0)
    return sync.sync(FullState(model), version, ids, sequence_logprobs(model, ids), TIGHT)


def test_greedy_episodes_over_the_fleet_are_token_identical_to_the_in_process_backend(engines, tiny_policy_dir,
                                                                                       retriever, agent_cfg):
    local = TransformersLLM.from_pretrained(str(tiny_policy_dir), device="cpu")
    fleet = _fleet(engines.urls, local.tokenizer)
    _sync(fleet, local.model, local.tokenizer, 100, transport="disk", shared_dir=str(engines.logs / "shared"))
    kw = {"n_samples": 2, "temperature": 0.0}
    over_fleet = run_episodes(QUESTIONS, fleet, retriever, agent_cfg, **kw)
    in_process = run_episodes(QUESTIONS, local, retriever, agent_cfg, **kw)
    assert [t.token_ids for t in over_fleet] == [t.token_ids for t in in_process]
    assert [t.roles for t in over_fleet] == [t.roles for t in in_process]
    assert all(t.stop_reason != "error" for t in over_fleet)
    assert {e["served"] > 0 for e in fleet.describe().values()} == {True}  # both engines took requests


def test_a_push_over_gloo_to_two_engine_processes_is_verified(engines, trainer_model, tiny_llm):
    tok = tiny_llm.tokenizer
    fleet = _fleet(engines.urls, tok)
    stats = _sync(fleet, trainer_model, tok, 1, transport="gloo")
    nbytes = sum(t.numel() * t.element_size() for t in trainer_model.state_dict().values())
    assert stats["sync/engines_pushed"] == stats["sync/engines_verified"] == 2 and stats["sync/engines_failed"] == 0
    assert stats["sync/buckets"] == len(list(buckets(trainer_model.state_dict().items(), 32 * 1024))) > 1
    assert nbytes <= stats["sync/bytes"] < nbytes + 16 * len(trainer_model.state_dict())  # + alignment
    assert stats["sync/probe_lp_diff_max"] < 1e-5
    assert [httpx2.get(u + "/weight_info").json()["weight_version"] for u in engines.urls] == ["1", "1"]
    assert fleet.in_rotation() == engines.urls and {e["weight_version"] for e in fleet.describe().values()} == {1}
    # the engines now generate what the trainer's model does, and say which weights did
    prompts = [encode(tok, f"Question: {q.question}\n") for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    got = fleet.generate(prompts, params)
    want = TransformersLLM(trainer_model, tok).generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert {g.meta["weight_version"] for g in got} == {1}


def test_a_push_through_shared_disk_is_verified_and_leaves_no_file(engines, trainer_model, tiny_llm, tmp_path):
    fleet = _fleet(engines.urls, tiny_llm.tokenizer)
    with torch.no_grad():
        trainer_model.lm_head.weight.mul_(1.5)
    stats = _sync(fleet, trainer_model, tiny_llm.tokenizer, 2, transport="disk", shared_dir=str(tmp_path / "w"))
    assert stats["sync/engines_verified"] == 2 and stats["sync/buckets"] > 1 and stats["sync/probe_lp_diff_max"] < 1e-5
    assert [httpx2.get(u + "/weight_info").json()["weight_version"] for u in engines.urls] == ["2", "2"]
    assert list((tmp_path / "w").iterdir()) == []


def test_an_engine_left_on_old_weights_is_caught_by_the_probe_and_named(engines, trainer_model, tiny_policy_dir,
                                                                        tiny_llm, caplog):
    """One engine's loader skips a tensor and says nothing (it counts it as loaded): the probe catches it,
    names it, and it leaves the rotation; the push to the other engine stands. Another engine that does not
    know a weight's name refuses the bucket and leaves too."""
    from tests.test_fleet_engine import make_engine

    skipping, unknown = make_engine(tiny_policy_dir), make_engine(tiny_policy_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    skipping.weights.own[name] = skipping.weights.own[name].clone()  # the copy lands beside the model
    del unknown.weights.own["model.norm.weight"]
    with ServerThread(skipping.app) as s1, ServerThread(unknown.app) as s2, \
            caplog.at_level(logging.WARNING, "agent.backends.fleet"):
        fleet = _fleet([engines.urls[0], s1.url, s2.url], tiny_llm.tokenizer)
        stats = _sync(fleet, trainer_model, tiny_llm.tokenizer, 3, transport="gloo")
    assert fleet.in_rotation() == [engines.urls[0]]
    assert stats["sync/engines_pushed"] == 2 and stats["sync/engines_verified"] == 1 and stats["sync/engines_failed"] == 1
    state = fleet.describe()
    assert "failed the weight-sync check after version 3" in state[s1.url]["reason"]
    assert f"rollout engine {s1.url} does not run the trainer's weights" in state[s1.url]["reason"]
    assert "HTTP 422" in state[s2.url]["reason"] and "model.norm.weight" in state[s2.url]["reason"]
    assert skipping.weights.version == "3"  # it believes it took the push: only the probe tells
    assert state[engines.urls[0]]["weight_version"] == 3
    assert httpx2.get(engines.urls[0] + "/weight_info").json()["weight_version"] == "3"
    assert f"rollout engine {s1.url} taken out of rotation" in caplog.text


def test_an_engine_killed_mid_request_is_replaced_and_rejoins_after_a_verified_sync(engines, trainer_model, tiny_llm,
                                                                                      caplog):
    tok = tiny_llm.tokenizer
    a, b = engines.urls
    fleet = _fleet(engines.urls, tok)
    prompts = [encode(tok, f"Question: {q.question}\n") for q in QUESTIONS]
    out: dict = {}
    params = SamplingParams(max_new_tokens=150, temperature=0.0, stop=())
    worker = threading.Thread(target=lambda: out.update(gens=fleet.generate(prompts, params)))
    with caplog.at_level(logging.WARNING, "agent.backends.fleet"):
        worker.start()
        deadline = time.monotonic() + 120
        while httpx2.get(b + "/health").json()["inflight"] == 0:  # engine b is generating now
            assert time.monotonic() < deadline and worker.is_alive(), "engine b never got a request"
            time.sleep(0.01)
        engines.kill(1)
        worker.join(timeout=300)
    gens = out["gens"]
    assert len(gens) == len(prompts) and {g.meta["engine"] for g in gens} == {a}
    assert fleet.stats["rerouted"] >= 1 and fleet.in_rotation() == [a]
    assert f"rollout engine {b} taken out of rotation" in caplog.text
    assert fleet.describe()[b]["reason"].startswith("BackendUnreachable")
    # restarted, it serves its initial weights: not back in rotation until a sync to it is verified
    engines.start(1)
    assert fleet.in_rotation() == [a] and fleet.candidates() == [b]
    stats = _sync(fleet, trainer_model, tok, 4, transport="gloo")
    assert fleet.in_rotation() == [a, b] and stats["sync/engines_verified"] == 2
    assert fleet.describe()[b]["weight_version"] == 4 and "admitted at version 4" in fleet.describe()[b]["events"]
    assert f"rollout engine {b} rejoins the rotation at weight version 4" in caplog.text


# -- settings and streaming -----------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "match"), [
    ({"bucket_bytes": 0}, "bucket size must be a positive number of bytes, got 0"),
    ({"bucket_bytes": -1}, "bucket size must be a positive number of bytes, got -1"),
    ({"bucket_bytes": 1.5}, "bucket size must be a positive number of bytes"),
    ({"transport": "tcp"}, "unknown weight-sync transport 'tcp'"),
    ({"transport": "disk"}, "needs shared_dir"),
    ({"timeout_s": 0}, "timeout must be finite positive seconds"),
])
def test_bad_sync_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SyncSettings(**kw)


def test_buckets_stream_within_the_bound(tiny_llm):
    named = [("a", torch.zeros(10)), ("b", torch.zeros(6)), ("c", torch.zeros(100)), ("d", torch.zeros(2))]
    # 40 B, then 24 B aligned to 48: 72 > 64, so b starts a bucket; c (400 B) is over the bound alone
    assert [[n for n, _ in b] for b in buckets(named, 64)] == [["a"], ["b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in buckets(named, 100)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in buckets(named, 1 << 30)] == [["a", "b", "c", "d"]]
    model = copy.deepcopy(tiny_llm.model)
    state = FullState(model)
    assert state.nbytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert [n for n, _ in state] == list(model.state_dict())
    wrapped = torch.nn.Module()
    wrapped.model = model
    assert [n for n, _ in FullState(wrapped, strip="model.")] == list(model.state_dict())


def test_a_failed_push_still_runs_every_gather_and_raises(tiny_llm, monkeypatch):
    """Under FSDP every parameter's gather is a collective: rank 0 failing half way through its push must still
    run the rest of the stream, or the other ranks would wait in a gather until the collective timeout."""
    fleet = Fleet(["http://127.0.0.1:9"], tiny_llm.tokenizer, "tiny", connect=False)
    gathered = []

    def stream():
        for i in range(5):
            gathered.append(i)
            yield f"w{i}", torch.zeros(2)

    def push_fails(self, named_tensors, version, targets):
        next(iter(named_tensors))
        raise RuntimeError("the engine call broke")

    monkeypatch.setattr(FleetSync, "push", push_fails)
    with pytest.raises(RuntimeError, match="the engine call broke"):
        FleetSync(fleet, rank=0).sync(stream(), 1, None, None, 1e-4)
    assert gathered == [0, 1, 2, 3, 4]
    gathered.clear()
    assert FleetSync(fleet, rank=1).sync(stream(), 1, None, None, 1e-4) == {}  # another rank: gathers only
    assert gathered == [0, 1, 2, 3, 4]
