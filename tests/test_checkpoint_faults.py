"""Checkpoints under faults: the disk fills while one is written (a real tmpfs when this process may mount
one, else the same failure simulated), and a checkpoint damaged on disk is refused on ``--resume`` with the
previous one offered."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from training.infra.checkpoint import (
    CheckpointWriteError,
    CorruptCheckpointError,
    check_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
)


def _save(run: Path, step: int, model, tok) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return save_checkpoint(run, step, model, tok, None, optimizer_state=opt.state_dict(),
                           trainer_state={"data_position": step})


@pytest.fixture()
def policy(tiny_policy_dir):
    from agent.backends.hf import load_model_and_tokenizer

    return load_model_and_tokenizer(str(tiny_policy_dir), device="cpu")


def _mount_tmpfs(path: Path, size: int) -> bool:
    """Mount a tmpfs of ``size`` bytes on ``path``; whether it worked (root, and mounting allowed)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       check=False)
    return r.returncode == 0


@pytest.mark.parametrize("disk", ["tmpfs", "simulated"])
def test_a_disk_that_fills_during_a_checkpoint_keeps_the_previous_one(disk, policy, tmp_path, monkeypatch):
    """``torch.save`` reported the full disk as ``RuntimeError: basic_ios::clear: iostream error`` (no path),
    and the partial checkpoint stayed on the full disk. Now the error names the checkpoint's path and the
    latest intact one, the partial files are gone, and the previous checkpoint loads."""
    from agent.backends.hf import load_model_and_tokenizer

    model, tok = policy
    one = _save(tmp_path / "measure", 1, model, tok)
    size = sum(f.stat().st_size for f in one.rglob("*") if f.is_file())
    run = tmp_path / "disk" / "run"
    if disk == "tmpfs":
        if not _mount_tmpfs(tmp_path / "disk", int(size * 1.5) + 8192):  # one checkpoint fits, two do not
            pytest.skip("mounting a tmpfs needs root and a kernel that allows it; the simulated case runs instead")
    else:
        real_save = torch.save

        def full(obj, f, *a, **k):  # writes a part, then fails as a full disk does
            if "step_000002" in str(f):
                Path(f).write_bytes(b"PK\x03\x04" + b"\0" * 100)
                raise RuntimeError("basic_ios::clear: iostream error")
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", full)
    try:
        first = _save(run, 1, model, tok)
        with pytest.raises(CheckpointWriteError) as e:
            _save(run, 2, model, tok)
        msg = str(e.value)
        assert str(run / "checkpoints" / ".tmp_step_000002_") in msg and f"{first} is still the latest" in msg
        assert isinstance(e.value, OSError)
        if disk == "tmpfs":
            assert e.value.errno == errno.ENOSPC or "No space left" in msg or "iostream error" in msg, msg
        assert not list((run / "checkpoints").glob(".tmp_*")) and not (run / "checkpoints" / ".latest.tmp").exists()
        assert latest_checkpoint(run) == first
        check_checkpoint(first)
        assert load_trainer_state(first, rng=False)["data_position"] == 1
        reloaded, _ = load_model_and_tokenizer(str(first), device="cpu")
        for k, v in model.state_dict().items():
            assert torch.equal(reloaded.state_dict()[k], v)
        del reloaded  # its weights may map the file: the tmpfs would stay busy
    finally:
        if disk == "tmpfs":
            import gc

            gc.collect()
            if subprocess.run(["umount", str(tmp_path / "disk")], check=False).returncode:
                subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)  # detached once unused


def test_check_checkpoint_finds_each_kind_of_damage(policy, tmp_path):
    model, tok = policy
    first, ckpt = _save(tmp_path, 1, model, tok), _save(tmp_path, 2, model, tok)
    check_checkpoint(ckpt)
    weights, opt = ckpt / "model.safetensors", ckpt / "optimizer.pt"
    intact_w, intact_o = weights.read_bytes(), opt.read_bytes()
    for damage, needle in [(lambda: weights.write_bytes(intact_w[: len(intact_w) // 2]), "model.safetensors is"),
                           (lambda: weights.write_bytes(b"\xff" * 64), "no valid safetensors header"),
                           (lambda: weights.write_bytes(b""), "no valid safetensors header"),
                           (lambda: opt.write_bytes(intact_o[:-100]), "optimizer.pt is no complete"),
                           (lambda: (ckpt / "trainer_state.json").write_text("{"), "trainer_state.json")]:
        damage()
        with pytest.raises(CorruptCheckpointError, match=needle) as e:
            check_checkpoint(ckpt)
        assert f"the previous checkpoint {first} is intact" in str(e.value)
        weights.write_bytes(intact_w)
        opt.write_bytes(intact_o)
        (ckpt / "trainer_state.json").write_text('{"step": 2}')
    check_checkpoint(ckpt)
    (first / "trainer.pt").write_bytes(b"")  # the previous one damaged too: nothing to offer
    weights.write_bytes(intact_w[:100])
    with pytest.raises(CorruptCheckpointError, match="no intact earlier checkpoint"):
        check_checkpoint(ckpt)


def test_resume_refuses_a_truncated_checkpoint_and_offers_the_previous(tiny_data, bm25_index, tiny_policy_dir, tmp_path,
                                                                       capsys):
    """``sleuth train --resume`` on a run whose latest checkpoint was cut short loaded it and failed deep in
    safetensors; it now stops first with a message naming the damaged file and the previous checkpoint, and
    following its advice resumes from that one."""
    from sleuth.cli import main
    from tests.conftest import run_rl
    from tests.test_trainer import load, make_cfg

    out = tmp_path / "out"
    over = [f"out_dir={out}", f"data.corpus={tiny_data / 'corpus.jsonl'}", f"data.train={tiny_data / 'train.jsonl'}",
            f"data.test={tiny_data / 'test.jsonl'}", f"retrieval.index_dir={bm25_index}",
            f"policy.model={tiny_policy_dir}", "sft.enabled=false", "train.steps=2", "train.rollout.questions_per_step=2",
            "train.rollout.group_size=2", "agent.max_turns=2", "agent.max_new_tokens=8", "agent.max_total_tokens=200",
            "agent.max_obs_tokens=60", "train.checkpoints.save_every=1", "train.optim.lr=1e-3"]
    model, tok = load(tiny_policy_dir)
    from retrieval.index import load_retriever
    from tests.conftest import QUESTIONS

    run_rl(make_cfg(), model, tok, load_retriever(bm25_index, "bm25"), QUESTIONS, out / "grpo")
    ckpt = out / "grpo" / "checkpoints" / "step_000002"
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    capsys.readouterr()
    assert main(["train", "--resume", *over]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "damaged" in err and "step_000001 is intact" in err, err
    aside = ckpt.parent / f"damaged_{ckpt.name}"
    assert f"mv {ckpt} {aside}" in err
    ckpt.rename(aside)  # as the message says
    assert main(["train", "--resume", *over]) == 0
    assert latest_checkpoint(out / "grpo").name == "step_000002"
    check_checkpoint(latest_checkpoint(out / "grpo"))
