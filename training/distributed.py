"""torch.distributed for the trainer: FSDP2 (``torch.distributed.fsdp.fully_shard``) under ``torchrun``.

Layout (as verl's FSDP workers, much smaller): every rank holds a shard of the policy for the update and a
full, unsharded *rollout* copy for generation (or a vLLM engine); after each update the full weights are
gathered and pushed to the rollout side (:func:`full_state_dict`, then ``llm.update_weights`` when the
backend has it). Each rank rolls out its own slice of the step's questions; the loss is normalised by
*global* token / sequence counts and FSDP averages gradients over ranks, so a step on ``W`` ranks equals a
step on one process with the whole batch.

Launch: ``torchrun --nproc_per_node 2 -m sleuth.cli train ...`` (backend ``nccl`` on GPU, ``gloo`` on CPU).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...) when ``WORLD_SIZE > 1``; a no-op otherwise. Returns ``(rank, world_size)``."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return world()


def shutdown() -> None:
    """Barrier, then destroy the process group (the barrier avoids a teardown abort seen with gloo)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(x: float) -> float:
    """Sum of a Python float over ranks (identity without a process group)."""
    if world()[1] == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return float(t.item())


class LogprobModule(nn.Module):
    """Wraps a causal LM so one ``forward(batch)`` computes masked log-probs and entropy
    (:func:`training.batch.policy_logprobs`). FSDP2 shards it as the root unit, so the embedding and LM-head
    parameters are unsharded for exactly the duration of that forward."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def forward(
        self, batch: Any, with_entropy: bool = True, packed: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, entropy)`` ``[N, T-1]`` float32; ``packed=None`` follows ``batch.packed``."""
        from training.batch import policy_logprobs

        return policy_logprobs(self.model, batch, with_entropy, packed)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` and alikes)."""
    from training.batch import _unwrap

    base = getattr(_unwrap(model), _unwrap(model).base_model_prefix)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(layers)


def shard(module: LogprobModule, mixed_precision: bool = False) -> LogprobModule:
    """Apply FSDP2 ``fully_shard`` to every decoder layer and to the wrapper (the root unit), in place.

    ``mixed_precision`` uses bf16 parameters with float32 gradient reduction (GPU)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(module.model):
        fully_shard(layer, **kw)
    fully_shard(module, **kw)
    return module


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict of a possibly FSDP2-sharded module onto the CPU, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if world()[1] == 1:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                  broadcast_from_rank0=False))


def sync_rollout_weights(llm: Any, rollout_model: nn.Module | None, state: dict[str, torch.Tensor] | None) -> None:
    """Push new weights to the rollout side: load ``state`` into ``rollout_model`` (when it is a separate
    copy) and call ``llm.update_weights(iter(state.items()))`` when the backend has that method (vLLM)."""
    if state is None:
        return
    if rollout_model is not None:
        rollout_model.load_state_dict(state, strict=False)
    if hasattr(llm, "update_weights"):
        llm.update_weights(iter(state.items()))
