"""The batching scheduler: N episodes in flight -> the backend sees batches of N, like a lock-step loop."""

from __future__ import annotations

import asyncio
import threading

from agent.llm import Generation, SamplingParams
from agent.loop.batch import run_episodes
from agent.loop.scheduler import Scheduler
from corpora.formats import QAExample
from tests.test_agent_fakes import ScriptLLM


class CountingRetriever:
    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def search(self, queries, k):
        self.batches.append(len(queries))
        return self.inner.search(queries, k)


def _examples(n: int, stem: str) -> list[QAExample]:
    return [QAExample(f"{stem}{i}", f"{stem} question {i}?", ["Paris"]) for i in range(n)]


def test_n_episodes_in_flight_give_batches_of_n(tiny_llm, retriever, agent_cfg):
    llm = ScriptLLM(tiny_llm.tokenizer, {"alpha": ["<search> Paris </search>", "<search> France </search>", "<answer> Paris </answer>"],
                                         "beta": ["<search> Paris </search>", "<answer> Paris </answer>"]})
    r = CountingRetriever(retriever)
    trajs = run_episodes(_examples(5, "alpha") + _examples(3, "beta"), llm, r, agent_cfg)
    assert llm.batches == [8, 8, 5]  # turn 1: all 8; turn 2: all 8; turn 3: the 5 still searching
    assert r.batches == [8, 5]
    assert all(t.answer == "Paris" for t in trajs)


def test_invalid_and_searching_episodes_still_share_one_batch_per_turn(tiny_llm, retriever, agent_cfg):
    # an invalid action skips the search; its next generation must wait for the searchers (lock-step)
    llm = ScriptLLM(tiny_llm.tokenizer, {"alpha": ["<search> Paris", "<answer> Paris </answer>"],
                                         "beta": ["<search> Paris </search>", "<answer> Paris </answer>"]})
    run_episodes(_examples(4, "alpha") + _examples(4, "beta"), llm, retriever, agent_cfg)
    assert llm.batches == [8, 8]


def test_max_batch_bounds_every_backend_call(tiny_llm, retriever, agent_cfg):
    llm = ScriptLLM(tiny_llm.tokenizer, {"alpha": ["<search> Paris </search>", "<answer> Paris </answer>"]})
    cfg = agent_cfg.model_copy(update={"max_batch": 3})
    trajs = run_episodes(_examples(8, "alpha"), llm, retriever, cfg)
    assert max(llm.batches) <= 3 and sum(llm.batches) == 16
    assert all(t.answer == "Paris" for t in trajs)


class FailsOn:
    """A backend and retriever whose batch call raises ``error`` when it holds a prompt containing token
    ``bad`` (a prompt over the model's context, a request the server rejects) or the query ``"bad"``;
    ``calls`` records each call's size."""

    tokenizer = None

    def __init__(self, error: Exception, bad: int = 666):
        self.error, self.bad, self.calls = error, bad, []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        if any(self.bad in p for p in prompts):
            raise self.error
        return [Generation([p[0]], "x") for p in prompts]

    def search(self, queries, k):
        self.calls.append(len(queries))
        if "bad" in queries:
            raise self.error
        return [[] for _ in queries]


def test_a_failing_batch_is_retried_one_by_one_so_only_the_failing_requests_fail():
    # one prompt over the context (one request a remote server rejects) failed every episode of its batch
    async def main(llm):
        sched = Scheduler(llm, retriever=llm)
        gens = await asyncio.gather(*(sched.generate(p, SamplingParams()) for p in ([1], [666], [3])),
                                    return_exceptions=True)
        hits = await asyncio.gather(*(sched.search(q, 2) for q in ("ok", "bad", "fine")), return_exceptions=True)
        later = await sched.generate([4], SamplingParams())
        return gens, hits, later

    llm = FailsOn(ValueError("prompt of 9000 tokens exceeds the context"))
    gens, hits, later = asyncio.run(main(llm))
    assert gens[0].token_ids == [1] and gens[2].token_ids == [3]
    assert isinstance(gens[1], ValueError) and "exceeds the context" in str(gens[1])
    assert hits[0] == [] and hits[2] == [] and isinstance(hits[1], ValueError)
    assert later.token_ids == [4]  # the scheduler keeps serving
    assert llm.calls == [3, 1, 1, 1, 3, 1, 1, 1, 1]  # one split pass per failed batch, then no more


