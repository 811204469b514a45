"""External agents cannot hang a run: each episode runs in an event loop of its own on a thread of its own, so a
blocking call (``time.sleep`` in a tool) stops neither the caller's loop nor the other episodes; the time limit
fires for blocking and awaiting hangs alike; a timed-out episode is not run again, and the failures name the
agent and what it raised."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai  # noqa: F401 - imported once here, not inside the first timed episode (seconds on a loaded machine)
import pytest

from agent.external.isolation import AgentThreads
from agent.external.runner import ExternalRunner
from corpora.formats import QAExample
from tests.chat_templates import CHATML_TOOLS

FRANCE = QAExample("q0", "What is the capital of France?", ["Paris"])
SLOW = QAExample("q1", "Where was the designer of the Eiffel Tower born? (slow)", ["Dijon"])


def blocked_until(release: threading.Event, limit_s: float = 60.0) -> None:
    """Block the calling thread with ``time.sleep`` (as a synchronous tool does) until ``release`` is set (or
    ``limit_s``: a broken isolation fails the test instead of hanging it)."""
    t0 = time.monotonic()
    while not release.is_set() and time.monotonic() - t0 < limit_s:
        time.sleep(0.02)


def agent_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name)]


def run_isolated(make, timeout_s, name="iso"):
    """One run on a fresh :class:`AgentThreads` (closed after it)."""
    threads = AgentThreads(name)

    async def go():
        try:
            return await threads.run(make, timeout_s)
        finally:
            threads.close()

    return go()


def test_a_blocking_agent_times_out_while_the_callers_loop_runs_on():
    release = threading.Event()

    async def blocking():
        blocked_until(release)
        return "late"

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        out = await run_isolated(blocking, 0.5, name="iso-blocking")
        t.cancel()
        return out, ticks

    try:
        out, ticks = asyncio.run(main())
        assert out.timed_out and out.blocked and out.result is None and out.error is None
        assert ticks >= 10  # the caller's loop ran on while the agent's thread was blocked (in one loop: 0)
        assert agent_threads("iso-blocking") and all(t.daemon for t in agent_threads("iso-blocking"))
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while agent_threads("iso-blocking") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not agent_threads("iso-blocking")  # released, the retired worker ends


def test_an_awaiting_hang_is_cancelled_and_its_worker_serves_the_next_episode():
    stopped = threading.Event()

    async def hang():
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    async def ok():
        return threading.current_thread().name

    async def main():
        threads = AgentThreads("iso-hang")
        try:
            out = await threads.run(hang, 0.3)
            again = await threads.run(ok, 5)
            return out, again
        finally:
            threads.close()

    out, again = asyncio.run(main())
    assert out.timed_out and not out.blocked and stopped.is_set()
    assert again.result == "iso-hang-0"  # the same worker: not retired
    time.sleep(0.2)
    assert not agent_threads("iso-hang")  # closed


def test_results_errors_and_a_cancelled_caller():
    async def ok():
        await asyncio.sleep(0)
        return 42

    async def bad():
        raise KeyError("boom")

    assert asyncio.run(run_isolated(ok, 5)).result == 42
    out = asyncio.run(run_isolated(bad, 5))
    assert isinstance(out.error, KeyError) and not out.timed_out
    out = asyncio.run(run_isolated(ok, 0))
    assert out.timed_out and not out.blocked  # a limit of 0 times out at once, and the worker is not lost

    stopped = threading.Event()

    async def long():
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    async def caller():
        task = asyncio.ensure_future(run_isolated(long, 3600))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(caller())
    assert stopped.wait(5)  # the caller's cancellation reached the agent


def test_a_tool_blocked_in_the_executor_runs_on_a_daemon_thread():
    """LangChain runs a synchronous tool in its loop's default executor (as ``asyncio.to_thread`` does): that
    executor's threads are daemons, so a tool blocked for good never keeps the process from exiting."""
    release = threading.Event()

    async def agent():
        await asyncio.to_thread(blocked_until, release)

    try:
        out = asyncio.run(run_isolated(agent, 0.3))
        assert out.timed_out and not out.blocked  # the awaiting coroutine was cancelled; the tool's thread blocks
        tools = agent_threads("sleuth-agent-tool")
        assert tools and all(t.daemon for t in tools)
    finally:
        release.set()


def _chat_agent(release: threading.Event, *, raise_on: str | None = None):
    async def agent(question: str, base_url: str) -> str:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])
        if "slow" in question:
            blocked_until(release)  # time.sleep inside the agent's own coroutine: its loop is blocked
        if raise_on and raise_on in question:
            raise RuntimeError("the agent's own bug")
        return r.choices[0].message.content

    return agent


