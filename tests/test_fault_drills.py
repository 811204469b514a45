"""Fault drills on the CPU tiny policy: the trainer's retrieval server killed (SIGKILL) in the middle of a step
and restarted 10 s later, and its OpenAI-compatible rollout backend stopped and started again 10 s later.
The run must finish, never train on an episode the outage failed (every episode answers its question in
these scripts, so one trained on would show as EM below 1 or a ``stop/error`` rate), and count the failures
in the step's metrics (``rollout_errors``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

from tests.conftest import QUESTIONS
from tests.test_agent_fakes import ScriptLLM
from tests.test_faults import SCRIPTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
OUTAGE_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx2.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


class OutageLLM(ScriptLLM):
    """The scripted policy; at its first generation after ``after`` prompts (the second step's first turn),
    ``outage()`` takes the service down before the episodes' next call."""

    def __init__(self, tokenizer, after: int, outage):
        super().__init__(tokenizer, SCRIPTS)
        self.after, self.outage, self.prompts = after, outage, 0

    def generate(self, prompts, params):
        if self.prompts >= self.after and self.outage is not None:
            outage, self.outage = self.outage, None
            outage()
        self.prompts += len(prompts)
        return super().generate(prompts, params)


def _train(tiny_policy_dir, retriever, run: Path, llm_factory) -> list[dict]:
    from tests.conftest import run_rl
    from tests.test_trainer import load, make_cfg

    cfg = make_cfg("train.steps=3", "train.checkpoints.save_every=10", "agent.max_turns=3", "agent.max_new_tokens=40",
                   "agent.max_total_tokens=400", "agent.max_obs_tokens=120")
    model, tok = load(tiny_policy_dir)
    out = run_rl(cfg, model, tok, retriever, QUESTIONS, run, llm_factory=lambda m, t: llm_factory(t))
    assert out["steps"] == 3 and out["stopped"] is None
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_metrics(recs: list[dict]) -> None:
    assert len(recs) == 3
    assert recs[0]["rollout_errors"] == 0 and recs[1]["rollout_errors"] >= 4, recs  # step 2: all 4 episodes failed
    for r in recs:  # every episode trained on answered: none of the failed ones (reward 0, cut short) got in
        assert r["em"] == 1.0 and r["rollout_dropped"] == 0 and "stop/error" not in r, r


def test_retrieval_server_killed_mid_training_and_restarted_10_s_later(tiny_policy_dir, bm25_index, tmp_path):
    """``sleuth serve-retrieval`` (its own process) is killed with SIGKILL during step 2's rollout, after the
    episodes' first generation and before their search, and started again on the same port 10 s later; the
    training (:func:`training.trainer.rl_train`, what ``sleuth train`` runs, searching it through
    ``retrieval.url``) goes on."""
    from sleuth.config import load_config
    from sleuth.pipeline import open_retriever

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sleuth.cli", "serve-retrieval", "--index", str(bm25_index), "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    restarted = threading.Event()

    def outage():
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(30)

        def restart():
            time.sleep(OUTAGE_S)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            restarted.set()

        threading.Thread(target=restart, daemon=True).start()

    try:
        _wait_healthy(url, procs[0])
        retriever = open_retriever(load_config(None, [f"retrieval.url={url}"]))
        t0 = time.time()
        recs = _train(tiny_policy_dir, retriever, tmp_path / "run", lambda tok: OutageLLM(tok, 8, outage))
        assert restarted.is_set() and time.time() - t0 > OUTAGE_S
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    assert procs[0].returncode == -signal.SIGKILL
    _check_metrics(recs)


class _Uvicorn:
    """An ASGI app served on a given 127.0.0.1 port in a thread, stopped with :meth:`stop`."""

    def __init__(self, app, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _wait_healthy(f"http://127.0.0.1:{port}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class OutageBackend:
    """An OpenAI-compatible backend whose first call after ``after`` prompts runs ``outage()`` first (the
    server goes away before that call); everything else is the wrapped backend's."""

    def __init__(self, inner, after: int, outage):
        self.inner, self.after, self.outage, self.prompts = inner, after, outage, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate_each(self, requests):
        if self.prompts >= self.after and self.outage is not None:
            outage, self.outage = self.outage, None
            outage()
        self.prompts += len(requests)
        return self.inner.generate_each(requests)


def test_openai_compatible_backend_dies_mid_training_and_returns_10_s_later(tiny_llm, tiny_policy_dir, retriever,
                                                                              tmp_path):
    """The rollout backend is an OpenAI-compatible server (here a fake one playing the scripts); it stops
    listening during step 2's rollout, after the episodes' first turn and search and before their answer,
    and serves again on the same port 10 s later."""
    from fastapi.responses import JSONResponse

    from agent.backends.openai import OpenAICompatibleLLM
    from tests.test_agent_fakes import fake_openai_completions_app

    port = _free_port()
    scripted = ScriptLLM(tiny_llm.tokenizer, SCRIPTS)
    servers: list[_Uvicorn] = []

    def serve():
        app = fake_openai_completions_app(scripted, {})
        app.get("/health")(lambda: JSONResponse({"status": "ok"}))
        servers.append(_Uvicorn(app, port))

    def outage():
        servers[0].stop()

        def restart():
            time.sleep(OUTAGE_S)
            serve()

        threading.Thread(target=restart, daemon=True).start()

    serve()
    try:
        recs = _train(tiny_policy_dir, retriever, tmp_path / "run", lambda tok: OutageBackend(
            OpenAICompatibleLLM(f"http://127.0.0.1:{port}/v1", "tiny", tok), 12, outage))
    finally:
        for s in servers:
            s.stop()
    assert len(servers) == 2
    _check_metrics(recs)