def test_a_global_backend_error_fails_the_batch_without_one_by_one_retries():
    # a backend that is down fails every request the same way: 256 single calls would only delay the error
    from agent.backends.openai import BackendUnreachable
    from agent.llm import BackendUnavailable

    async def main(llm):
        sched = Scheduler(llm)
        return await asyncio.gather(*(sched.generate(p, SamplingParams()) for p in ([666], [2], [3])),
                                    return_exceptions=True)

    for error in (BackendUnreachable("http://x/v1/completions failed after 4 attempts (ConnectError)"),
                  BackendUnavailable("this VLLMBackend is closed"), ConnectionRefusedError("refused"),
                  TimeoutError("timed out")):
        llm = FailsOn(error)
        out = asyncio.run(main(llm))
        assert all(type(e) is type(error) and str(e) == str(error) for e in out), (error, out)
        assert llm.calls == [3], error


def test_a_global_error_during_the_split_pass_fails_the_rest_at_once():
    class DiesAfterOne(FailsOn):
        def generate(self, prompts, params):
            if len(self.calls) == 2:
                self.calls.append(len(prompts))
                raise ConnectionRefusedError("the server went down")
            return super().generate(prompts, params)

    async def main(llm):
        sched = Scheduler(llm)
        return await asyncio.gather(*(sched.generate(p, SamplingParams()) for p in ([1], [666], [3], [4])),
                                    return_exceptions=True)

    llm = DiesAfterOne(ValueError("too long"))
    out = asyncio.run(main(llm))
    assert out[0].token_ids == [1]
    assert all(isinstance(e, ConnectionRefusedError) for e in out[1:])
    assert llm.calls == [4, 1, 1]


def test_per_request_budgets_are_cut_back_exactly():
    class Fixed:
        tokenizer = type("T", (), {"decode": staticmethod(lambda ids, **kw: "".join(map(str, ids)))})()

        def __init__(self):
            self.seen = []

        def generate(self, prompts, params):
            self.seen.append(params.max_new_tokens)
            return [Generation(list(range(params.max_new_tokens)), "", "length", meta={"weight_version": 3})
                    for _ in prompts]

    async def main(llm):
        sched = Scheduler(llm)
        return await asyncio.gather(sched.generate([0], SamplingParams(max_new_tokens=5)),
                                    sched.generate([0], SamplingParams(max_new_tokens=2)))

    llm = Fixed()
    a, b = asyncio.run(main(llm))
    assert llm.seen == [5]  # one call at the batch maximum
    assert a.token_ids == [0, 1, 2, 3, 4] and b.token_ids == [0, 1] and b.finish_reason == "length"
    assert b.meta == {"weight_version": 3}  # a cut generation keeps the backend's meta (vLLM's weight version)


def test_a_cancelled_request_leaves_the_queue_and_is_never_run():
    """An episode cancelled while its request waits for the batch (a server timeout, a client that went
    away) takes the request with it: the backend never runs it, and it does not count as a waiting episode."""

    class Seen:
        tokenizer = None

        def __init__(self):
            self.prompts = []

        def generate(self, prompts, params):
            self.prompts.extend(prompts)
            return [Generation([9], "x") for _ in prompts]

    async def main(llm):
        sched = Scheduler(llm)

        async def episode(prompt, wait=None):
            async with sched.episode():
                if wait is not None:
                    await wait.wait()
                return await sched.generate(prompt, SamplingParams())

        go = asyncio.Event()
        b = asyncio.create_task(episode([2], go))
        c = asyncio.create_task(episode([3], go))
        await asyncio.sleep(0)  # b and c are live episodes, not yet asking
        a = asyncio.create_task(episode([1]))
        await asyncio.sleep(0.01)  # a waits in the queue for b and c
        a.cancel()
        await asyncio.sleep(0.01)
        assert sched._queues["generate"] == [] and llm.prompts == []
        go.set()
        return await asyncio.gather(b, c)

    llm = Seen()
    outs = asyncio.run(main(llm))
    assert llm.prompts == [[2], [3]] and [o.token_ids for o in outs] == [[9], [9]]


