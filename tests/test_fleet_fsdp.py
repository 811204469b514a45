"""The weight push to a fleet from an FSDP2-sharded policy under ``torchrun --nproc_per_node 2`` (gloo): every
rank gathers the full weights one parameter at a time (training.rollout.fleet_sync.FullState), rank 0 alone
streams them to the engines, the probe is scored by the sharded model's forward on both ranks, and the
rotation rank 0 decided (one engine left on old weights, taken out) is every rank's afterwards.

As a script (run by torchrun): ``python tests/test_fleet_fsdp.py POLICY_DIR OUT GOOD_URL SKIPPING_URL``; each
rank writes ``rank<r>.json`` after the sync and before the process group's teardown."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = "model.layers.0.self_attn.v_proj.weight"


def moved(model) -> None:
    """The "update": every parameter + 0.02 (the same on every rank and in the test)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02)


def worker(policy_dir: str, out: str, good: str, skipping: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.backends.fleet import Fleet
    from agent.backends.hf import sequence_logprobs
    from training.infra import distributed as D
    from training.rollout.fleet_sync import FleetSync, FullState, SyncSettings
    from training.rollout.weight_sync import probe_ids

    rank, W = D.init_from_env("gloo", timeout_s=120)
    assert W == 2
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    moved(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert any(hasattr(t, "full_tensor") for t in model.state_dict().values())  # sharded: DTensors
    ids = probe_ids(tok)
    want = sequence_logprobs(model, ids)  # the sharded forward: a collective on both ranks
    fleet = Fleet([good, skipping], tok, "tiny", backoff_s=0.05, max_retries=1)
    sync = FleetSync(fleet, SyncSettings(transport="gloo", bucket_bytes=24 * 1024, timeout_s=60))
    stats = sync.sync(FullState(model), 5, ids, want, 1e-4)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"stats": stats, "fleet": fleet.describe()}))
    D.shutdown()


@pytest.mark.slow
def test_a_sharded_policy_pushes_from_rank_0_and_every_rank_shares_the_rotation(tiny_policy_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.test_agent_fakes import ServerThread
    from tests.test_fleet_engine import make_engine

    good, skipping = make_engine(tiny_policy_dir), make_engine(tiny_policy_dir)
    skipping.weights.own[SKIPPED] = skipping.weights.own[SKIPPED].clone()  # its loader misses one weight
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with ServerThread(good.app) as s0, ServerThread(skipping.app) as s1:
        proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                               str(port), str(Path(__file__)), str(tiny_policy_dir), str(tmp_path), s0.url, s1.url],
                              check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    results = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    assert all(p.exists() for p in results), f"torchrun exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    r0, r1 = (json.loads(p.read_text()) for p in results)
    assert r0["stats"]["sync/engines_pushed"] == 2 and r0["stats"]["sync/engines_verified"] == 1
    assert r1["stats"] == {}  # rank 1 only gathered in step
    for r in (r0, r1):  # rank 0's rotation on both ranks
        assert r["fleet"][s0.url]["in_rotation"] and r["fleet"][s0.url]["weight_version"] == 5
        assert not r["fleet"][s1.url]["in_rotation"]
        assert f"rollout engine {s1.url} does not run the trainer's weights" in r["fleet"][s1.url]["reason"]
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir))
    moved(ref)
    want, got = ref.state_dict(), good.weights.own
    assert all(torch.equal(got[k], want[k]) for k in want)  # the full weights, gathered from the shards
    assert good.weights.version == "5" and skipping.weights.version == "5"


if __name__ == "__main__":
    worker(*sys.argv[1:5])
