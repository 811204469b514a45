"""FSDP2 on CPU: two gloo processes (torchrun) each updating on half the batch produce the same parameters
after a step as one process on the whole batch, for the policy and for PPO's separate value model (sharded
on its own, :func:`training.model.fsdp.shard_value_model`). The ranks split their halves by a token budget
into different numbers of micro-batches (2 and 3), which :func:`training.infra.distributed.pad_micro_batches`
evens out.

Run as a script by torchrun (the worker); as a test it computes the one-process reference in-process and
compares. The worker ends with a barrier before ``destroy_process_group`` (a gloo teardown abort was seen
without it); the test fails on a parameter mismatch or a missing result, not on a non-zero exit after the
result was written.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def build():
    """A tiny random Qwen2 (2 layers) and a fixed batch of 6 trajectories with tool spans and advantages."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from training.algos.advantages import to_token_advantages
    from training.batch import Batch
    from training.masking import loss_mask_from_roles

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    N, T = 6, 20
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (N, T), generator=g)
    lens = torch.tensor([20, 17, 12, 20, 9, 15])
    roles = torch.full((N, T), -1)
    for i, n in enumerate(lens.tolist()):
        roles[i, :n] = torch.tensor(([0] * 3 + [1] * 4 + [2] * 3 + [1] * 10)[:n])
    attn = (roles >= 0).long()
    batch = Batch(input_ids=ids * attn, attention_mask=attn, roles=roles, loss_mask=loss_mask_from_roles(roles[:, 1:]),
                  turn_ids=torch.zeros(N, T, dtype=torch.long), rewards=torch.zeros(N),
                  groups=torch.zeros(N, dtype=torch.long))
    batch.token_advantages = to_token_advantages(torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.4]),
                                                 batch.loss_mask)
    batch.returns = torch.randn(N, T - 1, generator=g) * batch.loss_mask  # PPO's critic targets
    batch.old_values = torch.zeros(N, T - 1)
    return model, batch


def train_cfg():
    from sleuth.config import TrainConfig

    return TrainConfig(optim={"lr": 0.5, "micro_batch": 2, "grad_clip": 1.0, "bf16": False})


def critic_for(model):
    """PPO's separate value model of ``model``, its head set off zero so that the backbone gets gradients."""
    from training.model.critic import ValueModel

    critic = ValueModel(model)
    with torch.no_grad():
        critic.head.weight.copy_(torch.linspace(-1, 1, critic.head.weight.numel()).view_as(critic.head.weight))
    return critic


def reference_params() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from training.model.actor import update_policy

    model, batch = build()
    critic = critic_for(model)
    opt = torch.optim.SGD(model.parameters(), lr=train_cfg().optim.lr)  # Adam would turn float noise in
    # gradients that are zero in exact arithmetic (k_proj biases) into +-lr steps
    copt = torch.optim.SGD(critic.parameters(), lr=train_cfg().optim.lr)
    update_policy(model, None, opt, batch, train_cfg(), critic=critic, critic_optimizer=copt)
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: v.detach().clone() for k, v in critic.state_dict().items()})


def worker(out: str) -> None:
    from training.infra import distributed as D
    from training.model.actor import update_policy
    from training.model.forward import LogprobModule
    from training.model.fsdp import shard, shard_value_model

    rank, W = D.init_from_env("gloo")
    torch.set_num_threads(1)
    model, batch = build()
    critic = shard_value_model(critic_for(model))  # built from the full policy, before it is sharded
    fwd = shard(LogprobModule(model))
    opt = torch.optim.SGD(fwd.parameters(), lr=train_cfg().optim.lr)
    copt = torch.optim.SGD(critic.parameters(), lr=train_cfg().optim.lr)
    rows = torch.arange(len(batch))[rank::W]
    # rows 0,2,4 (lengths 20,12,9) -> 2 micro-batches of <= 30 padded tokens; rows 1,3,5 (17,20,15) -> 3
    update_policy(fwd, None, opt, batch.select(rows), train_cfg().updated({"optim.micro_batch_tokens": 30}),
                  critic=critic, critic_optimizer=copt)
    state = ({k.removeprefix("model."): v for k, v in D.full_state_dict(fwd).items()}, D.full_state_dict(critic))
    if rank == 0:
        torch.save(state, out + ".tmp")
        os.replace(out + ".tmp", out)
    D.shutdown()


@pytest.mark.slow
def test_two_gloo_processes_match_one(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    out = tmp_path / "params.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:  # a free port (torchrun's --master_port 0 hangs with the static rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                           str(Path(__file__)), str(out)], check=False,
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), f"torchrun wrote no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    got, got_critic = torch.load(out)
    torch.set_num_threads(1)
    ref, ref_critic = reference_params()
    assert set(ref) <= set(got) | {"lm_head.weight"}
    moved = False
    for k, v in ref.items():
        if k not in got:
            continue
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{k} differs between 2 ranks and 1")
        moved |= not torch.equal(v, build()[0].state_dict()[k])
    assert moved
    assert set(got_critic) == set(ref_critic)
    initial = critic_for(build()[0]).state_dict()
    for k, v in ref_critic.items():
        torch.testing.assert_close(got_critic[k], v, rtol=1e-5, atol=1e-6, msg=f"critic {k} differs between 2 ranks and 1")
    assert not torch.equal(ref_critic["head.bias"], initial["head.bias"])
    assert any(not torch.equal(ref_critic[k], initial[k]) for k in ref_critic if k.startswith("backbone.layers"))


if __name__ == "__main__":
    worker(sys.argv[1])
