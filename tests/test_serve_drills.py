"""``sleuth serve`` (its own process, the CPU tiny policy) under 50 concurrent streaming clients that hang up
at random points: after each round no episode is left running, the event loop's tasks are back to where they
were, and the server's resident memory stays within 10% over three rounds."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from tests.test_fault_drills import _free_port, _wait_healthy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
CLIENTS, ROUNDS = 50, 3


def _rss(pid: int) -> int:
    """Resident set size of process ``pid``, in kB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def _round(url: str, rnd: random.Random) -> dict[str, int]:
    """50 streamed chat requests at once; each client reads a random number of events (some all of them)
    and hangs up. Returns how many read to the end and how many hung up."""

    async def client(i: int, stop_after: int) -> bool:
        body = {"messages": [{"role": "user", "content": f"Where was the designer of the Eiffel Tower born? ({i})"}],
                "stream": True}
        async with httpx2.AsyncClient(base_url=url, timeout=120) as c, c.stream("POST", "/v1/chat/completions",
                                                                                json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return True
                n += line.startswith("data: ")
                if n >= stop_after:
                    return False  # leaving the block closes the connection mid-stream
        return True

    plan = [rnd.choice([0, 1, 2, 3, 5, 1000]) for _ in range(CLIENTS)]
    done = await asyncio.gather(*(client(i, k) for i, k in enumerate(plan)))
    return {"finished": sum(done), "hung_up": CLIENTS - sum(done)}


def _settled(url: str, tasks: int | None = None, timeout: float = 120.0) -> dict:
    """``/health`` once no episode runs, no slot is taken and (given ``tasks``) the event loop holds at most
    ``tasks`` tasks."""
    deadline = time.time() + timeout
    while True:
        h = httpx2.get(url + "/health", timeout=10).json()
        if h["running_episodes"] == 0 and h["inflight"] == 0 and (tasks is None or h["tasks"] <= tasks):
            return h
        if time.time() > deadline:
            raise AssertionError(f"episodes, slots or tasks left after the clients left (tasks before: {tasks}): {h}")
        time.sleep(0.2)


def test_50_streaming_clients_hanging_up_leak_no_episode_task_or_memory(tiny_policy_dir, bm25_index, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sleuth.cli", "serve", "--model", str(tiny_policy_dir), "--index", str(bm25_index),
           "--port", str(port), "agent.max_turns=3", "agent.max_new_tokens=24", "agent.max_total_tokens=512",
           "agent.max_obs_tokens=160", f"out_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rnd = random.Random(0)
    try:
        _wait_healthy(url, proc)
        asyncio.run(_round(url, rnd))  # warm-up: first-use allocations (batch shapes, caches) happen here
        base = _settled(url)
        rss = [_rss(proc.pid)]
        outcomes = []
        for _ in range(ROUNDS):
            outcomes.append(asyncio.run(_round(url, rnd)))
            _settled(url, base["tasks"])  # no episode, slot or task left behind by a hung-up stream
            rss.append(_rss(proc.pid))
        assert proc.poll() is None
    finally:
        proc.terminate()
        err = proc.communicate(timeout=60)[1].decode()
    assert all(o["hung_up"] > 0 and o["finished"] > 0 for o in outcomes), outcomes
    assert max(rss) <= 1.10 * min(rss), f"RSS (kB) after the warm-up and each round: {rss}"
    assert "Traceback" not in err, err[-3000:]
