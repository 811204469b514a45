"""The value model (training.model.critic) on an FSDP2-sharded policy: refused at construction with a clear
error.

Under torchrun the policy is sharded before the critic is built; ``copy.deepcopy`` of a sharded backbone
fails with FSDP's AssertionError, and the shared layout ran the sharded backbone outside its root FSDP unit
(DTensor embedding mixed with plain input ids) only at the first value forward, after a whole rollout. A
one-rank gloo group is enough to shard a module in-process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("shared", [True, False])
def test_value_model_refuses_a_sharded_policy(shared):
    from training.model.critic import ValueModel
    from training.model.forward import LogprobModule
    from training.model.fsdp import shard

    # no test leaves a process group behind (rl_train destroys its own); a leaked one is a failure, not a skip
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _tiny()
        shard(LogprobModule(model))
        with pytest.raises(ValueError, match="sharded"):
            ValueModel(model, shared=shared)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False])
def test_value_model_on_a_plain_policy_is_aligned_with_the_loss_mask(shared):
    from agent.trajectory import Role, Trajectory
    from training.batch import collate
    from training.model.critic import ValueModel

    model = _tiny()
    t = Trajectory("q", "q")
    t.append([3, 4, 5], Role.PROMPT, 0)
    t.append([6, 7], Role.POLICY, 1)
    t.append([8, 9], Role.TOOL, 1)
    t.append([10], Role.POLICY, 2)
    b = collate([t], 0)
    critic = ValueModel(model, shared=shared)
    torch.nn.init.normal_(critic.head.weight)
    v = critic(b)
    assert v.shape == b.loss_mask.shape
    assert torch.all(v[b.loss_mask == 0] == 0) and torch.all(v[b.loss_mask == 1] != 0)


@pytest.mark.parametrize("shared", [True, False])
def test_value_head_is_built_on_the_policy_device(shared):
    """The head was always made on the CPU, and forward moves the batch to the head's device: with the policy
    on a GPU the backbone got CPU input ids at the first PPO value forward. (The meta device stands in for a
    GPU here.)"""
    from training.model.critic import ValueModel

    critic = ValueModel(_tiny().to("meta"), shared=shared)
    assert critic.head.weight.device.type == "meta" and critic.head.weight.dtype == torch.float32


@pytest.mark.parametrize("shared", [True, False])
def test_value_forward_builds_no_kv_cache(shared):
    """The backbone ran with the config's use_cache (True for a causal LM), building a KV cache of the whole
    batch that the value head never reads."""
    from agent.trajectory import Role, Trajectory
    from training.batch import collate
    from training.model.critic import ValueModel

    critic = ValueModel(_tiny(), shared=shared)
    seen = []
    critic._body().register_forward_hook(lambda m, args, kwargs, out: seen.append(out.past_key_values),
                                         with_kwargs=True)
    t = Trajectory("q", "q")
    t.append([3, 4, 5], Role.PROMPT, 0)
    t.append([6, 7], Role.POLICY, 1)
    critic(collate([t], 0))
    assert seen == [None]
