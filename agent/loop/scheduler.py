"""Coalesces the generation and search requests of many in-flight episodes into batches.

Each LangGraph episode awaits ``scheduler.generate(...)`` / ``scheduler.search(...)`` as if it were alone;
the scheduler holds requests until every live episode that is not already inside a running batch is
waiting, then runs one batched backend call per queue in that queue's worker thread (one per queue and
scheduler: the backend always sees the same thread, and what its calls allocate and free stays in one
allocator arena; on asyncio's shared pool the calls hopped between threads and a server's resident memory
grew round after round of requests, by glibc arenas per thread). The result is the same batch
shape a hand-written lock-step loop would use, so the graph costs nothing measurable on top of it, and the
same scheduler serves concurrent HTTP requests (each request is an episode).

A batched call that raises is retried once, member by member, so that one bad request (a prompt over the
model's context, a request a remote server rejects) fails only its own episode; see :func:`is_global`
for the errors that fail the whole batch at once. Those single calls run one after another (the
transformers and vLLM backends must not be called from several threads at once), or, for a backend or
retriever whose class sets ``concurrent_calls = True`` (the remote retrieval client, the OpenAI-compatible
backend), up to :data:`SPLIT_CONCURRENCY` at a time. A backend that knows each request's outcome (the
OpenAI-compatible backend) raises :class:`agent.llm.BatchPartlyFailed` instead, and each request gets its
own outcome with no second call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from contextlib import asynccontextmanager
from typing import Any

from agent.llm import (
    LLM,
    BackendUnavailable,
    BatchPartlyFailed,
    Generation,
    SamplingParams,
    generate_requests,
)
from retrieval.base import Hit, Retriever

SPLIT_CONCURRENCY = 32
"""Most single calls of a failed batch's split pass in flight at once, for a backend that sets
``concurrent_calls = True`` (each runs in a worker thread of the pass's own pool)."""


def is_global(e: BaseException) -> bool:
    """Whether a backend or retriever exception says the service as a whole failed, so that retrying a
    batch's requests one by one would only repeat it: :class:`agent.llm.BackendUnavailable` (an
    OpenAI-compatible server still failing after its retries or answering 401/403/404, a closed vLLM
    engine), ``ConnectionError`` (refused, reset; the retrieval client's ``RetrievalServerError``) and
    ``TimeoutError``. Anything else
    (``ValueError``, the OpenAI backend's ``BackendError`` for a 4xx or a malformed reply, a CUDA error of
    one oversized prompt, ...) may be one request's fault."""
    return isinstance(e, (BackendUnavailable, ConnectionError, TimeoutError))


class Scheduler:
    """Batching front end to one LLM backend and one retriever.

    ``max_batch`` bounds the prompts (or queries) per backend call. When a batched call raises, each of
    its requests is run again alone (one pass: in order, or up to :data:`SPLIT_CONCURRENCY` at once when
    the backend's ``concurrent_calls`` attribute is true; absent means false), so only the requests whose
    own call raises get an exception; an error that :func:`is_global` calls global is not split: it fails
    every request of the batch (and, met in the one-by-one pass, the requests not yet retried). Either way
    the scheduler keeps serving. A batch whose task is cancelled (the event loop shutting down) fails its
    requests still waiting with a ``RuntimeError``, so none of them waits for ever.
    """

    def __init__(self, llm: LLM, retriever: Retriever | None = None, max_batch: int = 256):
        self.llm = llm
        self.retriever = retriever
        self.max_batch = max_batch
        self.active = 0
        self._inflight = 0
        self._queues: dict[str, list[tuple[Any, asyncio.Future]]] = {"generate": [], "search": []}
        self._busy: dict[str, bool] = {"generate": False, "search": False}
        self.stats = {"generate_batches": 0, "generate_prompts": 0, "search_batches": 0, "search_queries": 0}
        self._stats_lock = threading.Lock()  # a split pass may run several backend calls in threads at once
        self._tasks: set[asyncio.Task] = set()  # the running batches (the loop keeps only weak references)
        self._workers: dict[str, concurrent.futures.ThreadPoolExecutor] = {}

    # -- episode accounting ---------------------------------------------------------------------------
    @asynccontextmanager
    async def episode(self):
        """Register a live episode for the duration of the block."""
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            self._poke()
            self._release_idle_workers()

    # -- requests -------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await self._submit("generate", (prompt_ids, params))

    async def search(self, query: str, k: int) -> list[Hit]:
        if self.retriever is None:
            raise RuntimeError("this scheduler has no retriever")
        return await self._submit("search", (query, k))

    async def _submit(self, kind: str, payload: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        item = (payload, fut)
        self._queues[kind].append(item)
        self._poke()
        try:
            return await fut
        except asyncio.CancelledError:  # the episode was cancelled: its request leaves the queue unrun
            q = self._queues[kind]
            for i, queued in enumerate(q):
                if queued is item:
                    del q[i]
                    break
            raise

    # -- batching -------------------------------------------------------------------------------------
    def _poke(self) -> None:
        """Start the batches that are ready.

        Searches run once every live episode outside a running batch is waiting (on either queue).
        Generation runs once *every* live episode is waiting to generate (or ``max_batch`` prompts are
        queued): episodes still searching are waited for, so the generations of one turn form one batch,
        as in a hand-written lock-step loop (the batch shapes are identical; see ``tests/test_agent_scheduler.py``).
        """
        gen_q, search_q = self._queues["generate"], self._queues["search"]
        if not gen_q and not search_q:
            return
        loop = asyncio.get_running_loop()
        everyone_waiting = len(gen_q) + len(search_q) >= self.active - self._inflight
        if search_q and not self._busy["search"] and (everyone_waiting or len(search_q) >= self.max_batch):
            self._busy["search"] = True
            self._start(loop, "search")
        if gen_q and not self._busy["generate"] and (len(gen_q) >= self.active or len(gen_q) >= self.max_batch):
            self._busy["generate"] = True
            self._start(loop, "generate")

    def _start(self, loop: asyncio.AbstractEventLoop, kind: str) -> None:
        task = loop.create_task(self._flush(kind))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self, kind: str) -> None:
        q = self._queues[kind]
        items, self._queues[kind] = q[: self.max_batch], q[self.max_batch :]
        self._inflight += len(items)
        try:
            results = await self._in_worker(kind, [p for p, _ in items])
            for (_, fut), res in zip(items, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
        except BatchPartlyFailed as e:
            if len(e.results) != len(items):
                await self._one_by_one(kind, items, e)
            else:  # every request's own outcome is known: nothing to run again
                for (_, fut), res in zip(items, e.results, strict=True):
                    if not fut.done():
                        (fut.set_exception if isinstance(res, BaseException) else fut.set_result)(res)
        except Exception as e:  # noqa: BLE001 - forwarded to the waiting episodes
            await self._one_by_one(kind, items, e)
        finally:
            # every path above settles every request; one left means the task was cancelled (the loop shutting
            # down), in the batch's call or in its split pass: no request of the batch may wait for ever
            error = RuntimeError(f"the scheduler's {kind} batch was cancelled")
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(error)
            self._inflight -= len(items)
            self._busy[kind] = False
            self._poke()
            self._release_idle_workers()

    async def _one_by_one(self, kind: str, items: list[tuple[Any, asyncio.Future]], error: Exception) -> None:
        """Settle the futures of a batch whose call raised ``error``: each request still awaited is run alone
        and gets its own result or exception; a global ``error`` (:func:`is_global`), or one met on the way,
        goes to every request not yet settled without another call (calls already running finish and keep
        their own outcome). A batch of one is not run again. The single calls run in order, or up to
        :data:`SPLIT_CONCURRENCY` at once (and at most the backend's ``max_concurrency``, if it has one) when
        the backend (``llm`` or ``retriever``, by ``kind``) has a true ``concurrent_calls`` attribute."""
        waiting = [it for it in items if not it[1].done()]
        if len(items) == 1 or is_global(error):
            waiting, failed = [], waiting
        else:
            failed = waiting
        met: list[BaseException] = []  # the first global error of the pass
        backend = self.llm if kind == "generate" else self.retriever
        width = 1
        if getattr(backend, "concurrent_calls", False):  # within the backend's own bound (OpenAI: max_concurrency)
            bound = getattr(backend, "max_concurrency", None) or len(waiting)
            width = max(1, min(SPLIT_CONCURRENCY, len(waiting), bound))
        pool = concurrent.futures.ThreadPoolExecutor(width, "sleuth-split") if width > 1 else None
        gate = asyncio.Semaphore(width)

        async def alone(payload: Any, fut: asyncio.Future) -> None:
            async with gate:
                if fut.done() or met:  # its episode was cancelled meanwhile; the service is down
                    return
                try:
                    if pool is None:
                        (res,) = await self._in_worker(kind, [payload])
                    else:
                        (res,) = await asyncio.get_running_loop().run_in_executor(pool, self._run, kind, [payload])
                except Exception as e:  # noqa: BLE001 - this request's own failure
                    if not fut.done():
                        fut.set_exception(e)
                    if is_global(e) and not met:
                        met.append(e)
                else:
                    if not fut.done():
                        fut.set_result(res)

        try:
            if pool is None:
                for payload, fut in waiting:
                    await alone(payload, fut)
            else:
                await asyncio.gather(*(alone(payload, fut) for payload, fut in waiting))
        finally:
            if pool is not None:
                pool.shutdown(wait=False)
        error = met[0] if met else error
        for _, fut in failed:
            if not fut.done():
                fut.set_exception(error)

    def _in_worker(self, kind: str, payloads: list[Any]) -> asyncio.Future:
        """:meth:`_run` on ``kind``'s worker thread (made on first use; ended when the scheduler goes idle,
        :meth:`_release_idle_workers`, or is collected). One batch of a kind runs at a time, so one thread
        loses no concurrency."""
        pool = self._workers.get(kind)
        if pool is None:
            pool = self._workers[kind] = concurrent.futures.ThreadPoolExecutor(1, f"sleuth-{kind}")
            weakref.finalize(self, pool.shutdown, wait=False)
        return asyncio.get_running_loop().run_in_executor(pool, self._run, kind, payloads)

    def _release_idle_workers(self) -> None:
        """End the worker threads once no episode is live, no request waits and no batch runs (the next batch
        makes them again; a thread that ends hands its allocator arena to the next one): an idle scheduler
        holds no thread, however long it is kept."""
        if self.active or any(self._busy.values()) or any(self._queues.values()) or not self._workers:
            return
        workers, self._workers = self._workers, {}
        for pool in workers.values():
            pool.shutdown(wait=False)

    def _run(self, kind: str, payloads: list[Any]) -> list[Any]:
        """The batch's backend call (in the worker thread). A ``StopIteration`` it raises becomes a
        ``RuntimeError``: an asyncio future cannot hold one, so the batch's result would never arrive and the
        scheduler would stay busy (every later request of that kind waiting forever). So does a
        ``BaseException`` that is no ``Exception`` but ``KeyboardInterrupt`` or ``SystemExit`` (which stop the
        event loop): an ``asyncio.CancelledError`` of the backend's own loop would read as the cancellation of
        the batch's task, a ``GeneratorExit`` would end it, and either way its requests would wait forever."""
        try:
            return (self._run_generate if kind == "generate" else self._run_search)(payloads)
        except StopIteration as e:
            raise RuntimeError(f"the {kind} backend raised StopIteration{f': {e}' if str(e) else ''}") from e
        except (Exception, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise RuntimeError(f"the {kind} backend raised {type(e).__name__}{f': {e}' if str(e) else ''}") from e

    def _run_generate(self, payloads: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        """The batch's generations, each request within its own budget (:func:`agent.llm.generate_requests`:
        one call per distinct sampling setting, or one ``generate_each`` call)."""
        out = generate_requests(self.llm, payloads)
        with self._stats_lock:
            self.stats["generate_batches"] += 1
            self.stats["generate_prompts"] += len(payloads)
        return out

    def _run_search(self, payloads: list[tuple[str, int]]) -> list[list[Hit]]:
        out: list[list[Hit] | None] = [None] * len(payloads)
        by_k: dict[int, list[int]] = {}
        for i, (_, k) in enumerate(payloads):
            by_k.setdefault(k, []).append(i)
        for k, idx in by_k.items():
            hits = self.retriever.search([payloads[i][0] for i in idx], k)  # type: ignore[union-attr]
            for i, h in zip(idx, hits, strict=True):
                out[i] = h
        with self._stats_lock:
            self.stats["search_batches"] += 1
            self.stats["search_queries"] += len(payloads)
        return out  # type: ignore[return-value]
