"""What differs when the rollout engines :class:`training.rollout.fleet_sync.FleetSync` pushes to are ``vllm
serve`` processes (vLLM's RL weight-transfer API) rather than Sleuth's engine servers.

The push is the same four calls (``/init_weight_transfer_engine`` once per group, then ``/start_weight_update``,
one ``/update_weights`` per bucket while the trainer broadcasts it, ``/finish_weight_update`` with the version).
What vLLM needs besides:

* **its routes and a backend.** The routes exist only with ``VLLM_SERVER_DEV_MODE=1``, and a push needs
  ``--weight-transfer-config '{"backend": B}'`` with ``B`` the trainer's transport: ``nccl`` on GPUs (vLLM's
  own), ``gloo`` on CPU (Sleuth's vLLM plugin, :mod:`agent.backends.vllm_gloo`, registered when Sleuth is
  installed beside vLLM). :func:`check_engines` reads each engine's ``GET /server_info`` before the first step
  and raises :class:`agent.backends.fleet.FleetError` naming each engine that lacks either, and the flag to
  add. The disk transport has no vLLM backend, and one transfer group cannot hold both kinds of engine.
* **payloads in vLLM's fields.** ``init_info`` (:func:`init_info`): ``master_address``, ``master_port``,
  ``rank_offset``, ``world_size``, ``packed`` (+ ``timeout_s``, ``backend`` for gloo); ``update_info``:
  ``names``, ``dtype_names``, ``shapes`` only (packing is fixed at init). Over NCCL the trainer joins as vLLM's
  NCCL engine expects (:func:`nccl_group`: a ``StatelessProcessGroup`` and a ``PyNcclCommunicator``, as TRL's
  ``vllm-serve`` client does) and sends one broadcast per tensor (``packed=False``).
* **pause and cache.** ``POST /pause?mode=keep`` before the push (requests in flight freeze, new ones wait)
  and ``POST /resume`` after it, on every engine paused, whatever happened; before the resume,
  ``POST /reset_prefix_cache?reset_running_requests=true``: no key/value computed by the old weights is reused
  (frozen requests are recomputed on the new ones).
* **versions.** vLLM's finish answers no version: the trainer reads ``GET /weight_info`` (the version the
  finish set) instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.backends.fleet import Fleet, FleetError

#: what a ``vllm serve`` engine reports as ``owned_by`` in ``/v1/models``
OWNER = "vllm"


def is_vllm(fleet: Fleet, url: str) -> bool:
    """Whether engine ``url`` of ``fleet`` is a ``vllm serve`` process (by its ``/v1/models`` ``owned_by``)."""
    eng = fleet.engines.get(url)
    return eng is not None and eng.owned_by == OWNER


def flags(transport: str) -> str:
    """The ``vllm serve`` settings that make an engine take pushes over ``transport``."""
    return f"VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{{\"backend\": \"{transport}\"}}'"


def engine_problem(url: str, transport: str, get: Callable[[str, str], dict[str, Any]]) -> str | None:
    """Why ``vllm serve`` engine ``url`` cannot take a push over ``transport`` (``None``: it can).
    ``get(url, path)`` returns a JSON reply or raises an exception with ``status`` (HTTP; 404: no such
    route)."""
    try:
        info = get(url, "/server_info?config_format=json")
    except Exception as e:  # noqa: BLE001 - any failure: named in the message
        if getattr(e, "status", 0) == 404:
            return (f"{url} (vllm serve) has no weight-transfer routes (GET /server_info: HTTP 404): start it "
                    f"with {flags(transport)}")
        return f"{url} (vllm serve): cannot read its configuration (GET /server_info: {e})"
    cfg = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(cfg, dict):
        return f"{url} (vllm serve): GET /server_info?config_format=json gave no vllm_config"
    wt = cfg.get("weight_transfer_config")
    if not isinstance(wt, dict):
        return f"{url} (vllm serve) was started without --weight-transfer-config: start it with {flags(transport)}"
    if wt.get("backend") != transport:
        return (f"{url} (vllm serve) takes weights over {wt.get('backend')!r}, the trainer pushes over "
                f"{transport!r} (train.rollout.sync_transport): start it with {flags(transport)}")
    return None


def check_engines(fleet: Fleet, transport: str, get: Callable[[str, str], dict[str, Any]]) -> None:
    """Check, before the first step, that the ``vllm serve`` engines of ``fleet`` can take pushes over
    ``transport`` (gloo, nccl or disk). Raises :class:`agent.backends.fleet.FleetError` naming each engine that
    cannot and the settings to start it with; for the disk transport with any vLLM engine; and for a fleet
    that mixes ``vllm serve`` with Sleuth's engines (one transfer group cannot serve both). Nothing to check
    (returns) when no engine is a vLLM one."""
    urls = list(fleet.engines)
    vllm = [u for u in urls if is_vllm(fleet, u)]
    if not vllm:
        return
    if len(vllm) < len(urls):
        others = [u for u in urls if u not in vllm]
        raise FleetError(f"the rollout engines mix vllm serve ({', '.join(vllm)}) with other servers "
                         f"({', '.join(others)}): one weight push cannot serve both; use one kind")
    if transport == "disk":
        raise FleetError(f"the disk weight-sync transport cannot push into vllm serve ({', '.join(vllm)}): set "
                         f"train.rollout.sync_transport to gloo (CPU) or nccl (GPU)")
    problems = [p for u in vllm if (p := engine_problem(u, transport, get)) is not None]
    if problems:
        raise FleetError(f"{len(problems)} of {len(vllm)} vllm serve engines cannot take weight pushes: "
                         + "; ".join(problems))


def init_info(master_address: str, port: int, rank_offset: int, world: int, transport: str, packed: bool,
              timeout_s: float) -> dict[str, Any]:
    """The ``init_info`` a ``vllm serve`` engine's ``transport`` backend takes (vLLM's NCCL engine refuses
    fields it does not know)."""
    info: dict[str, Any] = {"master_address": master_address, "master_port": port, "rank_offset": rank_offset,
                            "world_size": world, "packed": packed}
    if transport == "gloo":
        info |= {"backend": "gloo", "timeout_s": timeout_s}
    return info


def nccl_group(master_address: str, port: int, world: int) -> Any:
    """The trainer's end (rank 0) of a vLLM NCCL weight-transfer group (``world`` members): vLLM's
    ``StatelessProcessGroup`` on ``master_address:port`` and a ``PyNcclCommunicator`` on the current CUDA
    device. Needs vLLM and CUDA on the trainer."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init({"master_address": master_address, "master_port": port, "world_size": world})


def nccl_broadcast(group: Any, tensor: Any) -> None:
    """Broadcast ``tensor`` (CUDA, contiguous) from rank 0 of a ``PyNcclCommunicator`` and wait for it."""
    import torch

    stream = torch.cuda.current_stream()
    group.broadcast(tensor, src=0, stream=stream)
    stream.synchronize()
