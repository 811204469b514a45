"""The trainer's fleet mode (``train.rollout.engines``): rollouts on a fleet of engine servers apart from the
trainer, and the verified weight push to them after every update. The design is in ``docs/fleet.md``.

* **The engines.** ``engines`` is a list of OpenAI-compatible server URLs (``vllm serve`` on GPUs, ``sleuth
  serve-engine``), or a count: rank 0 then starts that many ``sleuth serve-engine`` processes on 127.0.0.1
  from the initial policy (:func:`start_engines`; one node only) and stops them when the run ends.
* **The client.** Every rank sends its episodes to the fleet (:class:`agent.backends.fleet.Fleet`: least
  loaded, episode affinity, engines out of rotation by name). Rank 0 checks the engines first (reachable,
  the model, the tokenizer; a ``vllm serve`` engine: its weight-transfer routes and backend,
  :mod:`training.rollout.vllm_sync`): a :class:`agent.backends.fleet.FleetError` on every rank before the
  first step.
* **The push** (:func:`push`): the trainer's weights gathered one parameter at a time
  (:class:`training.rollout.fleet_sync.FullState`; under ``torchrun`` a collective every rank runs), streamed
  by rank 0 in buckets of ``sync_bucket_bytes`` (:class:`training.rollout.fleet_sync.FleetSync`), then every
  engine verified on the weight-sync probe; a failing engine is out of rotation, named, and the run goes on
  with the others. Before the first step the trainer's weights are pushed once (an engine started from other
  weights, or a resumed run's engines holding an older step, then run exactly the trainer's).
* **Memory.** No rank holds a rollout copy, except rank 0 under ``torchrun``: its full copy is what
  checkpoints and the held-out evaluation read, and it is refreshed by the same stream that feeds the push
  (no second full state dict is gathered).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import torch

from agent.backends.fleet import Fleet
from agent.backends.hf import sequence_logprobs
from training.infra.distributed import run_on_rank0
from training.rollout.fleet_sync import FleetSync, FullState, SyncSettings

log = logging.getLogger(__name__)

#: the served name of the engines the trainer starts
SERVED_NAME = "policy"
#: seconds a started engine may take to answer /health
START_TIMEOUT_S = 300.0


@dataclass
class FleetSide:
    """The fleet of a run: its ``fleet`` client (this rank's), the ``sync`` (rank 0 pushes), ``copy`` (rank 0's
    full model under torchrun, else ``None``), the weight-sync ``probe`` (``None``: no probe check) and its
    tolerance ``tol`` (nats)."""

    fleet: Fleet
    sync: FleetSync
    copy: Any | None
    probe: list[int] | None
    tol: float


def sync_settings(rc: Any) -> SyncSettings:
    """The :class:`training.rollout.fleet_sync.SyncSettings` of a ``train.rollout`` section; raises
    ``ValueError`` naming the setting (a bucket size of 0 or less, disk without a shared directory)."""
    try:
        return SyncSettings(transport=rc.sync_transport, bucket_bytes=rc.sync_bucket_bytes,
                            shared_dir=rc.sync_shared_dir, master_address=rc.sync_master_address,
                            timeout_s=rc.sync_timeout_s)
    except ValueError as e:
        raise ValueError(f"train.rollout.sync_*: {e}") from None


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now (bound and released; another process may take one in between)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_engines(model_dir: Path, n: int, threads: int, logs: Path, stack: contextlib.ExitStack,
                  dtype: str = "float32", timeout_s: float = START_TIMEOUT_S) -> list[str]:
    """Start ``n`` ``sleuth serve-engine`` processes on 127.0.0.1 serving ``model_dir`` as
    :data:`SERVED_NAME` (``threads`` CPU threads each, output in ``logs/engine<i>.log``), wait until each
    answers ``/health``, and return their URLs; ``stack`` stops them (SIGTERM, then SIGKILL after 10 s).
    Raises ``RuntimeError`` naming the engine and the end of its log when one exits or is not up within
    ``timeout_s`` seconds (the others are stopped)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    stack.callback(stop_engines, procs)
    ports = free_ports(n)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    for i, port in enumerate(ports):
        with open(logs / f"engine{i}.log", "ab") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sleuth.cli", "serve-engine", "--model", str(model_dir), "--served-model-name",
                 SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads), "--dtype", dtype],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + timeout_s
    for i, (url, proc) in enumerate(zip(urls, procs, strict=True)):
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (logs / f"engine{i}.log").read_text(errors="replace")[-1500:]
                why = f"exited with code {proc.returncode}" if proc.poll() is not None else \
                    f"did not answer /health within {timeout_s:g} s"
                raise RuntimeError(f"rollout engine {i} ({url}, sleuth serve-engine) {why}; its log ends:\n{tail}")
            with contextlib.suppress(httpx2.TransportError, httpx2.TimeoutException):
                if httpx2.get(url + "/health", timeout=5.0).status_code == 200:
                    break
            time.sleep(0.2)
    log.info("started %d rollout engines: %s", n, ", ".join(urls))
    return urls


