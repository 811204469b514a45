"""Asynchronous rollouts with bounded staleness: the next step's episodes are generated while this step updates.

In the synchronous loop the rollout of step ``t+1`` waits for the update of step ``t`` and the update waits for
the rollout. :class:`AsyncRollouts` runs the agent loop in a background thread (the generation itself in the
rollout backend: a worker process, :class:`agent.backends.process.ProcessLLM`, or a vLLM engine), on the
weights last pushed to it, one group (``train.rollout.group_size`` episodes of a question) at a time, many groups
batched together by the agent's scheduler. The trainer takes a step's groups from it
(:meth:`AsyncRollouts.take`) and publishes each new weight version after its push
(:meth:`AsyncRollouts.publish`).

Staleness. A group is labelled with the weight version it started with (the oldest weights its tokens may
come from: a push between two of its turns refreshes the rest of it, and the log-probs of every token are
the ones it was sampled with). Its *staleness* when trained on is the trainer's version minus that label. At
most ``questions_per_step x max_staleness`` groups are running or waiting, so a group started right after a
push is trained on within ``max_staleness`` updates, as in verl's one-step-off-policy trainer for
``max_staleness=1``; the rollout correction of :mod:`training.algos.offpolicy` (TIS) weighs the rest.

No starvation. A slow group (a question that takes many turns, a slow search) may finish later than the
bound. Dropping it, as asynchronous trainers with a staleness bound do, would drop the hard questions again
and again, since they are slow every time. Here it is re-queued: generated again with the latest weights,
first in line, and *pinned*: the next step after the one that re-queued it waits for it, so it is trained on
with a staleness of at most 1, once, whatever its length. Groups are trained on oldest first.

Checkpoints of an asynchronous run save the stream position of the oldest question not yet trained on
(:meth:`AsyncRollouts.frontier`): a resume generates again what was in flight (questions trained on out of
order after it come again; none is lost). Resume is therefore not exact, unlike the synchronous mode's.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agent.loop.batch import arun_episodes
from agent.loop.nodes import make_context
from agent.trajectory import Trajectory
from corpora.formats import QAExample
from training.model.lora import base_model, merged_lora_state
from training.rollout.faults import drop_failed


@dataclass
class Group:
    """One question's episodes in the asynchronous pipeline: its stream ``position``, the weight ``version``
    it (last) started with, whether it is ``pinned`` (re-queued at trainer version ``pinned_at``: the next
    step waits for it), and its trajectories once done (``seq``: the order it finished in)."""

    question: QAExample
    position: int
    version: int = -1
    pinned: bool = False
    pinned_at: int = -1
    requeues: int = 0
    trajs: list[Trajectory] | None = field(default=None, repr=False)
    seq: int = 0


class AsyncRollouts:
    """The background producer of rollout groups (see the module docstring).

    ``worker``: a :class:`training.rollout.worker.RolloutWorker` whose backend does not share the trainer's
    parameters (a worker process or an engine with ``update_weights``); ``data``: the question stream (read by
    this producer only while it runs); ``tc``: a :class:`training.config.TrainConfig` (its ``rollout``
    section's ``questions_per_step``, ``group_size``, ``max_staleness``); ``version``: the weight version the backend runs now (the step the run
    starts at). Under ``torchrun`` each rank runs one producer (``rank`` of ``world_size``) over the same stream:
    it reads the questions ``world_size`` at a time and keeps the ``rank``-th (the ranks' questions are
    disjoint, as in the synchronous split), and a step takes ``questions_per_step / world_size`` groups on every
    rank. ``turn_versions``: the backend reports with each turn the trainer's version that generated it (a
    fleet: the version pushed is the step), so a finished group is labelled with its oldest turn's
    (:func:`oldest_version`); a worker process counts its own updates instead, and its groups keep the
    version they started with. :meth:`close` stops it. An error in the producer (a prompt that cannot be built) is raised by
    the next :meth:`take`."""

    def __init__(self, worker: Any, data: Any, tc: Any, version: int, rank: int = 0, world_size: int = 1,
                 turn_versions: bool = False):
        self.worker, self.data, self.turn_versions = worker, data, turn_versions
        rc = tc.rollout
        self.rank, self.world = rank, world_size
        self.qps, self.group_size, self.bound = rc.questions_per_step // world_size, rc.group_size, rc.max_staleness
        self.capacity = self.qps * self.bound
        self.version = version
        self._queue: deque[Group] = deque()  # re-queued groups, started before any new question
        self._running: list[Group] = []
        self._done: list[Group] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="sleuth-async-rollouts", daemon=True)
        self._thread.start()
        self._ready.wait()

    # -- the producer (its own thread and event loop) -----------------------------------------------------
    def _main(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer by take()
            with self._cv:
                self._error = e
                self._cv.notify_all()
        finally:
            self._ready.set()

    async def _produce(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        w = self.worker
        ctx = make_context(w.llm, w.retriever, w.agent, top_k=w.top_k, judge=w.judge)
        self._ready.set()
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                self._wake.clear()  # before looking: a wake-up from now on is not lost
                with self._cv:
                    if self._stop or self._error is not None:
                        break
                    starts = self._admit()
                for g in starts:
                    task = asyncio.create_task(self._run(ctx, g))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await self._wake.wait()
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _admit(self) -> list[Group]:
        """The groups to start now (under the lock): every re-queued one, then new questions while fewer than
        ``capacity`` groups are running or waiting; each labelled with the current weight version."""
        starts = []
        while self._queue or len(self._running) + len(self._done) < self.capacity:
            if self._queue:
                g = self._queue.popleft()
            else:  # a chunk of world-size questions, this rank's one of it (position: the chunk's start)
                q = self.data.next(self.world)[self.rank]
                g = Group(q, self.data.position - self.world)
            g.version = self.version
            self._running.append(g)
            starts.append(g)
        return starts

    async def _run(self, ctx: Any, g: Group) -> None:
        try:
            trajs = await arun_episodes(ctx, [g.question], self.group_size)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a setup error (the prompt cannot be built): fatal
            with self._cv:
                self._error = e
                self._cv.notify_all()
            return
        with self._cv:
            g.trajs, g.seq = trajs, next(self._seq)
            if self.turn_versions:
                g.version = oldest_version(trajs, g.version)
            self._running.remove(g)
            self._done.append(g)
            self._cv.notify_all()

    def _poke(self) -> None:
        """Wake the producer (from the trainer's thread)."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- the trainer's side -------------------------------------------------------------------------------
    def take(self, version: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The next step's trajectories for a trainer at weight version ``version``: ``questions_per_step``
        finished groups, pinned ones first, then oldest first (group ids renumbered 0..G-1; episodes that
        failed on a service outage left out and counted, as in the synchronous rollout). Finished groups older
        than the bound are re-queued and pinned first; the call waits for pinned groups re-queued at an earlier
        version. Returns ``(trajectories, stats)`` with ``async/staleness_mean``, ``async/staleness_max``,
        ``async/requeued`` (this call), ``async/pinned`` (groups of the batch that had been re-queued) and
        ``async/wait_s``. Raises ``RuntimeError`` when the producer failed."""
        t0, requeued = time.time(), 0
        with self._cv:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"the asynchronous rollouts failed: {self._error}") from self._error
                for g in [g for g in self._done if version - g.version > self.bound]:
                    self._done.remove(g)
                    g.pinned, g.pinned_at, g.trajs = True, version, None
                    g.requeues += 1
                    self._queue.append(g)
                    requeued += 1
                if requeued:
                    self._poke()
                owed = [g for g in (*self._queue, *self._running) if g.pinned and g.pinned_at < version]
                ready = sorted(self._done, key=lambda g: (not g.pinned, g.version, g.seq))
                if len(ready) >= self.qps and (not owed or sum(g.pinned for g in ready) >= self.qps):
                    break
                self._cv.wait(timeout=1.0)
            batch = ready[: self.qps]
            for g in batch:
                self._done.remove(g)
        self._poke()  # room for new groups
        trajs: list[Trajectory] = []
        for i, g in enumerate(batch):
            for t in g.trajs:
                t.group = i
                t.metadata["weight_version"] = g.version
            trajs.extend(g.trajs)
        trajs, stats = drop_failed(trajs)
        remap = {g: i for i, g in enumerate(sorted({t.group for t in trajs}))}  # a group may have failed whole
        for t in trajs:
            t.group = remap[t.group]
        stale = [version - g.version for g in batch]
        stats.update({"async/staleness_mean": sum(stale) / len(stale), "async/staleness_max": float(max(stale)),
                      "async/requeued": float(requeued), "async/pinned": float(sum(g.pinned for g in batch)),
                      "async/wait_s": time.time() - t0})
        return trajs, stats

    def publish(self, version: int) -> None:
        """The rollout backend now runs weight version ``version`` (call it after the push): groups started from
        now on are labelled with it."""
        with self._cv:
            self.version = version

    def frontier(self) -> int:
        """The stream position of the oldest question not yet trained on (what a checkpoint saves)."""
        with self._cv:
            return min((g.position for g in (*self._queue, *self._running, *self._done)),
                       default=self.data.position)

    def close(self) -> None:
        """Stop the producer: cancel the running groups and wait for its thread (idempotent)."""
        with self._cv:
            self._stop = True
        self._poke()
        self._thread.join(timeout=60)


def oldest_version(trajs: list[Trajectory], started: int) -> int:
    """A finished group's weight version: the oldest that generated one of its turns, as the rollout backend
    reported it with each turn (``Turn.weight_version``: a fleet engine's; a push between two turns makes the
    later ones newer, a partial rollout). ``started`` (the version published when the group started) stands
    in for turns that report none, and is the version of a group with no turn."""
    versions = [t.weight_version for traj in trajs for t in traj.turns]
    known = [v for v in versions if isinstance(v, int) and not isinstance(v, bool)]
    if not versions:
        return started
    return min(known) if len(known) == len(versions) else min([started, *known])


def rollout_copy(policy: Any, lora: bool) -> Any:
    """The plain model the asynchronous rollout backend starts from: the policy itself (the backend copies
    it) or, with LoRA, a model of the same architecture holding the merged weights
    (:func:`training.model.lora.merged_lora_state`)."""
    base = base_model(policy)
    if not lora:
        return base
    plain = type(base)(base.config)
    plain.load_state_dict(merged_lora_state(policy))
    return plain.to(next(base.parameters()).device)
