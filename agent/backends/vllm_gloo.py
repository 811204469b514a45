"""A ``gloo`` weight-transfer backend for ``vllm serve`` (vLLM's RL weight-transfer API), so that a trainer
on CPU (or one without NCCL between it and the engines) can push weights into vLLM's own server.

vLLM ships ``nccl`` and ``ipc`` backends (``vllm.distributed.weight_transfer``); this one mirrors the
``nccl`` engine's protocol over a ``torch.distributed`` gloo group:

* ``/init_weight_transfer_engine`` with ``init_info`` = ``master_address``, ``master_port``, ``rank_offset``,
  ``world_size`` (as vLLM's NCCL engine), plus ``packed`` (default ``False``, vLLM's worker default) and
  ``timeout_s`` (the group's formation and every broadcast; default 600). The worker joins the trainer's
  ``TCPStore`` group (:func:`agent.backends.engine_protocol.join_group`) as rank ``rank_offset`` + its rank
  across TP x PP x DP, as the NCCL engine computes it.
* ``/start_weight_update`` and ``/finish_weight_update``: vLLM's layerwise reload, as the NCCL engine.
* ``/update_weights`` with ``update_info`` = ``names``, ``dtype_names``, ``shapes``: unpacked, one
  broadcast per tensor in ``names`` order (byte for byte what the NCCL engine receives with
  ``packed=False``); packed, the whole call is one ``uint8`` broadcast in Sleuth's packed layout
  (:func:`agent.backends.engine_protocol.packed_layout`: each tensor at a 16-byte aligned offset), one
  bucket of the trainer per call. Each received tensor goes to the model's ``load_weights``.

Enabled with ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}'``
once Sleuth is installed beside vLLM: :func:`agent.backends.vllm_plugin.register` (a ``vllm.general_plugins``
entry point in ``pyproject.toml``) registers it in every vLLM process. This module imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from agent.backends.engine_protocol import (
    DTYPES,
    broadcast,
    join_group,
    metas_from_info,
    open_store,
    packed_layout,
    unpack,
)

#: most tensors one ``update_weights`` call may name
MAX_TENSORS = 1_000_000


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """The ``init_info`` of the gloo backend (see the module docstring). ``backend`` may be sent (Sleuth's
    trainer does) and must then be ``"gloo"``. Raises ``ValueError`` for values out of range."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    timeout_s: float = 600.0
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.backend != "gloo":
            raise ValueError(f"this engine's weight-transfer backend is gloo, the trainer asked for {self.backend!r}")
        if not (0 < self.rank_offset < self.world_size and 0 < int(self.master_port) < 65536
                and 0 < float(self.timeout_s) <= 86400):
            raise ValueError(f"init_info out of range: rank_offset {self.rank_offset} in 1..world_size-1 "
                             f"({self.world_size}), master_port {self.master_port} in 1..65535, timeout_s "
                             f"{self.timeout_s} in (0, 86400]")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The ``update_info`` of one call: vLLM's ``names``, ``dtype_names``, ``shapes`` (and, when the trainer
    sends it, ``packed``, which must match the group's)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM's weight-transfer engine over a gloo group (see the module docstring): weights arrive in the
    worker's CPU memory (the model's device when that is not CPU) and are loaded with ``load_weights``.
    Memory: one call's tensors besides the model (packed: one buffer of their bytes)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.store: Any = None
        self.packed = False

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group as rank ``rank_offset`` + this worker's rank across TP x PP x DP (blocks
        until all members joined; raises after ``timeout_s``). A group joined before is left first."""
        self.shutdown()
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        store = open_store(init_info.master_address, int(init_info.master_port), init_info.world_size, False,
                           float(init_info.timeout_s))
        self.group = join_group(store, rank, init_info.world_size, "gloo", float(init_info.timeout_s))
        self.store, self.packed = store, bool(init_info.packed)

    def start_weight_update(self) -> None:
        """Open vLLM's layerwise reload of the served model before the first bucket (as its NCCL engine does)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Close the layerwise reload after the last bucket: vLLM re-derives its processed weights."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One call: receive and load (no accelerator to synchronise: gloo tensors are on the CPU)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive the tensors ``update_info`` names over the group and load them. Raises ``RuntimeError``
        before ``init_transfer_engine``, ``ValueError`` for a malformed ``update_info``, a ``packed`` other
        than the group's, or more bytes than this host has free (refused unread: on CPU vLLM repacks its linear
        weights, so the model's own parameters do not tell its size)."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call /init_weight_transfer_engine first")
        if update_info.packed is not None and bool(update_info.packed) != self.packed:
            raise ValueError(f"update_info packed={update_info.packed}, but the group was initialised with "
                             f"packed={self.packed}")
        metas = metas_from_info({"names": update_info.names, "dtype_names": update_info.dtype_names,
                                 "shapes": update_info.shapes}, MAX_TENSORS)
        offsets, total = packed_layout(metas)
        free = psutil.virtual_memory().available
        if total > free:
            raise ValueError(f"update_info describes {total} bytes, more than the {free} bytes this host has free")
        if self.packed:
            buf = torch.empty(total, dtype=torch.uint8)
            broadcast(self.group, buf)
            pairs = [(n, t.to(self.device)) for n, t in unpack(buf, metas, offsets)]
            self.model.load_weights(pairs)
            return
        for m in metas:
            t = torch.empty(m.shape, dtype=DTYPES[m.dtype])
            broadcast(self.group, t)
            self.model.load_weights([(m.name, t.to(self.device))])

    def shutdown(self) -> None:
        """Forget the transfer group and its store (a new ``init_transfer_engine`` forms another)."""
        self.group = self.store = None
