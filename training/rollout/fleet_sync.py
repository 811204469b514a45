"""Weight sync from the trainer to a fleet of rollout engines (:class:`agent.backends.fleet.Fleet`), bounded
and verified.

After an update the trainer streams its weights, parameter by parameter, into buckets of at most
``bucket_bytes`` and sends each bucket to every engine, in vLLM's weight-transfer protocol
(:mod:`agent.serve.engine_weights`: start, one ``update_weights`` per bucket, finish with the version):

* **over a transfer group** (``transport="gloo"`` on CPU, ``"nccl"`` on GPUs: the same code): the trainer is
  rank 0 of a process group with the engines (:func:`agent.backends.engine_protocol.join_group`, apart from
  ``torchrun``'s own group), and each bucket is one broadcast of a packed ``uint8`` buffer (or one per tensor
  with ``packed=False``), as TRL's ``vllm-serve`` and vLLM's NCCL weight transfer do;
* **through shared disk** (``transport="disk"``): each bucket is written atomically as a safetensors file
  under ``shared_dir`` (a temporary name, then renamed), every engine loads it, and it is removed.

Engines that are ``vllm serve`` processes take the same push through vLLM's RL routes, paused around it, in
vLLM's payloads and (NCCL) vLLM's group: :mod:`training.rollout.vllm_sync`; :meth:`FleetSync.check_engines`
refuses before the first step one started without those routes or the transport's backend.

Memory. The trainer's rank 0 holds one parameter as gathered and one bucket (the packed buffer, allocated
once per push: ``min(bucket_bytes, the model's bytes)``; on disk, the bucket's tensors); never a second full copy of
the model. Under FSDP2 :class:`FullState` gathers one parameter at a time (``DTensor.full_tensor``, a
collective every trainer rank runs in step: all ranks call :meth:`FleetSync.sync`, rank 0 alone sends). An
engine holds one bucket besides its model.

Verification. Every engine that took the push must report the new version and no weight left out, and then
score the weight-sync probe as the trainer does (:func:`training.rollout.weight_sync.check_engine`). An engine
that fails any of it (or dies during the push) is taken out of rotation with a message naming it and why,
and the push to the others stands; an engine that rejoined (:meth:`agent.backends.fleet.Fleet.candidates`:
up again after a restart) is pushed to with the others and admitted only once verified. No engine left:
:class:`training.rollout.weight_sync.WeightSyncError`. Under ``torchrun`` rank 0's rotation is then sent to
every rank (:func:`share_rotation`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.backends.engine_protocol import (
    ALIGN,
    broadcast,
    join_group,
    meta_of,
    open_store,
    pack,
    packed_layout,
    update_info,
)
from agent.backends.fleet import Fleet
from agent.backends.openai import tls_context
from training.rollout import vllm_sync
from training.rollout.weight_sync import WeightSyncError, check_engine

log = logging.getLogger(__name__)

TRANSPORTS = ("gloo", "nccl", "disk")


@dataclass
class SyncSettings:
    """How weights reach the fleet: ``transport`` (gloo, nccl or disk), ``bucket_bytes`` (most bytes per
    bucket; default 1 GiB), ``shared_dir`` (disk: a directory every engine reads at the same path),
    ``master_address`` (the trainer's address the engines reach for the transfer group), ``timeout_s`` (every
    engine call, the group's formation and each broadcast), ``packed`` (one broadcast per bucket, else per
    tensor). Raises ``ValueError`` naming the setting for a bucket size of 0 or less, an unknown transport, or
    disk without ``shared_dir``."""

    transport: str = "gloo"
    bucket_bytes: int = 1 << 30
    shared_dir: str | None = None
    master_address: str = "127.0.0.1"
    timeout_s: float = 600.0
    packed: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"the weight-sync bucket size must be a positive number of bytes, got {self.bucket_bytes!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown weight-sync transport {self.transport!r}: one of {', '.join(TRANSPORTS)}")
        if self.transport == "disk" and not self.shared_dir:
            raise ValueError("the disk weight-sync transport needs shared_dir: a directory every engine reads")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"the weight-sync timeout must be finite positive seconds, got {self.timeout_s}")


class FullState:
    """The full weights of a (possibly FSDP2-sharded) module as ``(name, tensor)`` pairs, gathered one at a
    time when iterated (``DTensor.full_tensor``: under ``torchrun`` every rank must iterate it, in step), with
    ``strip`` removed from the front of each name (``"model."`` for a
    :class:`training.model.forward.LogprobModule`). ``nbytes``: the full weights' bytes (from the shapes; no
    gather)."""

    def __init__(self, module: torch.nn.Module, strip: str = ""):
        self.module, self.strip = module, strip
        self.nbytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.module.state_dict().items():
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield name.removeprefix(self.strip), t.detach()


class Stream:
    """``named_tensors`` iterated once, with its ``nbytes`` (when it has one) and :meth:`drain` to run what is
    left of it (under FSDP every parameter's gather is a collective the other ranks wait in)."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        self.nbytes = getattr(named_tensors, "nbytes", None)
        self._it = iter(named_tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._it

    def drain(self) -> None:
        for _ in self._it:
            pass


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of ``named_tensors`` whose packed size (:func:`agent.backends.engine_protocol.packed_layout`)
    stays within ``bucket_bytes``; a tensor larger than that is a bucket of its own."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nb = t.numel() * t.element_size()
        start = -(-size // ALIGN) * ALIGN
        if cur and start + nb > bucket_bytes:
            yield cur
            cur, start = [], 0
        cur.append((name, t))
        size = start + nb
    if cur:
        yield cur


class EngineCallError(RuntimeError):
    """An engine route answered an error or nothing: ``status`` (HTTP, or 0 when unreachable)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class FleetSync:
    """The trainer's side of the weight sync to ``fleet`` (see the module docstring). ``settings``: a
    :class:`SyncSettings`; ``rank``: this trainer rank (default: torch.distributed's, 0 without a group);
    only rank 0 talks to the engines. :attr:`last` holds the last push's statistics."""

    def __init__(self, fleet: Fleet, settings: SyncSettings | None = None, rank: int | None = None):
        from training.infra.distributed import world

        self.fleet, self.settings = fleet, settings or SyncSettings()
        self.rank = world()[0] if rank is None else rank
        self.group: Any = None
        self.store: Any = None
        self.members: tuple[str, ...] = ()
        self.vllm = False  # the group's members are vllm serve engines (vLLM's payloads; NCCL: vLLM's group)
        self._buf: torch.Tensor | None = None
        self._http: Any = None
        self.last: dict[str, float] = {}

    def check_engines(self) -> None:
        """Before the first step: each ``vllm serve`` engine of the fleet has the weight-transfer routes and
        the backend of this transport (:func:`training.rollout.vllm_sync.check_engines`); raises
        :class:`agent.backends.fleet.FleetError` naming each that has not, and the flag to add."""
        vllm_sync.check_engines(self.fleet, self.settings.transport,
                                lambda url, path: self._get(url, path, min(self.settings.timeout_s, 120.0)))

    # -- the whole step ---------------------------------------------------------------------------------
    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, probe: list[int] | None,
             want: list[float] | Callable[[], list[float] | None] | None, tol: float) -> dict[str, float]:
        """Push ``named_tensors`` (e.g. a :class:`FullState`) as weight ``version`` to every engine in rotation
        and every candidate, then verify each on ``probe`` against the trainer's log-probs ``want`` (or
        ``want()``, called on rank 0 after the push)
        (:func:`training.rollout.weight_sync.check_engine`; no probe check when ``probe`` is ``None``). Every
        trainer rank calls it (the others only iterate ``named_tensors``); the rotation is then rank 0's on
        all ranks. Returns ``sync/...`` statistics (rank 0). Raises
        :class:`training.rollout.weight_sync.WeightSyncError` on every rank when no engine is left."""
        stats: dict[str, float] = {}
        error: BaseException | None = None
        stream = Stream(named_tensors)
        if self.rank != 0:
            stream.drain()
        else:
            try:
                targets = self.fleet.in_rotation() + self.fleet.candidates()
                pushed = self.push(stream, version, targets)
                if callable(want):  # the trainer's log-probs, scored once the stream has run (a refreshed copy)
                    want = want()
                stats = {**self.last, **self.verify(pushed, version, probe, want, tol)}
            except BaseException as e:  # noqa: BLE001 - the other ranks still get the rotation, then it is raised
                error = e
                stream.drain()  # the other ranks gather every parameter in step: rank 0 must too
        failed = share_rotation(self.fleet, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if failed is not None:
            raise WeightSyncError(f"rank 0 failed the weight sync of version {version}: {failed}")
        if not self.fleet.in_rotation():
            why = "; ".join(f"{u}: {e['reason']}" for u, e in self.fleet.describe().items())
            raise WeightSyncError(f"no rollout engine runs weight version {version} ({why})")
        return stats

    def verify(self, urls: list[str], version: int | None, probe: list[int] | None, want: list[float] | None,
               tol: float) -> dict[str, float]:
        """Score ``probe`` on each engine of ``urls`` against ``want`` (the trainer's log-probs); each that
        fails is taken out of rotation, naming it; each that passes is admitted at ``version`` (``None``: the
        check before the first step, which admits nothing new). Returns ``sync/engines_verified``,
        ``sync/engines_failed`` and, over the engines that passed, the largest ``sync/probe_lp_diff_mean``
        and ``sync/probe_lp_diff_max``."""
        def check(url: str) -> dict[str, float] | Exception:
            try:
                return check_engine(self.fleet.handle(url), None, probe, tol, want=want, what=f"rollout engine {url}")
            except Exception as e:  # noqa: BLE001 - WeightSyncError, or the probe request failed
                return e

        results: dict[str, Any] = {u: {} for u in urls}
        if probe is not None and urls:
            with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:  # the engines score it at once
                results = dict(zip(urls, pool.map(check, urls), strict=True))
        ok, means, maxes = 0, [0.0], [0.0]
        for url, s in results.items():
            if isinstance(s, Exception):
                self.fleet.take_out(url, f"failed the weight-sync check after version {version}: {s}")
                continue
            means.append(s.get("sync/probe_lp_diff_mean", 0.0))
            maxes.append(s.get("sync/probe_lp_diff_max", 0.0))
            ok += 1
            if version is not None:
                self.fleet.admit(url, version)
        return {"sync/engines_verified": float(ok), "sync/engines_failed": float(len(urls) - ok),
                "sync/probe_lp_diff_mean": max(means), "sync/probe_lp_diff_max": max(maxes)}

    # -- the push ---------------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, targets: list[str]) -> list[str]:
        """Send ``named_tensors`` as ``version`` to the engines ``targets``; returns those that took it whole
        (finished at ``version``, no weight left out). The others are taken out of rotation, each with its
        reason. Always iterates ``named_tensors`` to its end (under FSDP the other ranks gather in step).
        Sets :attr:`last`: ``sync/push_s``, ``sync/buckets``, ``sync/bytes``, ``sync/engines_pushed``."""
        t0 = time.monotonic()
        vllm = [u for u in targets if vllm_sync.is_vllm(self.fleet, u)]
        paused = self._call_all(vllm, "/pause?mode=keep", {}, "pause generation")  # ours pause at start
        try:
            targets = [u for u in targets if u not in vllm or u in paused]
            live = self._call_all(targets, "/start_weight_update", {"is_checkpoint_format": True},
                                  "start the update")
            if self.settings.transport == "disk":
                live, n_buckets, n_bytes = self._push_disk(named_tensors, version, live)
            else:
                live, n_buckets, n_bytes = self._push_group(named_tensors, live)
            replies = self._call_all(live, "/finish_weight_update", {"weight_version": str(version)},
                                     "finish the update", replies=True)
            for url in [u for u in replies if u in vllm]:
                replies[url] = self._vllm_finished(url)
        finally:
            for url in paused:  # whatever happened: a paused engine holds its requests
                try:
                    self._post(url, "/resume", {})
                except EngineCallError as e:
                    self.fleet.take_out(url, f"could not resume generation after the push: {e}")
        pushed = []
        for url, reply in replies.items():
            if str(reply.get("weight_version")) != str(version):
                self.fleet.take_out(url, f"reports weight version {reply.get('weight_version')!r} after the push of "
                                         f"version {version}" + (f" ({reply['error']})" if reply.get("error") else ""))
            elif reply.get("missing_count"):
                self.fleet.take_out(url, f"left {reply['missing_count']} weights of version {version} unloaded "
                                         f"(e.g. {reply.get('missing', [])[:3]})")
            else:
                pushed.append(url)
        self.last = {"sync/push_s": time.monotonic() - t0, "sync/buckets": float(n_buckets),
                     "sync/bytes": float(n_bytes), "sync/engines_pushed": float(len(pushed))}
        return pushed

    def _vllm_finished(self, url: str) -> dict[str, Any]:
        """A ``vllm serve`` engine after its finish: its prefix cache reset (no key/value of the old weights
        reused; frozen requests recomputed) and the version it reports (``GET /weight_info``)."""
        try:
            if not self._post(url, "/reset_prefix_cache?reset_running_requests=true", {}).get("success"):
                return {"weight_version": None, "missing_count": 0, "error": "its prefix cache was not reset"}
            return {"weight_version": self._get(url, "/weight_info").get("weight_version"), "missing_count": 0}
        except EngineCallError as e:
            return {"weight_version": None, "missing_count": 0, "error": str(e)}

    def _push_disk(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                   live: list[str]) -> tuple[list[str], int, int]:
        from safetensors.torch import save_file

        d = Path(self.settings.shared_dir or ".")
        d.mkdir(parents=True, exist_ok=True)
        n_buckets = n_bytes = 0
        for i, bucket in enumerate(buckets(named_tensors, self.settings.bucket_bytes)):
            n_buckets += 1
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if not live:
                continue  # still gathered to the end: the other ranks are in step
            path = (d / f"sleuth-weights-v{version}-{os.getpid()}-{i:05d}.safetensors").resolve()
            tensors, seen = {}, set()
            for name, t in bucket:
                t = t.detach().to("cpu").contiguous()
                if t.data_ptr() in seen:  # tied weights share storage: safetensors wants a copy
                    t = t.clone()
                seen.add(t.data_ptr())
                tensors[name] = t
            tmp = path.with_name(path.name + ".tmp")
            try:
                save_file(tensors, str(tmp))
                os.replace(tmp, path)
                live = self._call_all(live, "/update_weights", {"update_info": {"path": str(path)}},
                                      f"load bucket {i} ({path.name})")
            finally:
                tmp.unlink(missing_ok=True)
                path.unlink(missing_ok=True)
        return live, n_buckets, n_bytes

    def _push_group(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                    live: list[str]) -> tuple[list[str], int, int]:
        s = self.settings
        if live:
            live = self._form_group(live)
        device = torch.device("cuda", torch.cuda.current_device()) if s.transport == "nccl" else torch.device("cpu")
        packed = s.packed and not (self.vllm and s.transport == "nccl")  # vLLM's NCCL: one broadcast per tensor
        cap = min(s.bucket_bytes, getattr(named_tensors, "nbytes", None) or s.bucket_bytes)
        n_buckets = n_bytes = 0
        for i, bucket in enumerate(buckets(named_tensors, s.bucket_bytes)):
            metas = [meta_of(n, t) for n, t in bucket]
            offsets, total = packed_layout(metas)
            n_buckets, n_bytes = n_buckets + 1, n_bytes + total
            if not live:
                continue
            if packed:
                if self._buf is None or self._buf.numel() < total or self._buf.device != device:
                    self._buf = torch.empty(max(cap, total), dtype=torch.uint8, device=device)
                pack([t for _, t in bucket], offsets, self._buf)
                payload = [self._buf[:total]]
            else:
                payload = [t.detach().to(device).contiguous() for _, t in bucket]
            info = update_info(metas, packed)
            if self.vllm:  # vLLM's update_info: packing was fixed at init
                info.pop("packed")
            live = self._send_bucket(i, live, info, payload)
        self._buf = None  # the training step gets the memory back
        return live, n_buckets, n_bytes

    def _send_bucket(self, i: int, live: list[str], info: dict[str, Any], payload: list[torch.Tensor]) -> list[str]:
        """Broadcast one bucket to the group while each engine's ``/update_weights`` receives it. An engine
        that refuses it (HTTP 403, 409, 422) or is gone is taken out, and the group formed again without it;
        when the others did not get the bucket either (the broadcast failed), it is sent again (at most three
        rounds in all; never to ``vllm serve`` engines, :meth:`_vllm_bucket_failed`). Returns the engines
        left."""
        for attempt in range(3):
            failed, group_error = self._broadcast_round(live, info, payload)
            if not failed and group_error is None:
                return live
            if self.vllm:
                return self._vllm_bucket_failed(i, live, failed, group_error)
            dropped = [u for u, e in failed.items() if e.status in (403, 409, 422) or not self._alive(u)]
            for u in dropped:
                self.fleet.take_out(u, f"weight push bucket {i} failed: {failed[u]}")
            live = [u for u in live if u not in dropped]
            self.group = None  # its members changed, or it is broken
            if not live:
                return []
            delivered = group_error is None and set(failed) <= set(dropped)
            if attempt < 2:
                log.warning("weight push bucket %d: %s; forming the transfer group again with %s", i,
                            group_error or "; ".join(f"{u}: {e}" for u, e in failed.items()), live)
            live = self._form_group(live)
            if delivered or not live:  # the others have this bucket: the next one goes to the new group
                return live
        for url in live:
            self.fleet.take_out(url, f"weight push bucket {i} failed in three rounds over the transfer group")
        return []

    def _vllm_bucket_failed(self, i: int, live: list[str], failed: dict[str, EngineCallError],
                            group_error: BaseException | None) -> list[str]:
        """Bucket ``i`` failed on ``vllm serve`` engines: a failed ``update_weights`` ends that engine's update
        (vLLM refuses the next bucket), so no second round. Each that failed is taken out; when the broadcast
        itself failed, all are. Returns the engines left, in a group formed again."""
        self.group = None
        for u, e in failed.items():
            self.fleet.take_out(u, f"weight push bucket {i} failed: {e}")
        live = [u for u in live if u not in failed]
        if group_error is not None:
            for u in live:
                self.fleet.take_out(u, f"weight push bucket {i}: the transfer group failed ({group_error})")
            return []
        return self._form_group(live) if live else []

    def _broadcast_round(self, live: list[str], info: dict[str, Any],
                         payload: list[torch.Tensor]) -> tuple[dict[str, EngineCallError], BaseException | None]:
        group_error = None
        with concurrent.futures.ThreadPoolExecutor(len(live)) as pool:
            futs = {u: pool.submit(self._post, u, "/update_weights", {"update_info": info}) for u in live}
            try:
                for t in payload:
                    if self.vllm and self.settings.transport == "nccl":
                        vllm_sync.nccl_broadcast(self.group, t)
                    else:
                        broadcast(self.group, t)
            except Exception as e:  # noqa: BLE001 - a member gone or a timeout: the group is broken
                group_error = e
                self.group = None
            failed = {}
            for u, f in futs.items():
                try:
                    f.result()
                except EngineCallError as e:
                    failed[u] = e
        return failed, group_error

    # -- the transfer group -----------------------------------------------------------------------------
    def _form_group(self, urls: list[str]) -> list[str]:
        """The transfer group of the trainer (rank 0) and ``urls`` (ranks from 1 on, by each engine's
        ``/get_world_size``), formed again when its members changed; engines that cannot join are taken out
        and the group formed without them (twice at most). Returns the members (empty: none could join).
        Raises :class:`training.rollout.weight_sync.WeightSyncError` when the group does not form and no
        engine says why."""
        if self.group is not None and self.members == tuple(urls):
            return urls
        self.group, self.members = None, ()
        for _ in range(2):
            sizes = {}
            for u in urls:
                try:
                    sizes[u] = int(self._get(u, "/get_world_size")["world_size"])
                except (EngineCallError, KeyError, TypeError, ValueError) as e:
                    self.fleet.take_out(u, f"cannot tell its transfer-group size (GET /get_world_size: {e})")
            urls = [u for u in urls if u in sizes]
            if not urls:
                return []
            group, store, bad, error = self._join(urls, sizes)
            if group is not None and not bad:
                self.group, self.store, self.members = group, store, tuple(urls)
                return urls
            if not bad:
                raise WeightSyncError(f"the weight-transfer group of {urls} did not form within "
                                      f"{self.settings.timeout_s:g} s ({error})")
            for u, e in bad.items():
                self.fleet.take_out(u, f"could not join the weight-transfer group: {e}")
            urls = [u for u in urls if u not in bad]
        return []

    def _join(self, urls: list[str], sizes: dict[str, int]) -> tuple[Any, Any, dict[str, EngineCallError], Any]:
        """One attempt at the group: ``(group or None, store, engines whose join failed, the trainer's
        error)``."""
        s = self.settings
        world = 1 + sum(sizes.values())
        self.vllm = vllm_sync.is_vllm(self.fleet, urls[0])
        nccl_vllm = self.vllm and s.transport == "nccl"
        store = None if nccl_vllm else open_store(s.master_address, 0, world, True, s.timeout_s)
        port = free_port(s.master_address) if store is None else store.port
        offsets, nxt = {}, 1
        for u in urls:
            offsets[u], nxt = nxt, nxt + sizes[u]

        def info(u: str) -> dict[str, Any]:
            if self.vllm:
                return vllm_sync.init_info(s.master_address, port, offsets[u], world, s.transport,
                                           s.packed and not nccl_vllm, s.timeout_s)
            return {"master_address": s.master_address, "master_port": port, "rank_offset": offsets[u],
                    "world_size": world, "backend": s.transport, "timeout_s": s.timeout_s}

        group, error, bad = None, None, {}
        with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
            futs = {u: pool.submit(self._post, u, "/init_weight_transfer_engine", {"init_info": info(u)})
                    for u in urls}
            try:
                group = (vllm_sync.nccl_group(s.master_address, port, world) if nccl_vllm
                         else join_group(store, 0, world, s.transport, s.timeout_s))
            except Exception as e:  # noqa: BLE001 - a member never joined: its own call says why
                error = e
            for u, f in futs.items():
                try:
                    f.result()
                except EngineCallError as e:
                    bad[u] = e
        return group, store, bad, error

    # -- HTTP -----------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        key = self.fleet.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _client(self) -> Any:
        """One HTTP client for every engine call (thread-safe; its connections are kept between calls)."""
        import httpx2

        if self._http is None:
            self._http = httpx2.Client(headers=self._headers(), timeout=self.settings.timeout_s + 30,
                                       verify=tls_context(), limits=httpx2.Limits(max_connections=256))
        return self._http

    def close(self) -> None:
        """Close the HTTP client (the transfer group is left to the engines' next init)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx2

        try:
            r = self._client().post(url + path, json=body)
        except (httpx2.TransportError, httpx2.TimeoutException) as e:
            raise EngineCallError(f"POST {path} got no answer ({type(e).__name__}: {e or 'timed out'})") from None
        if r.status_code != 200:
            raise EngineCallError(f"POST {path} answered HTTP {r.status_code}: {r.text[:300]}", r.status_code)
        try:
            return r.json()
        except ValueError:
            raise EngineCallError(f"POST {path} answered something that is not JSON: {r.text[:200]!r}") from None

    def _get(self, url: str, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        import httpx2

        try:
            r = self._client().get(url + path, timeout=timeout_s or self.fleet.connect_timeout_s)
            if r.status_code != 200:
                raise EngineCallError(f"GET {path} answered HTTP {r.status_code}: {r.text[:200]}", r.status_code)
            return r.json()
        except (httpx2.TransportError, httpx2.TimeoutException, ValueError) as e:
            raise EngineCallError(f"GET {path} failed ({type(e).__name__}: {e or 'timed out'})") from None

    def _alive(self, url: str) -> bool:
        try:
            self._get(url, "/health")
        except EngineCallError:
            return False
        return True

    def _call_all(self, urls: list[str], path: str, body: dict[str, Any], what: str,
                  replies: bool = False) -> Any:
        """POST ``body`` to ``path`` of every engine of ``urls`` at once; each that fails is taken out of
        rotation (``what`` says what it failed to do). Returns the engines that answered (or, with
        ``replies``, ``{url: reply}``)."""
        if not urls:
            return {} if replies else []
        with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
            futs = {u: pool.submit(self._post, u, path, body) for u in urls}
            out = {}
            for u, f in futs.items():
                try:
                    out[u] = f.result()
                except EngineCallError as e:
                    self.fleet.take_out(u, f"could not {what}: {e}")
        return out if replies else [u for u in urls if u in out]


def free_port(host: str) -> int:
    """A TCP port on ``host`` that is free now (for a group whose store the trainer binds itself later)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def share_rotation(fleet: Fleet, error: str | None = None) -> str | None:
    """Under ``torchrun``, give every rank's ``fleet`` rank 0's rotation (which engines are in, why the others
    are out, the weight versions): each rank routes its own requests. ``error``: rank 0's failure of the sync,
    returned on every rank (so that all raise, not rank 0 alone). A collective; returns ``error`` on one
    process."""
    from training.infra.distributed import world

    rank, W = world()
    if W == 1:
        return error
    import torch.distributed as dist

    box = [(fleet.describe(), error) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    states, error = box[0]
    if rank != 0:
        for url, state in states.items():
            if state["in_rotation"]:
                fleet.admit(url, state["weight_version"])
            else:
                fleet.take_out(url, state["reason"])
    return error