class ConcurrentFailsOn(FailsOn):
    """A :class:`FailsOn` that may be called from several threads at once (``concurrent_calls``), as the
    OpenAI-compatible backend and the retrieval client: each single call waits at ``barrier`` (``parties``
    single calls must be inside at once, else it breaks after 10 s) and ``overlap`` records the most calls
    running together."""

    concurrent_calls = True

    def __init__(self, error: Exception, parties: int):
        super().__init__(error)
        self.barrier, self.lock, self.running, self.overlap = threading.Barrier(parties, timeout=10), threading.Lock(), 0, 0

    def _alone(self, n: int) -> None:
        if n == 1:
            with self.lock:
                self.running += 1
                self.overlap = max(self.overlap, self.running)
            try:
                self.barrier.wait()
            finally:
                with self.lock:
                    self.running -= 1

    def generate(self, prompts, params):
        self._alone(len(prompts))
        return super().generate(prompts, params)

    def search(self, queries, k):
        self._alone(len(queries))
        return super().search(queries, k)


def test_the_split_pass_of_a_concurrent_backend_runs_its_single_calls_together():
    """The split pass ran the single calls one after another for every backend: one 400 in a batch of 256 cost
    256 sequential round trips over HTTP. A backend with ``concurrent_calls`` (here: single calls that
    proceed only when all four are inside at once) gets them concurrently; the results are the same."""
    async def main(llm):
        sched = Scheduler(llm, retriever=llm)
        gens = await asyncio.gather(*(sched.generate(p, SamplingParams()) for p in ([1], [666], [3], [4])),
                                    return_exceptions=True)
        hits = await asyncio.gather(*(sched.search(q, 2) for q in ("ok", "bad", "fine", "good")),
                                    return_exceptions=True)
        return gens, hits

    llm = ConcurrentFailsOn(ValueError("rejected: HTTP 400"), parties=4)
    gens, hits = asyncio.run(main(llm))
    assert [g.token_ids for i, g in enumerate(gens) if i != 1] == [[1], [3], [4]], gens
    assert isinstance(gens[1], ValueError) and "HTTP 400" in str(gens[1])
    assert hits[0] == hits[2] == hits[3] == [] and isinstance(hits[1], ValueError), hits
    assert llm.overlap == 4 and llm.calls == [4, 1, 1, 1, 1, 4, 1, 1, 1, 1]


def test_a_global_error_in_a_concurrent_split_pass_settles_the_calls_not_started(monkeypatch):
    """At most SPLIT_CONCURRENCY single calls run at once; once one meets a global error (the server went
    down), the calls not yet started are not made: their requests get that error at once."""
    import agent.loop.scheduler

    monkeypatch.setattr(agent.loop.scheduler, "SPLIT_CONCURRENCY", 2)
    gate = threading.Event()

    class DownOn666(FailsOn):
        concurrent_calls = True

        def generate(self, prompts, params):
            self.calls.append(len(prompts))
            if len(prompts) > 1:
                raise ValueError("one request was rejected")
            if prompts[0] == [666]:
                raise ConnectionRefusedError("the server went down")
            assert gate.wait(10)  # still running when the global error is met
            return [Generation([p[0]], "x") for p in prompts]

    async def main(llm):
        sched = Scheduler(llm)
        tasks = [asyncio.ensure_future(sched.generate(p, SamplingParams())) for p in ([666], [2], [3], [4], [5])]
        await asyncio.wait([tasks[0]])  # its single call failed: the global error is known
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    llm = DownOn666(ValueError("unused"))
    out = asyncio.run(main(llm))
    assert isinstance(out[0], ConnectionRefusedError) and out[1].token_ids == [2]
    assert all(isinstance(e, ConnectionRefusedError) for e in out[2:]), out
    assert llm.calls == [5, 1, 1]


