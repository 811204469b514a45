"""Checkpoints that lose nothing: model, optimizer, scheduler, RNG states and data position.

A checkpoint is a directory ``<run>/checkpoints/step_<n>/`` written under a temporary name and renamed
into place (atomic on POSIX), then ``<run>/checkpoints/latest`` is rewritten atomically to point at it.
Files and directories are fsynced before each rename, so the commit survives a power loss too. A run
killed at any moment resumes from the last complete checkpoint.

Contents of ``step_<n>/``:

* the model and tokenizer (``save_pretrained``: any checkpoint is a Hugging Face model directory);
* ``optimizer.pt``: the trainer's *full* optimizer state keyed by parameter name (as
  :func:`training.infra.distributed.full_optimizer_state` returns it), one format for one process and for
  ``W`` FSDP2 ranks, so a run saved on ``W`` ranks resumes on ``W`` ranks exactly, and on another number
  of ranks with the same weights and optimizer state (but another data split and RNG streams);
* ``trainer.pt``: scheduler state, the RNG states of every rank (``rng_per_rank``; ``rng`` is rank 0's),
  extra state dicts (critic, LoRA adapters) and, for generic callers, a plain ``optimizer.state_dict()``;
* ``trainer_state.json``: step, data position, world size and trainer bookkeeping;
* ``sleuth_settings.json`` (:data:`SETTINGS_FILE`): the agent settings the policy was trained with, when the
  run has them (:func:`write_settings`; ``sleuth ask/eval/serve --model <ckpt>`` use them).

Under torchrun only rank 0 writes (after the collectives that gather the state); the trainer puts a
barrier after every save, so no rank reads a checkpoint before it is complete.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch


class RunDirBusyError(BlockingIOError, RuntimeError):
    """Another training holds the run directory (:func:`run_dir_lock`). A ``RuntimeError`` as before, and a
    ``BlockingIOError`` (an ``OSError``: the resource is busy), which the CLI reports in one line."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error); the message names the path
    and the checkpoint that is still the latest. An ``OSError``, which the CLI reports in one line."""


class CorruptCheckpointError(ValueError):
    """A checkpoint's files are damaged (cut short, not what their headers say); the message names the file
    and the previous checkpoint to resume from instead."""


@contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold ``run_dir`` (created if missing) for one training: an exclusive ``flock`` on
    ``run_dir/.train.lock``, released when the block ends or the process dies (a killed run leaves no stale
    lock). Raises :class:`RunDirBusyError` (a ``RuntimeError``) naming the holder's pid when another open
    lock holds it (another process, or another block in this one). Local file systems only: ``flock`` is not
    shared across the nodes of a network file system."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".train.lock"
    f = open(path, "a+")  # noqa: SIM115 (held open for the block; closing it releases the lock)
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise RunDirBusyError(f"another training is running in {run_dir} (pid {holder} holds {path}); wait for "
                               "it to end, or write this run to another directory") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield run_dir
    finally:
        f.close()


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk. Directories that cannot be opened (not
    POSIX) are skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and every directory of it, so that a rename committing ``root``
    never points at empty or partial files after a power loss."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def commit_directory(tmp: str | Path, final: str | Path) -> Path:
    """Move the finished directory ``tmp`` to ``final`` (replacing it) durably: every file under ``tmp`` is
    flushed before the rename and the parent's entry after it, so that after a power loss ``final`` is either
    the old directory, missing, or complete (never empty or partial files). For model directories written
    outside a checkpoint: the KL reference, the SFT warm start. Returns ``final``."""
    tmp, final = Path(tmp), Path(final)
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    return final


SETTINGS_FILE = "sleuth_settings.json"
"""The file, beside a model's weights (a checkpoint, the SFT model, a run directory), holding the settings the
model was trained with: a JSON object of config sections (``{"agent": {...}, "retrieval": {...}}``) that
``sleuth ask/eval/serve --model DIR`` apply, so the model runs as it was trained."""


def write_settings(directory: str | Path, settings: dict[str, Any]) -> Path:
    """Write ``settings`` (a JSON-able dict of config sections) to ``directory/``:data:`SETTINGS_FILE`,
    flushed to disk before it replaces an older one. Returns the file."""
    path = Path(directory) / SETTINGS_FILE
    tmp = path.with_name(path.name + ".tmp")
    _write_durably(tmp, json.dumps(settings, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def read_settings(directory: str | Path) -> dict[str, Any] | None:
    """The settings of :data:`SETTINGS_FILE` in ``directory``, or ``None`` when it has none (a model trained
    before the file existed, a hub model). Raises ``ValueError`` naming the file when it does not parse or
    is no JSON object."""
    path = Path(directory) / SETTINGS_FILE
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        settings = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} does not parse ({e}); delete it to use the config's settings") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} must hold a JSON object of config sections; delete it to use the config's "  # noqa: TRY004
                         "settings")
    return settings


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(run_dir: str | Path, step: int, model: Any, tokenizer: Any, optimizer: Any | None = None,
                    scheduler: Any | None = None, trainer_state: dict[str, Any] | None = None, keep: int = 2,
                    extra: dict[str, Any] | None = None, *, optimizer_state: dict[str, Any] | None = None,
                    rng_states: list[dict[str, Any]] | None = None,
                    write_files: Callable[[Path], None] | None = None) -> Path:
    """Atomically save everything needed to resume after ``step`` optimizer steps; keep the newest ``keep``.

    ``optimizer_state`` is a full, name-keyed optimizer state
    (:func:`training.infra.distributed.full_optimizer_state`), written to ``optimizer.pt`` and read back with
    :func:`load_optimizer_state`; ``optimizer`` (a plain optimizer whose ``state_dict()`` goes into
    ``trainer.pt``, restored by :func:`load_trainer_state`) is for callers without a module. ``rng_states``
    are every rank's RNG states (:func:`rng_state` gathered over ranks; default: this process's). ``extra``
    holds further state dicts (e.g. the PPO critic and its optimizer), restored by :func:`load_trainer_state`
    into ``state["extra"]``. ``write_files(dir)`` adds further files (e.g. LoRA's frozen base weights) to the
    directory before it is committed, so they are part of the atomic checkpoint. A checkpoint named ``best``
    (see :func:`save_best`) is never rotated away, nor is the one just written (rotation is by step number;
    checkpoints of steps after ``step``, left by a run that resumed from an earlier one, are deleted). Call it
    on one rank only.

    Returns the checkpoint directory. The model is saved with ``save_pretrained`` so any checkpoint is also
    a loadable Hugging Face model directory (``sleuth eval --model <ckpt>``). A write that fails (a full disk,
    a quota) raises :class:`CheckpointWriteError` naming the path, after removing its partial files; the
    previous checkpoint stays the latest and loadable.
    """
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}_{os.getpid()}"
    latest_tmp = ckpt_root / ".latest.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        if write_files is not None:
            write_files(tmp)
        rngs = rng_states or [rng_state()]
        torch.save({"optimizer": optimizer.state_dict() if optimizer else None,
                    "scheduler": scheduler.state_dict() if scheduler else None,
                    "rng": rngs[0], "rng_per_rank": rngs, "extra": extra or {}}, tmp / "trainer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(trainer_state or {})}, indent=1))
        commit_directory(tmp, final)  # durable contents before the rename that commits them
        _write_durably(latest_tmp, final.name)
        os.replace(latest_tmp, ckpt_root / "latest")
        _fsync(ckpt_root)
    except Exception as e:  # torch.save reports a full disk as RuntimeError("... iostream error"), safetensors
        raise _write_failed(ckpt_root, step, tmp, latest_tmp, e) from e  # as SafetensorError: no path either way
    # a checkpoint after this step is of a timeline the run left when it resumed from an earlier one (killed
    # between committing it and moving ``latest``): gone, so it can neither push this one out nor be resumed
    stale = [p for p in ckpt_root.glob("step_*") if _step_number(p) > step]
    kept = sorted((p for p in ckpt_root.glob("step_*") if _step_number(p) <= step), key=_step_number)
    for old in stale + kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_failed(ckpt_root: Path, step: int, tmp: Path, latest_tmp: Path, e: BaseException) -> CheckpointWriteError:
    """The :class:`CheckpointWriteError` of a checkpoint write that raised ``e``, after removing its partial
    files (a full disk gets its space back; the run's earlier checkpoints are untouched)."""
    shutil.rmtree(tmp, ignore_errors=True)
    latest_tmp.unlink(missing_ok=True)
    try:
        free = f"{shutil.disk_usage(ckpt_root).free} bytes free there now"
    except OSError:
        free = "free space unknown"
    prev = latest_checkpoint(ckpt_root.parent)
    keep = f"{prev} is still the latest checkpoint" if prev is not None else "no earlier checkpoint exists"
    err = CheckpointWriteError(f"could not write checkpoint step {step} to {tmp} ({type(e).__name__}: {e}; {free}); "
                               f"the partial files are removed and {keep}")
    err.errno = getattr(e, "errno", None)  # ENOSPC, EDQUOT, EIO... when the write said so
    return err


def check_checkpoint(ckpt: str | Path) -> None:
    """Raise :class:`CorruptCheckpointError` when a file of checkpoint ``ckpt`` is damaged: a
    ``.safetensors`` file whose size is not the one its header gives (cut short by a crash or a full disk,
    or with a header that does not parse), a ``.pt`` file that is no complete zip archive (``torch.save``'s
    format: its directory sits at the end), a shard a ``*.index.json`` lists but that is missing, or a
    ``trainer_state.json`` that does not parse. Reads headers and sizes only, not the tensors. The message
    names the file and the previous intact checkpoint of the run (or says there is none) and how to resume
    from it."""
    ckpt = Path(ckpt)
    why = _damage(ckpt)
    if why is None:
        return
    prev = [p for p in sorted(ckpt.parent.glob("step_*"), key=_step_number, reverse=True)
            if _step_number(p) < _step_number(ckpt) and (p / "trainer_state.json").exists() and _damage(p) is None]
    if prev:
        hint = (f"the previous checkpoint {prev[0]} is intact: move the damaged one aside (mv {ckpt} "
                f"{ckpt.parent / ('damaged_' + ckpt.name)}) and resume again to continue from {prev[0].name}")
    else:
        hint = "no intact earlier checkpoint is left: start a new run in another out_dir"
    raise CorruptCheckpointError(f"checkpoint {ckpt} is damaged: {why}; {hint}")


def _damage(ckpt: Path) -> str | None:
    """What is wrong with checkpoint directory ``ckpt`` (see :func:`check_checkpoint`), or ``None``."""
    import struct
    import zipfile

    try:
        json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        return f"trainer_state.json does not parse ({e})"
    for f in sorted(ckpt.rglob("*.safetensors")):
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size:
                    raise ValueError(f"a header of {n} bytes")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
            return f"{f.relative_to(ckpt)} has no valid safetensors header ({e})"
        if size != 8 + n + end:
            return f"{f.relative_to(ckpt)} is {size} bytes, its header says {8 + n + end} (cut short?)"
    for f in sorted(ckpt.rglob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(f.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{f.relative_to(ckpt)} does not parse ({e})"
        missing = sorted(s for s in shards if not (f.parent / s).exists())
        if missing:
            return f"{f.relative_to(ckpt)} lists missing shards {missing[:3]}"
    for f in sorted(ckpt.rglob("*.pt")):
        try:
            zipfile.ZipFile(f).close()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{f.relative_to(ckpt)} is no complete torch.save archive ({e})"
    return None


def _step_number(path: Path) -> int:
    """The step of a ``step_<n>`` checkpoint directory (``-1`` for another name), for ordering by number:
    names sort wrongly from step 1,000,000 on."""
    n = path.name.removeprefix("step_")
    return int(n) if n.isdigit() else -1


def remove_unfinished(run_dir: str | Path) -> list[Path]:
    """Delete what killed writes left in ``<run>/checkpoints``: checkpoint and ``best`` copies under their
    temporary names (``.tmp_step_<n>_<pid>``, ``.tmp_best_<pid>``: a full model and optimizer state each),
    the previous ``best`` set aside by :func:`save_best` (``.old_best``) and the pointer's ``.latest.tmp``.
    Complete checkpoints, ``latest`` and ``best`` are kept. Only for the one process that writes the run
    (the holder of :func:`run_dir_lock`): another writer's files in progress would go too. Returns the
    removed paths."""
    root = Path(run_dir) / "checkpoints"
    gone = sorted(p for pattern in (".tmp_step_*", ".tmp_best_*", ".old_best", ".latest.tmp")
                  for p in root.glob(pattern))
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The last complete checkpoint of a run, or ``None``."""
    ckpt_root = Path(run_dir) / "checkpoints"
    pointer = ckpt_root / "latest"
    if pointer.exists():
        path = ckpt_root / pointer.read_text().strip()
        if (path / "trainer_state.json").exists():
            return path
    done = sorted((p for p in ckpt_root.glob("step_*") if (p / "trainer_state.json").exists()), key=_step_number)
    return done[-1] if done else None


def load_trainer_state(ckpt: str | Path, optimizer: Any | None = None, scheduler: Any | None = None, *,
                       rank: int = 0, world_size: int = 1, rng: bool = True) -> dict[str, Any]:
    """Restore scheduler and RNG states (and a plain ``optimizer``'s, when ``trainer.pt`` has one) from
    ``ckpt``; return its ``trainer_state.json`` plus ``extra``, ``rng_states`` (one dict per saving rank) and
    ``rng_exact``.

    With ``rng=False`` the RNG states are returned but not restored, for a caller that must restore them
    later with :func:`restore_rng` (the trainer does so after building the rollout backend, whose start may
    seed the global RNGs, as vLLM's engine does). ``rng_exact`` tells whether :func:`restore_rng` gives
    rank ``rank`` its own saved streams. The name-keyed optimizer state of ``optimizer.pt`` is read by
    :func:`load_optimizer_state`."""
    ckpt = Path(ckpt)
    blob = torch.load(ckpt / "trainer.pt", weights_only=False)
    if optimizer is not None and blob.get("optimizer"):
        optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob.get("scheduler"):
        scheduler.load_state_dict(blob["scheduler"])
    rngs = blob.get("rng_per_rank") or [blob["rng"]]
    exact = restore_rng(rngs, rank, world_size) if rng else len(rngs) == world_size
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["extra"] = blob.get("extra") or {}
    state["rng_states"] = rngs
    state["rng_exact"] = exact
    return state


def restore_rng(rngs: list[dict[str, Any]], rank: int = 0, world_size: int = 1) -> bool:
    """Set this process's Python, NumPy, torch (and CUDA) RNGs from ``rngs``, the states saved by each rank
    (:func:`rng_state`). Rank ``rank`` of ``world_size`` gets its own saved states when as many ranks saved
    them (returns ``True``); otherwise rank 0 gets rank 0's states and every other rank a seed derived from
    them and its rank (deterministic, but not the stream an uninterrupted run would have used; returns
    ``False``)."""
    if len(rngs) == world_size:
        _set_rng_state(rngs[rank])
        return True
    _set_rng_state(rngs[0])
    if rank > 0:
        g = torch.Generator()
        g.set_state(rngs[0]["torch"])
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g)) + 1000003 * rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
    return False


def load_optimizer_state(ckpt: str | Path) -> dict[str, Any] | None:
    """The full, name-keyed optimizer state saved in ``ckpt/optimizer.pt`` (load it with
    :func:`training.infra.distributed.load_full_optimizer_state`), or ``None`` when the checkpoint has
    none."""
    path = Path(ckpt) / "optimizer.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


def read_extra(ckpt: str | Path) -> dict[str, Any]:
    """The ``extra`` state dicts of ``ckpt`` (critic, LoRA adapters), without touching any RNG."""
    return torch.load(Path(ckpt) / "trainer.pt", weights_only=False).get("extra") or {}


def save_best(run_dir: str | Path, ckpt: str | Path, metric: float) -> Path:
    """Copy checkpoint ``ckpt`` to ``<run>/checkpoints/best`` atomically (kept when training stops on an
    alarm); ``best/best.json`` records the checkpoint's name and the metric. A kill between its two renames
    leaves no ``best`` (the trainer redoes it on resume, see :func:`best_source`)."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".tmp_best_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp)
    (tmp / "best.json").write_text(json.dumps({"from": Path(ckpt).name, "metric": metric}))
    _fsync_tree(tmp)
    old = root / ".old_best"
    shutil.rmtree(old, ignore_errors=True)
    if (root / "best").exists():
        os.replace(root / "best", old)
    os.replace(tmp, root / "best")
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    return root / "best"


def best_source(run_dir: str | Path) -> str | None:
    """The name of the checkpoint ``<run>/checkpoints/best`` was copied from (``best.json``'s ``from``), or
    ``None`` when there is no complete ``best``."""
    try:
        return json.loads((Path(run_dir) / "checkpoints" / "best" / "best.json").read_text())["from"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_pretrained_weights(model: Any, path: str | Path) -> None:
    """Load the safetensors weights of a ``save_pretrained`` directory into ``model`` in place: one
    ``model.safetensors`` or the shards named by ``model.safetensors.index.json``. Raises
    ``FileNotFoundError`` when the directory has neither, ``ValueError`` when a saved tensor is unknown to
    ``model`` or a parameter of ``model`` is not saved (a tied LM head excepted)."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = [path / f for f in sorted(set(index["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors nor model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{path}: missing weights {missing[:5]}, unexpected weights {list(unexpected)[:5]}")