def stop_engines(procs: list[subprocess.Popen]) -> None:
    """Stop the engine processes ``procs`` started (SIGTERM, then SIGKILL after 10 s); none is left running."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def engine_urls(state: Any, tc: Any, tokenizer: Any, stack: contextlib.ExitStack) -> list[str]:
    """Rank 0: the URLs of ``train.rollout.engines``, starting the engines when it is a count (from
    ``state.gen_model``, saved to ``run_dir/engines/model``). Raises ``ValueError`` for a count under a
    multi-node torchrun (the engines bind 127.0.0.1 of rank 0's node)."""
    rc = tc.rollout
    if not isinstance(rc.engines, int):
        return list(rc.engines)
    nodes = state.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", state.world_size) or 1)
    if nodes > 1:
        raise ValueError(f"train.rollout.engines={rc.engines} starts engines on rank 0's node (127.0.0.1), which "
                         f"the other {nodes - 1} node(s) cannot reach: start them yourself (vllm serve, sleuth "
                         "serve-engine --host) and list their URLs in train.rollout.engines")
    model_dir = state.run_dir / "engines" / "model"
    state.gen_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    dtype = str(next(state.gen_model.parameters()).dtype).removeprefix("torch.")
    return start_engines(model_dir, rc.engines, rc.engine_threads, state.run_dir / "engines", stack, dtype)


def open_fleet(state: Any, tc: Any, tokenizer: Any, probe: list[int] | None,
               stack: contextlib.ExitStack) -> FleetSide:
    """The run's :class:`FleetSide` (see the module docstring): rank 0 resolves and checks the engines, then
    every rank builds its own client of them. Raises on every rank: ``ValueError`` for bad settings,
    :class:`agent.backends.fleet.FleetError` naming each engine that is unreachable or serves another model or
    tokenizer, ``RuntimeError`` for an engine that could not be started."""
    rc = tc.rollout
    settings = sync_settings(rc)
    kw = {"timeout_s": rc.engine_timeout_s, "retry_waits": tuple(rc.retry_waits) or (1.0,)}
    fleets: list[Fleet] = []

    def resolve() -> tuple[list[str], str]:
        urls = engine_urls(state, tc, tokenizer, stack)
        model = rc.engine_model or (SERVED_NAME if isinstance(rc.engines, int) else None)
        fleets.append(Fleet(urls, tokenizer, model, **kw))  # checks every engine; FleetError names each
        return urls, fleets[0].model

    urls, model = run_on_rank0(resolve)
    fleet = fleets[0] if fleets else Fleet(urls, tokenizer, model, connect=False, **kw)
    sync = FleetSync(fleet, settings, rank=state.rank)
    stack.callback(sync.close)
    run_on_rank0(sync.check_engines)  # vllm serve engines: the weight-transfer routes and backend
    copy = state.rollout_model if state.world_size > 1 else None
    return FleetSide(fleet, sync, copy, probe, rc.sync_probe_tol)


def weights(state: Any, side: FleetSide) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's full weights under the engines' (Hugging Face) names, one parameter gathered at a time
    (every rank must iterate it, in step), each also copied into rank 0's full copy when there is one."""
    stream = FullState(state.fwd, strip="model.")
    target = side.copy.state_dict() if side.copy is not None else None
    for name, t in stream:
        if target is not None:
            with torch.no_grad():
                target[name].copy_(t)
        yield name, t


class Weights:
    """:func:`weights` with the full model's byte count (``nbytes``, for the push's buffer size)."""

    def __init__(self, state: Any, side: FleetSide):
        self.nbytes = FullState(state.fwd).nbytes
        self._it = weights(state, side)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._it


def push(state: Any, side: FleetSide, version: int) -> dict[str, float]:
    """Push the trainer's weights as ``version`` to every engine in rotation (and every one that came back),
    then verify each on the probe against the trainer's own log-probs (rank 0's copy, or the policy on one
    process); every rank calls it. Returns the ``sync/...`` statistics (rank 0's; ``sync/engines_in_rotation``
    on every rank). Raises :class:`training.rollout.weight_sync.WeightSyncError` on every rank when no engine
    is left."""
    model = side.copy if side.copy is not None else state.policy

    def want() -> list[float] | None:  # after the push: the copy is refreshed by the stream
        if side.probe is None:
            return None
        was = model.training
        model.eval()
        try:
            return sequence_logprobs(model, side.probe)
        finally:
            model.train(was)

    stats = side.sync.sync(Weights(state, side), version, side.probe, want, side.tol)
    stats["sync/engines_in_rotation"] = float(len(side.fleet.in_rotation()))
    return stats