def test_a_blocking_agent_fails_its_episode_once_and_the_others_go_on(tiny_llm, agent_cfg):
    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    release = threading.Event()
    agent = _chat_agent(release)
    try:
        cfg = agent_cfg.model_copy(update={"max_new_tokens": 4})  # quick calls: the others end well within the limit
        with ExternalRunner(tiny_llm, agent, cfg, timeout_s=8, reruns=1, name="my_agent:answer") as runner:
            ok, slow, ok2 = runner.run_episodes([FRANCE, SLOW, FRANCE])
            stats = runner.stats
    finally:
        release.set()
    assert ok.stop_reason != "error" and ok2.stop_reason != "error" and len(ok) > 0
    assert slow.stop_reason == "error" and slow.metadata["timed_out"] and slow.reward == 0.0
    msg = slow.metadata["error"]
    assert msg.startswith("the agent my_agent:answer took longer than 8 s (agent.external_timeout_s)")
    assert "blocked in a call that does not return" in msg and slow.metadata["agent"] == "my_agent:answer"
    # not run again: the rerun would double the stall (it shares the episode's one deadline)
    assert slow.metadata["failed_attempts"] == 1 and stats["episodes"] == 3
    assert (stats["timeouts"], stats["blocked"], stats["agent_errors"]) == (1, 1, 0)


def test_an_agent_that_raises_is_named_with_its_exception_and_run_again(tiny_llm, agent_cfg):
    from training.rollout.faults import drop_failed

    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    agent = _chat_agent(threading.Event(), raise_on="capital")
    with ExternalRunner(tiny_llm, agent, agent_cfg, timeout_s=30, reruns=1, name="my_agent:answer") as runner:
        (bug,) = runner.run_episodes([FRANCE])
        stats = runner.stats
    assert bug.metadata["error"] == "the agent my_agent:answer raised RuntimeError: the agent's own bug"
    assert bug.metadata["failed_attempts"] == 2 and stats["episodes"] == 2 and stats["agent_errors"] == 2
    with pytest.raises(RuntimeError, match="the agent my_agent:answer failed, not Sleuth's services") as e:
        drop_failed([bug])
    assert "retrieval server" not in str(e.value)


def test_a_cancelled_episode_leaves_no_record_behind(tiny_llm, agent_cfg):
    """An episode cancelled from outside (``sleuth serve``'s time limit, a client gone) stops its agent and
    leaves nothing in the proxy: no record, no sampling setting; its later calls would get 409."""
    stopped = threading.Event()

    async def hang(question: str, base_url: str) -> str:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    with ExternalRunner(tiny_llm, hang, agent_cfg, timeout_s=60) as runner:
        async def go():
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(runner.run_episode(FRANCE, sampling=(0.5, 1.0)), 0.3)

        asyncio.run(go())
        assert stopped.wait(5) and runner.proxy.sampling == {} and not runner.proxy.episodes
        assert len(runner.proxy.ended) == 1


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True])
def test_a_timeout_that_is_not_a_positive_number_is_refused(tiny_llm, agent_cfg, bad):
    async def agent(question: str, base_url: str) -> str:
        return "x"

    with pytest.raises(ValueError, match="agent.external_timeout_s must be a finite number of seconds > 0"):
        ExternalRunner(tiny_llm, agent, agent_cfg, timeout_s=bad)


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf", "true"])
def test_the_config_refuses_a_timeout_of_zero_or_less(bad):
    from sleuth.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="agent.external_timeout_s"):
        load_config(None, [f"agent.external_timeout_s={bad}"])
    assert load_config(None, ["agent.external_timeout_s=1.5"]).agent.external_timeout_s == 1.5
    assert load_config(None, []).agent.external_timeout_s == 120.0


BLOCKING_AGENT = '''
import itertools
import os
import time

from openai import AsyncOpenAI

_n = itertools.count()


async def answer(question, base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
    if next(_n) % 2:  # every other episode blocks its thread with time.sleep, as a synchronous tool would
        t0 = time.monotonic()
        while not os.path.exists(os.environ["SLEUTH_TEST_RELEASE"]) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
    return r.choices[0].message.content
'''


def test_training_an_agent_that_blocks_goes_on_past_the_timeout(tiny_data, bm25_index, tmp_path, monkeypatch):
    """``sleuth train`` with an external agent (named by its file path) that blocks with ``time.sleep`` in half
    of its episodes: each step's blocked episodes time out after ``agent.external_timeout_s`` (5 s: a loaded machine may need seconds for a call), are
    not run again and are left out of the update, and the run completes its steps."""
    from sleuth.cli import main

    agent = tmp_path / "blocking_agent.py"
    agent.write_text(BLOCKING_AGENT)
    release = tmp_path / "release"
    monkeypatch.setenv("SLEUTH_TEST_RELEASE", str(release))
    out = tmp_path / "run"
    try:
        assert main(["train", f"out_dir={out}", f"data.corpus={tiny_data / 'corpus.jsonl'}",
                     f"data.train={tiny_data / 'train.jsonl'}", f"data.test={tiny_data / 'test.jsonl'}",
                     f"retrieval.index_dir={bm25_index}", "sft.enabled=false", "agent.kind=external",
                     f"agent.entry={agent}:answer", "agent.external_timeout_s=5", "agent.max_new_tokens=4",
                     "policy.tiny.vocab_size=400", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1",
                     "policy.tiny.num_heads=2", "policy.tiny.num_kv_heads=1", "policy.tiny.intermediate_size=64",
                     "train.steps=2", "train.questions_per_step=2", "train.group_size=2", "train.save_every=2"]) == 0
    finally:
        release.write_text("")  # the blocked threads end
    records = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # two of four episodes per step blocked: one failed run each (no rerun), left out of the update
    assert [(r["rollout_errors"], r["rollout_dropped"]) for r in records] == [(2.0, 2.0), (2.0, 2.0)]
    assert all(r["proxy_calls"] == 4 for r in records)
