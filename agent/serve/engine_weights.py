"""The weights of an engine server (:mod:`agent.serve.engine`) and the RL weight update that replaces them.

An update follows vLLM's weight-transfer protocol (``/init_weight_transfer_engine`` once, then per update
``/start_weight_update``, ``/update_weights`` one or more times, ``/finish_weight_update``): :meth:`start`
pauses generation (it takes the weights lock once the running batch is done; requests that arrive meanwhile
wait, as under vLLM's ``/pause?mode=keep``), each :meth:`update` receives one bucket of tensors (from the
transfer group, :mod:`agent.backends.engine_protocol`, or from a safetensors file on shared disk) and
copies it into the model in place, and :meth:`finish` sets the new weight version and lets generation go
on. So every generation batch runs on one consistent set of weights, and no second copy of the model is
held: at most one bucket besides the model.

An update left unfinished (the trainer died between start and finish) is abandoned after
``idle_timeout_s`` seconds without a call: generation resumes, but if some tensors were already replaced the
weights are a mix of two versions, and every request is refused (HTTP 503, :class:`PartialWeights`) until a
complete update arrives. Nothing is served silently from mixed weights.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent.backends.engine_protocol import (
    DTYPES,
    broadcast,
    join_group,
    metas_from_info,
    open_store,
    packed_layout,
    unpack,
)

log = logging.getLogger(__name__)


class UpdateError(Exception):
    """A weight-update call the engine refuses: HTTP ``status`` and a message naming what is wrong."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class PartialWeights(RuntimeError):
    """The engine's weights are a mix of two versions (an update was abandoned half way): it serves nothing
    until a complete update arrives."""


@dataclass
class Session:
    """One update between start and finish: tensor names loaded so far, the time of the last call, whether a
    call is running now."""

    loaded: set[str] = field(default_factory=set)
    last: float = field(default_factory=time.monotonic)
    busy: bool = False