def test_a_concurrent_split_pass_keeps_within_the_backends_max_concurrency():
    """The OpenAI backend's max_concurrency bounds its requests in flight (a rate-limited hosted API); the
    split pass's single calls, each a call of its own, keep within it too: pairs meet at a barrier of two,
    never more than two at once."""
    class Two(ConcurrentFailsOn):
        max_concurrency = 2

    async def main(llm):
        sched = Scheduler(llm)
        return await asyncio.gather(*(sched.generate(p, SamplingParams()) for p in ([1], [666], [3], [4])),
                                    return_exceptions=True)

    llm = Two(ValueError("rejected"), parties=2)
    out = asyncio.run(main(llm))
    assert [o.token_ids for i, o in enumerate(out) if i != 1] == [[1], [3], [4]] and isinstance(out[1], ValueError)
    assert llm.overlap == 2 and llm.calls == [4, 1, 1, 1, 1]


def test_generate_requests_keeps_each_budget_in_one_call_per_setting_or_one_generate_each():
    """agent.llm.generate_requests (the scheduler's and IRCoT's backend call): a plain backend gets one call
    per setting but max_new_tokens, with the largest budget, each output cut back to its own; a backend with
    generate_each gets one call with every request's own settings."""
    from agent.llm import generate_requests

    class Plain:
        tokenizer = None

        def __init__(self):
            self.calls = []

        def generate(self, prompts, params):
            self.calls.append((len(prompts), params.max_new_tokens, params.temperature))
            return [Generation(list(range(params.max_new_tokens)), "x" * params.max_new_tokens, "length")
                    for _ in prompts]

    class Each(Plain):
        def generate_each(self, requests):
            self.calls.append([p.max_new_tokens for _, p in requests])
            return [Generation(list(range(p.max_new_tokens)), "", "length") for _, p in requests]

    class Tok:
        def decode(self, ids, **_):
            return "y" * len(ids)

    reqs = [([1], SamplingParams(max_new_tokens=n, temperature=t)) for n, t in ((9, 1.0), (24, 1.0), (5, 0.0))]
    plain = Plain()
    plain.tokenizer = Tok()
    out = generate_requests(plain, reqs)
    assert sorted(plain.calls) == [(1, 5, 0.0), (2, 24, 1.0)]
    assert [len(g.token_ids) for g in out] == [9, 24, 5] and out[0].text == "y" * 9 and out[1].text == "x" * 24
    each = Each()
    out = generate_requests(each, reqs)
    assert each.calls == [[9, 24, 5]] and [len(g.token_ids) for g in out] == [9, 24, 5]


def test_a_backend_raising_a_base_exception_fails_its_requests_instead_of_leaving_them_waiting():
    """A backend call that raises a BaseException that is no Exception (an ``asyncio.CancelledError`` of a
    backend's own event loop, ``GeneratorExit``) left every request of its batch waiting forever (the batch's
    task ended as if cancelled, or with an exception no one read); now it is a ``RuntimeError`` naming it,
    split like any other error, and the scheduler keeps serving."""

    async def main(llm):
        sched = Scheduler(llm)
        batch = asyncio.gather(*(sched.generate(p, SamplingParams()) for p in ([1], [666], [3])),
                               return_exceptions=True)
        out = await asyncio.wait_for(batch, 10)
        return out, await asyncio.wait_for(sched.generate([4], SamplingParams()), 10)

    for error in (asyncio.CancelledError(), GeneratorExit()):
        for concurrent in (False, True):  # the batch's call and [666]'s single call raise it
            llm = FailsOn(error)
            llm.concurrent_calls = concurrent
            out, later = asyncio.run(main(llm))
            assert isinstance(out[1], RuntimeError) and type(error).__name__ in str(out[1]), (error, out)
            assert out[0].token_ids == [1] and out[2].token_ids == [3] and later.token_ids == [4]
            assert llm.calls == [3, 1, 1, 1, 1]


