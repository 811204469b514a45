"""Checkpoints: atomic directories, the ``latest`` pointer, rotation that keeps ``best``, and RNG / optimizer /
scheduler / extra state round trips."""

from __future__ import annotations

import json
import random

import torch

from training.infra.checkpoint import latest_checkpoint, load_trainer_state, save_best, save_checkpoint


class Saveable:
    def __init__(self, tag: str, file: str = "model.txt"):
        self.tag, self.file = tag, file

    def save_pretrained(self, path):
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / self.file).write_text(self.tag)


def test_round_trip_rotation_and_best(tmp_path):
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched.step()
    torch.manual_seed(3)
    random.seed(3)
    p1 = save_checkpoint(tmp_path, 1, Saveable("a"), Saveable("tok", "tok.txt"), opt, sched, {"data_position": 7},
                         extra={"critic": {"w": torch.ones(2)}})
    save_best(tmp_path, p1, 0.5)
    expect_torch, expect_py = torch.rand(3), random.random()
    for s in (2, 3):
        save_checkpoint(tmp_path, s, Saveable(str(s)), Saveable("tok", "tok.txt"), opt, sched, {"data_position": s}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best", "latest", "step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path).name == "step_000003"
    assert json.loads((tmp_path / "checkpoints" / "best" / "best.json").read_text())["metric"] == 0.5
    assert (tmp_path / "checkpoints" / "best" / "model.txt").read_text() == "a"

    opt2 = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5 ** s)
    torch.manual_seed(99)
    state = load_trainer_state(tmp_path / "checkpoints" / "best", opt2, sched2)
    assert state["step"] == 1 and state["data_position"] == 7
    assert torch.equal(state["extra"]["critic"]["w"], torch.ones(2))
    assert sched2.last_epoch == 1 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py  # RNG restored


def test_latest_ignores_incomplete_directories(tmp_path):
    save_checkpoint(tmp_path, 1, Saveable("a"), Saveable("t", "tok.txt"))
    root = tmp_path / "checkpoints"
    (root / "step_000005").mkdir()  # crashed before trainer_state.json
    (root / ".tmp_step_000006_1").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_000001"
    (root / "latest").unlink()  # pointer lost: the newest complete directory wins
    assert latest_checkpoint(tmp_path).name == "step_000001"
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_full_optimizer_state_and_per_rank_rng(tmp_path):
    """The name-keyed optimizer state (optimizer.pt) restores AdamW exactly into a fresh optimizer; each rank
    gets its own RNG states back, and another world size falls back to rank 0's (+ a per-rank seed)."""
    from training.infra.checkpoint import load_optimizer_state, rng_state
    from training.infra.distributed import full_optimizer_state, load_full_optimizer_state

    lin = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    for _ in range(2):
        lin(torch.randn(4, 2)).pow(2).sum().backward()
        opt.step()
    torch.manual_seed(1)
    r0 = rng_state()
    torch.manual_seed(2)
    r1 = rng_state()
    save_checkpoint(tmp_path, 2, Saveable("a"), Saveable("t", "tok.txt"), optimizer_state=full_optimizer_state(lin, opt),
                    rng_states=[r0, r1])
    ckpt = latest_checkpoint(tmp_path)
    saved = load_optimizer_state(ckpt)
    assert set(saved["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}

    lin2 = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt2 = torch.optim.AdamW(lin2.parameters(), lr=0.1)
    load_full_optimizer_state(lin2, opt2, saved)
    for p, q in zip(lin.parameters(), lin2.parameters(), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])

    torch.manual_seed(2)
    expect_rank1 = torch.rand(3)
    state = load_trainer_state(ckpt, rank=1, world_size=2)
    assert state["rng_exact"] and torch.equal(torch.rand(3), expect_rank1)
    # another world size: deterministic per-rank streams derived from rank 0's
    draws = []
    for rank in (1, 1, 2):
        state = load_trainer_state(ckpt, rank=rank, world_size=3)
        draws.append(torch.rand(3))
    assert not state["rng_exact"]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert not torch.equal(draws[0], expect_rank1)
    assert load_optimizer_state(tmp_path / "nothing") is None


def test_files_and_directories_are_fsynced_before_the_commit_renames(tmp_path, monkeypatch):
    """After a power loss a renamed checkpoint (and the ``latest`` pointer) must not hold empty files: every
    file of the checkpoint and its directory are fsynced before the rename that commits it, and the
    checkpoints directory after it (so the rename itself is durable)."""
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = save_checkpoint(tmp_path, 1, Saveable("a"), Saveable("t", "tok.txt"))
    root = tmp_path / "checkpoints"
    commit = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final))
    synced = {e[1] for e in events[:commit] if e[0] == "fsync"}
    tmp = events[commit][1]
    assert {f"{tmp}/model.txt", f"{tmp}/tok.txt", f"{tmp}/trainer.pt", f"{tmp}/trainer_state.json", tmp} <= synced
    pointer = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(root / "latest"))
    assert ("fsync", str(root / ".latest.tmp")) in events[commit:pointer]
    assert ("fsync", str(root)) in events[commit:pointer] and events[-1] == ("fsync", str(root))

    events.clear()
    best = save_best(tmp_path, final, 0.5)
    commit = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(best))
    tmp = events[commit][1]
    synced = {e[1] for e in events[:commit] if e[0] == "fsync"}
    assert {f"{tmp}/model.txt", f"{tmp}/best.json", tmp} <= synced
    assert ("fsync", str(root)) in events[commit:]


def test_rotation_keeps_the_checkpoint_just_written_and_drops_an_abandoned_later_one(tmp_path):
    """A run killed between committing a checkpoint (here step 5) and moving ``latest`` resumes from an
    earlier one. Rotation sorted the names and kept the newest ``keep``, so with ``keep=1`` the leftover later
    step made the next save delete the checkpoint it had just written (``latest`` then named a deleted
    folder). Now checkpoints after the step being saved are deleted as abandoned, the one just written is
    kept, and the order is numeric (``step_1000000`` after ``step_999999``)."""
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 2, Saveable("2"), Saveable("t", "tok.txt"), keep=1)
    (root / "step_000005").mkdir()  # committed by the earlier timeline; `latest` never moved to it
    (root / "step_000005" / "trainer_state.json").write_text(json.dumps({"step": 5}))
    p3 = save_checkpoint(tmp_path, 3, Saveable("3"), Saveable("t", "tok.txt"), keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003"]
    assert latest_checkpoint(tmp_path) == p3 and (p3 / "model.txt").read_text() == "3"

    save_checkpoint(tmp_path, 999_999, Saveable("a"), Saveable("t", "tok.txt"), keep=2)
    big = save_checkpoint(tmp_path, 1_000_000, Saveable("b"), Saveable("t", "tok.txt"), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1000000", "step_999999"]
    (root / "latest").unlink()  # the fallback without the pointer: the highest step, by number
    assert latest_checkpoint(tmp_path) == big


def test_commit_directory_replaces_the_old_directory_whole(tmp_path):
    """The KL reference and the SFT model are written under a temporary name and moved into place by
    ``commit_directory`` (flushed first): an existing directory is replaced whole, the temporary name is gone.
    The SFT stage used ``rename``, which fails on a non-empty leftover directory of the same name."""
    from training.infra.checkpoint import commit_directory

    final, tmp = tmp_path / "sft", tmp_path / "sft.tmp"
    final.mkdir()
    (final / "stale.bin").write_text("old")
    Saveable("new").save_pretrained(tmp)
    assert commit_directory(tmp, final) == final
    assert sorted(p.name for p in final.iterdir()) == ["model.txt"] and not tmp.exists()
