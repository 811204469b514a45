"""The start-of-run GPU memory check: how much of each GPU is free, and how much something else holds.

A run that starts with most of a GPU taken (another process, or a library in this one that preallocates:
JAX takes 75% of every visible GPU the first time it starts a backend) fails in its first update with an
out-of-memory error that names none of this. :func:`check_gpu_memory` logs every device's free memory at the
start and warns, naming the likely causes, when less than ``min_free`` of a device is free or held by this
process's own PyTorch allocator.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import asdict, dataclass
from typing import TextIO

import torch

GIB = 1024**3
MIN_FREE = 0.9


@dataclass(frozen=True)
class DeviceMemory:
    """One CUDA device's memory at the check, in bytes: ``total``, ``free`` (``cudaMemGetInfo``), ``torch``
    (reserved by this process's PyTorch caching allocator: the run's own tensors and cache) and ``other``
    (``total - free - torch``: other processes, other libraries in this process, the CUDA context)."""

    index: int
    name: str
    total: int
    free: int
    torch: int

    @property
    def other(self) -> int:
        return max(self.total - self.free - self.torch, 0)

    @property
    def usable_fraction(self) -> float:
        """Share of the device that is free or already this run's: ``(free + torch) / total``."""
        return (self.free + self.torch) / self.total if self.total else 0.0

    def line(self) -> str:
        return (f"cuda:{self.index} {self.name}: {self.total / GIB:.1f} GiB, {self.free / GIB:.1f} free, "
                f"{self.torch / GIB:.1f} held by this run's torch, {self.other / GIB:.1f} held elsewhere")


def default_devices() -> list[int]:
    """The devices a run uses: under torchrun (``LOCAL_RANK`` set) this rank's current device, else every
    visible device. Reading a device's memory creates a CUDA context there (a few hundred MiB), so a rank
    reads only its own."""
    if not torch.cuda.is_available():
        return []
    if "LOCAL_RANK" in os.environ:
        return [torch.cuda.current_device()]
    return list(range(torch.cuda.device_count()))


def gpu_memory(devices: list[int] | None = None) -> list[DeviceMemory]:
    """:class:`DeviceMemory` of each device in ``devices`` (default :func:`default_devices`); ``[]`` without
    CUDA."""
    out = []
    for i in default_devices() if devices is None else devices:
        free, total = torch.cuda.mem_get_info(i)
        out.append(DeviceMemory(i, torch.cuda.get_device_name(i), int(total), int(free),
                                int(torch.cuda.memory_reserved(i))))
    return out


def check_gpu_memory(devices: list[int] | None = None, min_free: float = MIN_FREE,
                     stream: TextIO | None = None) -> list[dict]:
    """Print each device's memory (:func:`gpu_memory`) to ``stream`` (default ``sys.stderr``) and warn
    (``UserWarning``) for a device of which less than ``min_free`` (a fraction, default 0.9) is free or held
    by this run's PyTorch allocator. Call it when a run starts; it changes nothing and returns the readings as
    dicts (bytes, plus ``usable_fraction``) for the run's log. Without CUDA it prints nothing and returns
    ``[]``. Raises ``ValueError`` for ``min_free`` outside ``[0, 1]``.
    """
    if not 0.0 <= min_free <= 1.0:
        raise ValueError(f"min_free must be a fraction in [0, 1], got {min_free}")
    readings = gpu_memory(devices)
    for d in readings:
        print(f"GPU memory at start: {d.line()}", file=stream or sys.stderr, flush=True)
        if d.usable_fraction < min_free:
            warnings.warn(
                f"cuda:{d.index}: only {d.usable_fraction:.0%} of the GPU is free or this run's; {d.other / GIB:.1f} "
                f"GiB of {d.total / GIB:.1f} is held by something else (another process on the GPU, or a library in "
                "this process that preallocates, such as JAX: set XLA_PYTHON_CLIENT_PREALLOCATE=false or "
                "JAX_PLATFORMS=cpu if something imports it); the run may run out of memory", stacklevel=2)
    return [asdict(d) | {"usable_fraction": round(d.usable_fraction, 4)} for d in readings]
