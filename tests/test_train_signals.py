"""Ctrl-C (SIGINT) and SIGTERM during ``sleuth train`` name the last checkpoint and the command that resumes it,
and leave the run resumable: a real ``sleuth train`` process, stopped by each signal once it has checkpointed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("sig", "name", "status"), [
    pytest.param(signal.SIGINT, "Ctrl-C (SIGINT)", 130, marks=pytest.mark.slow),  # the same path as SIGTERM's
    (signal.SIGTERM, "SIGTERM", 143)])
def test_a_signal_names_the_last_checkpoint_and_the_resume_command(tiny_data, bm25_index, tiny_policy_dir, tmp_path,
                                                                   sig, name, status):
    from training.infra.checkpoint import latest_checkpoint, run_dir_lock

    out = tmp_path / "run"
    overrides = [f"out_dir={out}", f"data.corpus={tiny_data / 'corpus.jsonl'}", f"data.train={tiny_data / 'train.jsonl'}",
                 f"data.test={tiny_data / 'test.jsonl'}", f"retrieval.index_dir={bm25_index}", "sft.enabled=false",
                 f"policy.model={tiny_policy_dir}", "agent.max_new_tokens=8",
                 "agent.max_turns=1", "train.steps=100000", "train.save_every=1", "train.questions_per_step=2",
                 "train.group_size=2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sleuth.cli", "train", *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while latest_checkpoint(out / "grpo") is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert latest_checkpoint(out / "grpo") is not None, "no checkpoint within 180 s"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, err[-2000:]
    last = latest_checkpoint(out / "grpo")  # the checkpoint a stop mid-write leaves the latest
    line = next(x for x in err.splitlines() if x.startswith("sleuth train: stopped by"))
    assert line.startswith(f"sleuth train: stopped by {name}; the last checkpoint is {last} (step ")
    assert line.endswith(" --resume") and "resume from it with: sleuth train out_dir=" in line
    assert "interrupted" not in err and "Traceback" not in err
    with run_dir_lock(out):  # released: the resume command can run
        pass
    assert (last / "trainer_state.json").exists() and (last / "sleuth_settings.json").exists()
