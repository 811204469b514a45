"""External agent episodes on threads of their own, so that nothing an agent does can stop its caller.

An agent is user code: a tool may call ``time.sleep``, a synchronous HTTP client or a database driver
inside an ``async def``, which blocks whatever event loop runs it. Run in the trainer's (or ``sleuth
serve``'s) loop, such a call would freeze every other episode and the timeout meant to end it, since
``asyncio.wait_for`` needs the loop to run. :class:`AgentThreads` therefore runs each episode's coroutine
on a worker thread with an event loop of its own, one episode per worker at a time, and waits for it from
the caller's loop, where the time limit always fires:

* an agent that hangs without blocking (``await`` on something that never comes) is cancelled at the limit,
  and its worker takes the next episode;
* an agent blocked in a call that does not return cannot be stopped by Python (no thread can be killed):
  it is cancelled (the cancellation lands when the call returns), its worker is retired (it ends once the
  call returns) and another takes its place; the outcome says so (``blocked``). Workers are daemon threads,
  and so are the threads of their loops' default executors (where LangChain runs synchronous tools and
  ``asyncio.to_thread`` runs functions), so a blocked agent never keeps the process from exiting.

Workers and their loops live as long as the :class:`AgentThreads` (rather than one loop per episode): HTTP
clients an agent leaves to the garbage collector (the ``openai`` client closes itself on the loop running
when it is collected) then find their loop still open, instead of failing on a closed one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import itertools
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

#: seconds a cancelled agent is given to stop before it is reported as blocked (its worker retired)
STOP_GRACE_S = 0.2


class DaemonExecutor(concurrent.futures.ThreadPoolExecutor):
    """An executor that runs each call on a new daemon thread: the default executor of a worker's loop (a
    ``ThreadPoolExecutor`` by type, as asyncio requires). A ``ThreadPoolExecutor``'s own threads are joined at
    interpreter exit, so one synchronous tool blocked forever would keep the process from ending."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                fut.set_exception(e)

        threading.Thread(target=run, daemon=True, name="sleuth-agent-tool").start()
        return fut


@dataclass
class Isolated:
    """How an isolated run ended: ``result`` (the coroutine's value), or ``error`` (what it raised), or
    ``timed_out``; ``blocked``: it timed out and did not stop within :data:`STOP_GRACE_S` of being cancelled
    (a call that blocks its thread; the worker is retired)."""

    result: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    blocked: bool = False


class _Worker:
    """A daemon thread running an event loop until :meth:`stop`."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(DaemonExecutor())
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            _close(self.loop)

    def stop(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            pass


class AgentThreads:
    """Worker threads for agent episodes (see the module docstring); ``name`` prefixes their thread names.
    Thread-safe; :meth:`run` from any event loop. :meth:`close` stops the workers (not the retired ones, which
    end when their blocking call returns)."""

    def __init__(self, name: str = "sleuth-agent"):
        self.name = name
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            w = _Worker(f"{self.name}-{next(self._ids)}")
            self._all.add(w)
            return w

    def _give_back(self, w: _Worker) -> None:
        with self._lock:
            if w in self._all:
                self._idle.append(w)

    async def run(self, make: Callable[[], Awaitable[Any]], timeout_s: float) -> Isolated:
        """Await ``make()`` (a coroutine built on the worker) on a worker's loop for at most ``timeout_s``
        seconds of the caller's clock (0 or less: times out at once). Never raises for what the coroutine does;
        cancelling the caller cancels the agent too."""
        w = self._take()
        run = _Run(w.loop)
        # a fresh context: the caller's context variables (tracing, callbacks) stay with the caller
        w.loop.call_soon_threadsafe(run.start, make, context=contextvars.Context())
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(run.outcome)), max(timeout_s, 0.0))
        except TimeoutError:
            return Isolated(timed_out=True, blocked=not await self._stop(w, run))
        except asyncio.CancelledError:
            await asyncio.shield(self._stop(w, run))
            raise
        except BaseException as e:  # noqa: BLE001 - the agent's exception is its outcome
            self._give_back(w)
            return Isolated(error=e)
        self._give_back(w)
        return Isolated(result=result)

    async def _stop(self, w: _Worker, run: _Run) -> bool:
        """Cancel ``run`` on worker ``w``; give ``w`` back when the episode has ended within
        :data:`STOP_GRACE_S`, else retire it (its loop stops when the episode ends). Returns whether it ended."""
        run.cancel()
        for _ in range(int(STOP_GRACE_S / 0.01)):
            if run.finished.is_set():
                break
            await asyncio.sleep(0.01)
        if run.finished.is_set():
            self._give_back(w)
            return True
        with self._lock:
            self._all.discard(w)
        run.retire()
        return False

    def close(self) -> None:
        """Stop every worker. The garbage the agents left is collected first, while their loops still run (an
        HTTP client closes itself on the loop it was made on)."""
        gc.collect()
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.stop()


class _Run:
    """One episode on a worker's ``loop``: :meth:`start` (on the loop) runs it as a task whose end sets
    ``outcome`` (a thread-safe future of its value) and ``finished`` (set only when the coroutine has really
    ended, not when it is merely asked to stop, as a cancelled future would say); :meth:`cancel` and
    :meth:`retire` may be called from any thread. A retired run stops its loop when it ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.outcome: concurrent.futures.Future = concurrent.futures.Future()
        self.finished = threading.Event()
        self.task: asyncio.Task | None = None
        self.cancelled = self.retired = False
        self._lock = threading.Lock()

    def start(self, make: Callable[[], Awaitable[Any]]) -> None:
        self.task = self.loop.create_task(_call(make))
        self.task.add_done_callback(self._ended)
        with self._lock:
            if self.cancelled:  # asked to stop before the task existed
                self.task.cancel()

    def _ended(self, task: asyncio.Task) -> None:
        if not self.outcome.done():
            if task.cancelled() and self.cancelled:
                self.outcome.cancel()
            elif task.cancelled():  # by the agent's own code: an error of the agent, not the caller's cancellation
                self.outcome.set_exception(RuntimeError("the agent's task was cancelled from within"))
            elif task.exception() is not None:
                self.outcome.set_exception(task.exception())
            else:
                self.outcome.set_result(task.result())
        with self._lock:
            self.finished.set()
            if self.retired:
                self.loop.stop()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self.task is not None:
                self._soon(self.task.cancel)

    def retire(self) -> None:
        with self._lock:
            self.retired = True
            if self.finished.is_set():
                self._soon(self.loop.stop)

    def _soon(self, fn: Callable[[], Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop has closed: nothing is left to stop
            pass


async def _call(make: Callable[[], Awaitable[Any]]) -> Any:
    return await make()


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """End a worker's loop as ``asyncio.run`` does: cancel what it left running, close async generators."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except BaseException:  # noqa: BLE001, S110 - best effort: the episodes' outcomes are already decided
        pass
    finally:
        loop.close()