class EngineWeights:
    """The model's weights (``model``, a Hugging Face causal LM, updated in place), their ``version`` (a
    string, as vLLM's), the lock that generation batches and updates take in turn, and the transfer group.

    Args:
        model: the served model.
        version: the version of the weights it was loaded with.
        lock_timeout_s: longest wait of a request (or an update's start) for the lock, seconds.
        idle_timeout_s: an update without a call for this long is abandoned (see the module docstring).
        max_tensors: most tensors one ``update_weights`` call may name.
        weights_dir: when set, safetensors buckets are read only from under this directory.
    """

    def __init__(self, model: Any, version: str = "0", lock_timeout_s: float = 600.0, idle_timeout_s: float = 600.0,
                 max_tensors: int = 100_000, weights_dir: str | None = None):
        self.model, self.version = model, version
        self.own: dict[str, torch.Tensor] = model.state_dict()  # views of the parameters: copy_ updates them
        self.model_bytes = sum(t.numel() * t.element_size() for t in self.own.values())
        self.device = next(model.parameters()).device
        self.lock_timeout_s, self.idle_timeout_s, self.max_tensors = lock_timeout_s, idle_timeout_s, max_tensors
        self.weights_dir = Path(weights_dir).resolve() if weights_dir else None
        self.partial = False
        self.session: Session | None = None
        self.group: Any = None
        self.group_info: dict[str, Any] | None = None
        self.stats = {"updates": 0, "tensors_loaded": 0, "bytes_loaded": 0, "abandoned": 0}
        self._lock = threading.Lock()  # the weights: one generation batch or one update session at a time
        self._meta = threading.Lock()  # the session and group fields

    # -- generation's side ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self) -> Iterator[str]:
        """Hold the weights for one generation batch or probe; yields the version they are. Raises
        ``TimeoutError`` after ``lock_timeout_s`` seconds of an update in progress, :class:`PartialWeights`
        when the weights are mixed."""
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(f"waited {self.lock_timeout_s:g} s for the weight update in progress to finish")
        try:
            if self.partial:
                raise PartialWeights("this engine's weights are a mix of two versions (a weight update was left "
                                     "unfinished); it serves again after a complete update")
            yield self.version
        finally:
            self._lock.release()

    # -- the transfer group ---------------------------------------------------------------------------
    def init_group(self, info: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's transfer group (vLLM's ``init_info``: ``master_address``, ``master_port``,
        ``rank_offset``, ``world_size``; ours adds ``backend``, ``"gloo"`` by default, and ``timeout_s``):
        this engine is rank ``rank_offset``. Blocks until every member joined. A group joined before is
        left first. Raises :class:`UpdateError` (422) for a malformed ``init_info``, (504) when the group
        does not form in time."""
        try:
            addr, port = str(info["master_address"]), int(info["master_port"])
            rank, world = int(info["rank_offset"]), int(info["world_size"])
            backend, timeout_s = str(info.get("backend", "gloo")), float(info.get("timeout_s", 600.0))
        except (KeyError, TypeError, ValueError) as e:
            raise UpdateError(422, f"init_info needs master_address, master_port, rank_offset and world_size "
                                   f"({type(e).__name__}: {e})") from None
        if not (0 < rank < world and 0 < port < 65536 and 0 < timeout_s <= 86400):
            raise UpdateError(422, f"init_info out of range: rank_offset {rank} must be in 1..world_size-1 "
                                   f"({world}), master_port {port} in 1..65535, timeout_s {timeout_s} in (0, 86400]")
        if backend not in ("gloo", "nccl"):
            raise UpdateError(422, f"init_info backend must be gloo or nccl, got {backend!r}")
        with self._meta:
            self.group, self.group_info = None, None
        try:
            store = open_store(addr, port, world, False, timeout_s)
            group = join_group(store, rank, world, backend, timeout_s)
        except ValueError as e:
            raise UpdateError(422, str(e)) from None
        except Exception as e:  # noqa: BLE001 - a store that never answers, a member that never came
            raise UpdateError(504, f"could not join the transfer group at {addr}:{port} as rank {rank} of {world} "
                                   f"within {timeout_s:g} s ({type(e).__name__}: {e})") from None
        with self._meta:
            self.group = group
            self.group_info = {"master_address": addr, "master_port": port, "rank": rank, "world_size": world,
                               "backend": backend, "store": store}
        return {"rank": rank, "world_size": world, "backend": backend}

    # -- an update --------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Begin an update: wait for the running batch, then hold generation until :meth:`finish`. Raises
        :class:`UpdateError` 409 when an update is already in progress, 503 after ``lock_timeout_s``."""
        with self._meta:
            if self.session is not None:
                raise UpdateError(409, "a weight update is already in progress on this engine")
            self.session = Session(busy=True)
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            with self._meta:
                self.session = None
            raise UpdateError(503, f"waited {self.lock_timeout_s:g} s for the running generation batch to finish")
        self.session.busy = False
        self.session.last = time.monotonic()
        threading.Thread(target=self._watch, args=(self.session,), daemon=True, name="sleuth-update-watch").start()
        return {"status": "updating", "weight_version": self.version}

    def update(self, info: dict[str, Any]) -> dict[str, Any]:
        """Receive and load one bucket: ``info`` is vLLM's ``update_info`` (``names``, ``dtype_names``,
        ``shapes``, ``packed``: the tensors come over the transfer group) or ours for a file on shared disk
        (``path`` of a ``.safetensors`` file). Returns ``{"loaded": number of tensors}``. Raises
        :class:`UpdateError`: 409 outside an update, 422 for a malformed ``info`` or a name or shape the model
        does not have (the broadcast is still received, so the trainer and the other engines go on), 504
        when the group's broadcast fails."""
        session = self._session()
        session.busy = True
        try:
            if "path" in info:
                pairs = self._from_disk(info)
            else:
                pairs = self._from_group(info)
            with torch.no_grad():
                for name, t in pairs:
                    self.own[name].copy_(t)
                    session.loaded.add(name)
                    self.stats["tensors_loaded"] += 1
                    self.stats["bytes_loaded"] += t.numel() * t.element_size()
            return {"loaded": len(pairs)}
        finally:
            session.busy = False
            session.last = time.monotonic()

    def finish(self, version: str | None) -> dict[str, Any]:
        """End the update: the weights are now ``version`` (default: the old one plus one when it is a number),
        generation goes on. Returns ``{"weight_version", "loaded", "missing"}``: how many weights were
        replaced and the names of those the update left out (at most 20; they keep their old values, and the
        trainer's probe will say so). Raises :class:`UpdateError` 409 outside an update."""
        session = self._session()
        missing = sorted(set(self.own) - session.loaded)
        if version is None:
            version = str(int(self.version) + 1) if self.version.isdigit() else self.version + "+1"
        with self._meta:
            self.version, self.partial, self.session = str(version), False, None
            self.stats["updates"] += 1
        self._lock.release()
        if missing:
            log.warning("weight update %s left %d of %d weights unchanged, e.g. %s", version, len(missing),
                        len(self.own), missing[:3])
        return {"weight_version": self.version, "loaded": len(session.loaded), "missing": missing[:20],
                "missing_count": len(missing)}

    def _session(self) -> Session:
        with self._meta:
            if self.session is None:
                raise UpdateError(409, "no weight update in progress: call /start_weight_update first")
            return self.session

    def _watch(self, session: Session) -> None:
        """Abandon ``session`` once it has been idle for ``idle_timeout_s`` (see the module docstring)."""
        while True:
            time.sleep(min(1.0, self.idle_timeout_s / 4))
            with self._meta:
                if self.session is not session:
                    return
                if session.busy or time.monotonic() - session.last < self.idle_timeout_s:
                    continue
                self.session = None
                self.partial = self.partial or bool(session.loaded)
                self.stats["abandoned"] += 1
            log.error("a weight update was left unfinished for %g s and is abandoned (%d tensors replaced%s)",
                      self.idle_timeout_s, len(session.loaded), ": refusing requests until a complete update"
                      if session.loaded else "")
            self._lock.release()
            return

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        own = self.own.get(name)
        if own is None:
            raise UpdateError(422, f"the served model has no weight {name!r}")
        if tuple(own.shape) != tuple(shape):
            raise UpdateError(422, f"weight {name!r} has shape {list(own.shape)} here, the update sends {list(shape)}")

    def _from_group(self, info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        with self._meta:
            group, backend = self.group, (self.group_info or {}).get("backend")
        if group is None:
            raise UpdateError(409, "no transfer group: call /init_weight_transfer_engine first")
        try:
            metas = metas_from_info(info, self.max_tensors)
        except (TypeError, ValueError) as e:  # a trainer's bug: its broadcast to this engine times out
            raise UpdateError(422, str(e)) from None
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        offsets, total = packed_layout(metas)
        if total > self.model_bytes + 16 * len(metas):  # no bucket of this model is that large: refused unread
            raise UpdateError(422, f"update_info describes {total} bytes, more than the served model's "
                                   f"{self.model_bytes}")
        try:
            if info.get("packed", False):  # vLLM's default: one broadcast per tensor
                buf = torch.empty(total, dtype=torch.uint8, device=device)
                broadcast(group, buf)
                pairs = unpack(buf, metas, offsets)
            else:  # one broadcast per tensor, in order (vLLM's NCCL engine with packed=False)
                pairs = []
                for m in metas:
                    t = torch.empty(m.shape, dtype=DTYPES[m.dtype], device=device)
                    broadcast(group, t)
                    pairs.append((m.name, t))
        except Exception as e:  # noqa: BLE001 - the group is broken (a member gone, a timeout)
            raise UpdateError(504, f"receiving {len(metas)} tensors over the transfer group failed "
                                   f"({type(e).__name__}: {e})") from None
        for m in metas:  # after the broadcast (of at most the model's size): the trainer and the others go on
            self._check(m.name, m.shape)
        return pairs

    def _from_disk(self, info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        raw = info.get("path")
        if not isinstance(raw, str) or not raw.endswith(".safetensors"):
            raise UpdateError(422, f"update_info path must name a .safetensors file, got {raw!r}")
        path = Path(raw).resolve()
        if self.weights_dir is not None and not path.is_relative_to(self.weights_dir):
            raise UpdateError(403, f"{raw} is not under this engine's weights directory (--weights-dir)")
        if not path.is_file():
            raise UpdateError(422, f"no weight file {raw} on this engine's disk (is the directory shared?)")
        try:
            with safe_open(str(path), "pt", device="cpu") as f:
                names = list(f.keys())
                if len(names) > self.max_tensors:
                    raise UpdateError(422, f"{raw} holds {len(names)} tensors; at most {self.max_tensors} per call")
                for n in names:
                    self._check(n, tuple(f.get_slice(n).get_shape()))
                return [(n, f.get_tensor(n)) for n in names]
        except UpdateError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise UpdateError(422, f"cannot read {raw} as safetensors ({type(e).__name__}: {e})") from None
