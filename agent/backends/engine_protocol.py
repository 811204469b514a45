"""The wire protocol between a trainer and rollout engines that run apart from it (a fleet of servers).

Shared by the engine server (:mod:`agent.serve.engine`), the fleet client (:mod:`agent.backends.fleet`) and
the trainer's weight push (:mod:`training.rollout.fleet_sync`), so that both ends compute the same things:

* **identity**: :func:`tokenizer_fingerprint`, a hash of a tokenizer's vocabulary and special tokens that
  an engine reports in ``GET /v1/models``; a client whose own tokenizer hashes differently refuses the
  engine (its token ids would mean other strings). An engine without the field (``vllm serve``) is checked
  by ``POST /tokenize`` of :data:`IDENTITY_TEXT` instead.
* **weight buckets**: the trainer streams its weights parameter by parameter into buckets of at most a
  given number of bytes. A bucket travels as one flat ``uint8`` buffer (``packed``): each tensor's bytes at
  an offset aligned to :data:`ALIGN` bytes (:func:`packed_layout`), described by the names, dtype names and
  shapes of vLLM's weight-transfer ``update_info`` (``names``, ``dtype_names``, ``shapes``); or, unpacked,
  one broadcast per tensor in that order, which is what vLLM's NCCL engine receives with ``packed=False``.
* **the transfer group**: a process group of the trainer (rank 0) and the engines (ranks ``rank_offset``
  on), made outside ``torch.distributed``'s default group from a ``TCPStore`` (:func:`open_store`,
  :func:`join_group`), as vLLM's ``StatelessProcessGroup`` and TRL's ``init_communicator`` do: a trainer
  under ``torchrun`` already has a default group, and an engine server has none. Gloo on CPU, NCCL on GPUs
  (the same calls; the NCCL path needs CUDA builds of torch on both ends).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

#: the text an engine without a tokenizer fingerprint is asked to tokenise (``POST /tokenize``)
IDENTITY_TEXT = ("Question: who designed the Eiffel Tower?\n<search> Eiffel Tower designer </search>\n"
                 "<information> Gustave Eiffel </information>\n<answer> Gustave Eiffel </answer> 0123456789")

#: byte alignment of each tensor in a packed bucket (a view of ``uint8`` bytes as float64 needs 8)
ALIGN = 16

#: the dtypes a weight update may carry (vLLM's ``dtype_names``: ``str(dtype)`` without ``torch.``)
DTYPES = {name: getattr(torch, name) for name in
          ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A sha256 hex digest of ``tokenizer``'s vocabulary (every ``(token, id)`` pair, added tokens included)
    and its special token ids: equal for two tokenizers that map every string to the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    special = sorted(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class TensorMeta:
    """A weight's Hugging Face checkpoint ``name``, its ``dtype`` name (a key of :data:`DTYPES`) and
    ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


def meta_of(name: str, t: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` of tensor ``t`` named ``name``; ``ValueError`` for a dtype not in
    :data:`DTYPES`."""
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"weight {name!r} has dtype {t.dtype}, which a weight update cannot carry")
    return TensorMeta(name, dtype, tuple(int(d) for d in t.shape))


def update_info(metas: list[TensorMeta], packed: bool) -> dict[str, Any]:
    """vLLM's weight-transfer ``update_info`` for one bucket: ``names``, ``dtype_names``, ``shapes``,
    ``packed``."""
    return {"names": [m.name for m in metas], "dtype_names": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas], "packed": packed}


def metas_from_info(info: dict[str, Any], max_tensors: int) -> list[TensorMeta]:
    """The :class:`TensorMeta` list an ``update_info`` describes; ``TypeError`` when a list is missing,
    ``ValueError`` naming the field for lists of other lengths, a bad name, an unknown dtype, a negative
    dimension, or over ``max_tensors`` tensors."""
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise TypeError("update_info needs the lists names, dtype_names and shapes")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_info lists differ in length: {len(names)} names, {len(dtypes)} dtype_names, "
                         f"{len(shapes)} shapes")
    if len(names) > max_tensors:
        raise ValueError(f"update_info names {len(names)} tensors; at most {max_tensors} per call")
    out = []
    for n, d, s in zip(names, dtypes, shapes, strict=True):
        if not isinstance(n, str) or not n:
            raise ValueError(f"update_info: a name must be a non-empty string, got {n!r}")
        if d not in DTYPES:
            raise ValueError(f"update_info: dtype {d!r} of {n!r} is not one of {sorted(DTYPES)}")
        if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise ValueError(f"update_info: the shape of {n!r} must be a list of integers >= 0, got {s!r}")
        out.append(TensorMeta(n, d, tuple(s)))
    return out


def packed_layout(metas: Iterable[TensorMeta]) -> tuple[list[int], int]:
    """``(byte offset of each tensor, total bytes)`` of a packed bucket: tensors in order, each starting at a
    multiple of :data:`ALIGN`."""
    offsets, total = [], 0
    for m in metas:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += m.nbytes
    return offsets, total


def pack(tensors: list[torch.Tensor], offsets: list[int], buf: torch.Tensor) -> None:
    """Copy each tensor's bytes into ``buf`` (a flat ``uint8`` tensor) at its offset (:func:`packed_layout`),
    on ``buf``'s device."""
    for t, off in zip(tensors, offsets, strict=True):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[off: off + flat.numel()].copy_(flat)


def unpack(buf: torch.Tensor, metas: list[TensorMeta], offsets: list[int]) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` views of a packed bucket ``buf`` (no copy)."""
    out = []
    for m, off in zip(metas, offsets, strict=True):
        view = buf[off: off + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
        out.append((m.name, view))
    return out


def open_store(master_address: str, master_port: int, world_size: int, is_master: bool, timeout_s: float) -> Any:
    """The ``torch.distributed.TCPStore`` of a transfer group: the trainer (``is_master``) binds
    ``master_address:master_port`` (0: a free port, read back as ``store.port``) without waiting for the
    others; an engine connects to it, retrying for up to ``timeout_s`` seconds."""
    import torch.distributed as dist

    return dist.TCPStore(master_address, master_port, world_size, is_master, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process group of ``world_size`` members over ``store``, apart from the default group: every member
    calls it (it returns once all have joined, or raises after ``timeout_s`` seconds). ``backend``:
    ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; needs a CUDA build of torch). Its collectives
    time out after ``timeout_s`` seconds."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not torch.cuda.is_available():
            raise ValueError("the nccl transfer backend needs CUDA and a torch built with NCCL; use gloo")
        opts = nccl.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return nccl(store, rank, world_size, opts)
    raise ValueError(f"unknown transfer backend {backend!r} (gloo or nccl)")


def broadcast(group: Any, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from rank ``src`` of ``group`` to every member, and wait for it (raises
    when the group's timeout passes or a member is gone)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()
