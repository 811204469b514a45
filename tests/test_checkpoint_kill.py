"""A training run killed with SIGKILL in the middle of a step resumes from its last complete checkpoint and
ends with the same weights as a run that was never interrupted. Half-written checkpoints are ignored.

As a script (the child process): ``python tests/test_checkpoint_kill.py POLICY_DIR INDEX_DIR RUN_DIR`` trains
4 steps, saving every step; during step 3 its judge writes ``RUN_DIR/in_step3`` and then sleeps, so the
parent can kill it there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def child(policy_dir: str, index_dir: str, run_dir: str) -> None:
    from retrieval.index import load_retriever
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import SeededLLM, load, make_cfg, varying_judge

    run = Path(run_dir)

    def judge(traj):
        if (run / "checkpoints" / "step_000002").exists():
            (run / "in_step3").touch()
            time.sleep(600)  # killed here
        return varying_judge(traj)

    model, tok = load(policy_dir)
    run_rl(make_cfg("train.steps=4"), model, tok, load_retriever(index_dir, "bm25"), QUESTIONS, run,
             judge=judge, llm_factory=SeededLLM)


@pytest.mark.slow
def test_sigkill_mid_step_resumes_from_last_complete_checkpoint(tiny_policy_dir, bm25_index, retriever, tmp_path):
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import SeededLLM, load, make_cfg, varying_judge
    from training.infra.checkpoint import latest_checkpoint

    run = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, __file__, str(tiny_policy_dir), str(bm25_index), str(run)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while not (run / "in_step3").exists():
            assert proc.poll() is None, f"child exited early: {proc.stderr.read().decode()[-2000:]}"
            assert time.time() < deadline, "child never reached step 3"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    # debris of an interrupted save must be ignored
    (run / "checkpoints" / ".tmp_step_000003_99999").mkdir()
    (run / "checkpoints" / "step_000009").mkdir()  # no trainer_state.json: incomplete
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and ckpt.name == "step_000002"

    model, tok = load_model_and_tokenizer(str(ckpt), device="cpu")
    torch.set_num_threads(1)
    out = run_rl(make_cfg("train.steps=4"), model, tok, retriever, QUESTIONS, run, resume=True,
                   judge=varying_judge, llm_factory=SeededLLM)
    assert out["start_step"] == 2
    resumed = model.state_dict()

    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=4"), model, tok, retriever, QUESTIONS, tmp_path / "straight",
             judge=varying_judge, llm_factory=SeededLLM)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(resumed[k], v, rtol=0, atol=1e-6)
    assert latest_checkpoint(run).name == "step_000004"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    child(*sys.argv[1:4])
