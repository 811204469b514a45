"""torch.distributed for the trainer: FSDP2 (``torch.distributed.fsdp.fully_shard``) under ``torchrun``.

Layout (as verl's FSDP workers, much smaller): every rank holds a shard of the policy for the update and a
full, unsharded *rollout* copy for generation (or a vLLM engine); after each update the full weights are
gathered on every rank and pushed to the rollout side (:func:`full_state_dict`, then ``llm.update_weights``
when the backend has it). Each rank rolls out its own slice of the step's questions; the loss is normalised
by *global* token / sequence counts and FSDP averages gradients over ranks, so a step on ``W`` ranks equals
a step on one process with the whole batch. The sharding of the policy and critic themselves (which layers
are units) is :mod:`training.model.fsdp`'s.

Checkpoints hold the *full* (unsharded) optimizer state keyed by parameter names
(:func:`full_optimizer_state` / :func:`load_full_optimizer_state`, torch.distributed.checkpoint's
``get/set_optimizer_state_dict``), the same format on one process and on ``W`` ranks, so a run saved on
``W`` ranks resumes on any number of ranks.

Launch: ``torchrun --nproc_per_node 2 -m sleuth.cli train ...`` (backend ``nccl`` on GPU, ``gloo`` on CPU).
Collectives time out after ``train.dist_timeout_s`` seconds (``sleuth train`` and :func:`training.trainer.rl_train`
pass it; env ``SLEUTH_DIST_TIMEOUT_S`` is only the default of :func:`init_from_env` called without one), so a rank that
died or hangs makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_TIMEOUT_S = 600.0


def world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _timeout_s(timeout_s: float | None) -> float:
    """``timeout_s``, else env ``SLEUTH_DIST_TIMEOUT_S``, else 600; ``ValueError`` (naming where it came from)
    unless finite positive seconds."""
    source = "train.dist_timeout_s"
    if timeout_s is None:
        source, raw = "SLEUTH_DIST_TIMEOUT_S", os.environ.get("SLEUTH_DIST_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"SLEUTH_DIST_TIMEOUT_S must be seconds (a number), got {raw!r}") from None
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"{source} (the distributed timeout) must be finite positive seconds, got {timeout_s}")
    return timeout_s


def init_from_env(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...) when ``WORLD_SIZE > 1``; a no-op otherwise or when a group already exists.

    ``timeout_s`` (default: env ``SLEUTH_DIST_TIMEOUT_S``, else 600 s) bounds every collective, so a rank
    that crashed or hangs makes the others raise instead of blocking forever. Returns ``(rank, world_size)``.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=_timeout_s(timeout_s)))
    return world()


def shutdown(barrier: bool = True) -> None:
    """Barrier, then destroy the process group (the barrier avoids a teardown abort seen with gloo on torch
    2.13 CPU). ``barrier=False`` skips it (on an error path, where the other ranks may be gone)."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    """``dist.barrier()`` on the default group; a no-op on one process."""
    if world()[1] > 1:
        dist.barrier()


def _reduce(x: float, op: str) -> float:
    if world()[1] == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return float(t.item())


def all_reduce_sum(x: float) -> float:
    """Sum of a Python float over ranks (identity without a process group)."""
    return _reduce(x, "sum")


def all_reduce_max(x: float) -> float:
    """Maximum of a Python float over ranks (identity without a process group)."""
    return _reduce(x, "max")


def all_reduce_min(x: float) -> float:
    """Minimum of a Python float over ranks (identity without a process group)."""
    return _reduce(x, "min")


def pad_micro_batches(parts: list[Any]) -> tuple[list[Any], int]:
    """``(parts padded to the most micro-batches any rank has, number of real ones)``.

    FSDP2 all-gathers parameters in every forward and reduce-scatters gradients in every backward, so all
    ranks must run as many micro-batches; token-budget splits (``train.optim.micro_batch_tokens``) differ by rank.
    The padding repeats the last micro-batch; the caller gives it zero loss weight. A collective under
    torchrun; ``(parts, len(parts))`` on one process."""
    n = len(parts)
    if world()[1] == 1:
        return parts, n
    m = int(all_reduce_max(n))
    if n == 0:
        raise ValueError("pad_micro_batches: this rank has no micro-batch to repeat")
    return parts + [parts[-1]] * (m - n), n


def gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (pickled; ``[obj]`` on one process)."""
    if world()[1] == 1:
        return [obj]
    out: list[Any] = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def run_on_rank0(fn: Callable[[], Any], timeout_s: float = 24 * 3600.0) -> Any:
    """Run ``fn()`` on rank 0 only while the other ranks wait, and return its (picklable) result on every
    rank. For setup work that writes files (index, tiny policy, SFT warm start).

    The wait uses a separate gloo group with ``timeout_s`` (default a day: SFT may take longer than the
    collective timeout). If ``fn`` raises on rank 0, or returns something that cannot be pickled, the others
    raise ``RuntimeError`` naming the error instead of waiting; rank 0 re-raises the original exception. On
    one process it is just ``fn()``.
    """
    rank, W = world()
    if W == 1:
        return fn()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    result: Any = None
    error: BaseException | None = None
    if rank == 0:
        try:
            result = ("ok", fn())
            pickle.dumps(result)  # a result that cannot be sent is an error of fn, reported like one
        except BaseException as e:  # noqa: BLE001 - reported to the other ranks, then re-raised
            error, result = e, ("error", f"{type(e).__name__}: {e}")
    box = [result]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    if error is not None:
        raise error
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def clipped_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` of ``params``, as a plain tensor also for FSDP2's DTensor norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict of a possibly FSDP2-sharded module onto the CPU, on *every*
    rank (a collective under torchrun: every rank must call it).

    (``StateDictOptions(cpu_offload=True)`` would leave the full tensors on rank 0 only, so the other
    ranks' rollout copies would never be updated; the gather is done on the device, then copied.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if world()[1] == 1:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().cpu() for k, v in state.items()}


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full (unsharded) optimizer state of ``optimizer`` over ``module``'s (possibly FSDP2-sharded)
    parameters, keyed by parameter name (``{"state": {name: {"step", "exp_avg", ...}}, "param_groups":
    [...]}``, tensors on the CPU): torch.distributed.checkpoint's ``get_optimizer_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``.

    A collective under torchrun (every rank must call it); rank 0 gets the state, the other ranks ``{}``.
    The same format on one process, so a checkpoint resumes on any number of ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a state saved by :func:`full_optimizer_state` into ``optimizer`` (before the first backward).

    Under torchrun only rank 0 needs ``state`` (the others may pass ``{}``): rank 0 broadcasts it tensor by
    tensor and every rank keeps its own shard (``set_optimizer_state_dict`` with
    ``full_state_dict=True, broadcast_from_rank0=True``); a collective. Raises ``RuntimeError`` when a
    trainable parameter has no saved state (a checkpoint of another model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    W = world()[1]
    if W == 1 and not state:
        raise ValueError("load_full_optimizer_state: empty optimizer state")
    set_optimizer_state_dict(module, optimizer, state if (W == 1 or world()[0] == 0) else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=W > 1))


def sync_rollout_weights(llm: Any, rollout_model: nn.Module | None, state: dict[str, torch.Tensor] | None) -> None:
    """Push new weights to the rollout side: load ``state`` into ``rollout_model`` (when it is a separate
    copy) and call ``llm.update_weights(iter(state.items()))`` when the backend has that method (vLLM).

    Raises ``ValueError`` when ``state`` has keys the rollout model does not know, or leaves one of its
    parameters out (tied LM heads excepted): a silent partial load would roll out with stale weights."""
    if state is None:
        return
    if rollout_model is not None:
        missing, unexpected = rollout_model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(getattr(rollout_model, "config", None), "tie_word_embeddings", False) else set()
        missing = [k for k in missing if k not in tied]
        if unexpected or missing:
            raise ValueError(f"rollout weight sync: unexpected keys {list(unexpected)[:5]}, "
                             f"missing keys {missing[:5]}")
    if hasattr(llm, "update_weights"):
        llm.update_weights(iter(state.items()))
