"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the models being trained: every decoder layer and then
the root unit, for the policy's :class:`training.model.forward.LogprobModule` and a separate critic (as
verl's FSDP workers). Gathering full weights and optimizer states is :mod:`training.infra.distributed`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training.model.lora import base_model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` and alikes) or of its bare
    backbone (``model.layers``, ``model.h``); ``ValueError`` when there are none."""
    model = base_model(model)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix) if prefix and hasattr(model, prefix) else model
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(layers)


def shard(module: nn.Module, mixed_precision: bool = False) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to every decoder layer of ``module.model`` and to ``module`` (the root
    unit: a :class:`training.model.forward.LogprobModule`), in place.

    ``mixed_precision`` uses bf16 parameters with float32 gradient reduction (GPU)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(module.model):
        fully_shard(layer, **kw)
    fully_shard(module, **kw)
    return module


def shard_value_model(critic: nn.Module) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to every decoder layer of a separate value model's backbone
    (:class:`training.model.critic.ValueModel`) and to the value model (the root unit: value head, embeddings,
    final norm), in place, as verl's FSDP critic worker does. FSDP2 then averages its gradients over ranks,
    as it does the policy's. No mixed precision: the critic runs in its parameters' dtype, as on one process.
    Raises ``ValueError`` for a shared critic (its backbone is the policy's)."""
    from torch.distributed.fsdp import fully_shard

    if getattr(critic, "shared", False):
        raise ValueError("a shared value model rides on the policy's backbone and cannot be sharded on its own")
    for layer in decoder_layers(critic.backbone):
        fully_shard(layer)
    fully_shard(critic)
    return critic