def test_a_batch_that_partly_failed_answers_each_request_with_its_own_outcome_without_a_second_pass():
    """A backend that sends each request on its own (an OpenAI-compatible server) knows which requests
    failed: it raises agent.llm.BatchPartlyFailed with every request's outcome, and the scheduler answers
    each request with its own, with no second call (the one-by-one pass re-sent the whole batch)."""
    from agent.llm import BatchPartlyFailed

    class PerRequest:
        tokenizer = None

        def __init__(self):
            self.calls = []

        def generate(self, prompts, params):
            self.calls.append([p[0] for p in prompts])
            out = [Generation([p[0]], str(p[0]), "length") if p[0] != 2 else ValueError("prompt 2 is too long")
                   for p in prompts]
            if any(isinstance(o, Exception) for o in out):
                raise BatchPartlyFailed(out)
            return out

    backend = PerRequest()

    async def run():
        sched = Scheduler(backend)
        return await asyncio.gather(*(sched.generate([i], SamplingParams(max_new_tokens=1)) for i in (1, 2, 3)),
                                    return_exceptions=True)

    outs = asyncio.run(run())
    assert backend.calls == [[1, 2, 3]]  # one call: nothing re-sent
    assert [o.text for o in (outs[0], outs[2])] == ["1", "3"]
    assert isinstance(outs[1], ValueError) and "too long" in str(outs[1])


def test_a_cancelled_batch_fails_its_waiting_requests_instead_of_leaving_them_waiting():
    """A batch whose own task was cancelled (the event loop shutting down under a server) left the requests
    it had taken from the queue waiting for ever: no one would set their futures. They now fail with a
    ``RuntimeError`` that names the cancelled batch. The scheduler holds each running batch's task (the
    event loop keeps only weak references to tasks)."""
    release = threading.Event()

    class Blocks:
        tokenizer = None

        def generate(self, prompts, params):
            release.wait(10)
            return [Generation([9], "x") for _ in prompts]

    async def main():
        sched = Scheduler(Blocks())
        asks = [asyncio.ensure_future(sched.generate(p, SamplingParams())) for p in ([1], [2])]
        for _ in range(100):  # until the batch has taken both requests
            await asyncio.sleep(0.01)
            if sched._tasks and not sched._queues["generate"]:
                break
        (task,) = sched._tasks
        task.cancel()
        out = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 5)
        release.set()
        await asyncio.sleep(0.05)
        return out, sched._tasks

    out, running = asyncio.run(main())
    assert all(isinstance(o, RuntimeError) and "generate batch was cancelled" in str(o) for o in out), out
    assert running == set()  # a finished batch's task is let go


def test_a_batch_cancelled_during_its_split_pass_fails_the_requests_left():
    """The cancelled-batch handling sat in an ``except`` beside the one that runs the split pass, so a
    cancellation while the failed batch's requests were being retried one by one skipped it: the requests
    not yet retried waited for ever. Every request the batch still holds is now failed however it ends."""
    release, started = threading.Event(), threading.Event()

    class FailsThenBlocks:
        tokenizer = None

        def generate(self, prompts, params):
            if len(prompts) > 1:
                raise ValueError("one prompt is bad")  # not global: the batch is split
            started.set()
            release.wait(10)
            return [Generation([9], "x")]

    async def main():
        sched = Scheduler(FailsThenBlocks())
        asks = [asyncio.ensure_future(sched.generate(p, SamplingParams())) for p in ([1], [2], [3])]
        for _ in range(500):  # until the split pass runs its first single call
            await asyncio.sleep(0.01)
            if started.is_set():
                break
        (task,) = sched._tasks
        task.cancel()
        out = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 5)
        release.set()
        return out

    out = asyncio.run(main())
    assert all(isinstance(o, RuntimeError) and "generate batch was cancelled" in str(o) for o in out), out
