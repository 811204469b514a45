"""Sleuth leaves GPU memory to the policy: importing and using its retrieval never starts a JAX backend
(bm25s runs a JAX top-k at import time when JAX is installed, and JAX then preallocates 75% of every GPU),
and the start-of-run check reports memory that something else holds.

On CPU a fake ``jax`` package records what bm25s would do with it; with a real JAX and a GPU the same check
runs against the real thing (``gpu`` marker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for JAX: importing it, or asking it for a backend (jax.lax.top_k, jax.devices), appends a line
# to $FAKE_JAX_LOG with the platform JAX would have started (JAX_PLATFORMS, unset: the GPU when present).
FAKE_JAX = {
    "jax/__init__.py": """
        import json, os
        def _log(event):
            with open(os.environ["FAKE_JAX_LOG"], "a") as f:
                f.write(json.dumps({"event": event, "platforms": os.environ.get("JAX_PLATFORMS")}) + "\\n")
        _log("import")
        def devices():
            _log("backend")
            return []
        from jax import lax  # as the real jax does
    """,
    "jax/lax.py": """
        import numpy as np
        import jax
        def top_k(x, k):
            jax._log("backend")
            x = np.asarray(x)
            idx = np.argsort(-x, kind="stable")[:k]
            return x[idx], idx
    """,
}

USE_RETRIEVAL = """
import json, sys, tempfile
from retrieval.bm25 import BM25Index
d = tempfile.mkdtemp()
texts = ["paris is the capital of france", "berlin is the capital of germany", "the rhine flows north"]
for backend in ("maxscore", "numpy"):
    idx = BM25Index.build(texts, len(texts), d + "/" + backend, show_progress=False)
    idx = BM25Index.load(d + "/" + backend, backend=backend)
    rows, _ = idx.search_rows(["capital of germany"], 2)
    assert rows[0, 0] == 1, rows
import bm25s.selection
import jax  # still importable afterwards, for anything else in the process
print(json.dumps({"bm25s_saw_jax": bm25s.selection.JAX_IS_AVAILABLE, "jax_file": jax.__file__}))
"""


def _run(code: str, env_extra: dict[str, str], pythonpath: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(env_extra, PYTHONPATH=os.pathsep.join(pythonpath))
    return subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.fixture()
def fake_jax(tmp_path):
    for name, text in FAKE_JAX.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    log = tmp_path / "jax.log"
    log.touch()
    return tmp_path, log


def test_retrieval_starts_no_jax_backend_where_jax_is_installed(fake_jax):
    path, log = fake_jax
    out = _run(USE_RETRIEVAL, {"FAKE_JAX_LOG": str(log)}, [str(path), str(ROOT)])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["jax_file"].startswith(str(path))  # the fake was the JAX on the path
    events = [json.loads(line) for line in log.read_text().splitlines()]
    started = [e for e in events if e["event"] == "backend" and e["platforms"] != "cpu"]
    assert started == [], f"a JAX backend (GPU if present) was started: {events}"
    assert res["bm25s_saw_jax"] is False  # bm25s took its numpy top-k
    assert events == [{"event": "import", "platforms": None}]  # only the script's own import, after retrieval


def test_jax_imported_before_retrieval_is_left_in_place_and_unused(fake_jax):
    path, log = fake_jax
    code = ("import sys, jax, jax.lax; mods = (sys.modules['jax'], sys.modules['jax.lax'])\n" + USE_RETRIEVAL
            + "\nassert (sys.modules['jax'], sys.modules['jax.lax']) == mods\n")
    out = _run(code, {"FAKE_JAX_LOG": str(log)}, [str(path), str(ROOT)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["bm25s_saw_jax"] is False
    assert [json.loads(line)["event"] for line in log.read_text().splitlines()] == ["import"]


CHECK_REAL_JAX = """
import json, sys, torch
torch.cuda.init()
free0, total = torch.cuda.mem_get_info()
""" + USE_RETRIEVAL + """
free1, _ = torch.cuda.mem_get_info()
from jax._src import xla_bridge
print(json.dumps({"free_before": free0, "free_after": free1, "total": total,
                  "jax_backends": getattr(xla_bridge, "backends_are_initialized",
                                          lambda: bool(getattr(xla_bridge, "_backends", {})))()}))
"""


@pytest.mark.gpu
def test_retrieval_leaves_the_gpu_to_torch_with_real_jax():
    """The same check with the real JAX on a GPU machine: no JAX backend, and the GPU's memory still free."""
    pytest.importorskip("jax")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = _run(CHECK_REAL_JAX, {}, [str(ROOT), *sys.path[1:]])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["jax_backends"] is False
    assert res["free_before"] - res["free_after"] < 0.05 * res["total"], res


GIB = 1024**3


def _fake_cuda(monkeypatch, devices: dict[int, tuple[float, float, float]]):
    """CUDA devices as ``{index: (total GiB, free GiB, reserved by this process's torch GiB)}``."""
    import training.infra.gpu_health as gh

    cuda = gh.torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cuda, "get_device_name", lambda i: f"GPU{i}")
    monkeypatch.setattr(cuda, "mem_get_info", lambda i: (int(devices[i][1] * GIB), int(devices[i][0] * GIB)))
    monkeypatch.setattr(cuda, "memory_reserved", lambda i: int(devices[i][2] * GIB))
    return gh


def test_gpu_memory_check_warns_for_the_device_something_else_holds(monkeypatch, capsys):
    # cuda:0 as bm25s's JAX left an H200 (105 of 140 GiB taken); cuda:1 mostly this run's own tensors
    gh = _fake_cuda(monkeypatch, {0: (140.0, 35.0, 0.0), 1: (80.0, 20.0, 59.0)})
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.warns(UserWarning, match=r"cuda:0: only 25% .* 105\.0 GiB of 140\.0 is held by something else") as w:
        readings = gh.check_gpu_memory()
    assert len(w) == 1  # cuda:1 is 99% free or this run's: no warning
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "GPU memory at start: cuda:0 GPU0: 140.0 GiB, 35.0 free, 0.0 held by this run's torch, 105.0 held elsewhere",
        "GPU memory at start: cuda:1 GPU1: 80.0 GiB, 20.0 free, 59.0 held by this run's torch, 1.0 held elsewhere",
    ]
    assert [r["index"] for r in readings] == [0, 1] and readings[0]["usable_fraction"] == 0.25


def test_gpu_memory_check_reads_only_its_own_device_under_torchrun(monkeypatch, capsys):
    gh = _fake_cuda(monkeypatch, {0: (80.0, 1.0, 0.0), 1: (80.0, 79.0, 0.0)})
    monkeypatch.setenv("LOCAL_RANK", "1")
    readings = gh.check_gpu_memory()  # cuda:0 is another rank's: not read, no warning
    assert [r["index"] for r in readings] == [1]
    assert "cuda:0" not in capsys.readouterr().err


def test_gpu_memory_check_is_silent_without_cuda_and_checks_its_threshold(monkeypatch, capsys, recwarn):
    import training.infra.gpu_health as gh

    monkeypatch.setattr(gh.torch.cuda, "is_available", lambda: False)
    assert gh.check_gpu_memory() == [] and capsys.readouterr().err == "" and len(recwarn) == 0
    with pytest.raises(ValueError, match="min_free"):
        gh.check_gpu_memory(min_free=90)


@pytest.mark.gpu
def test_gpu_memory_check_on_a_real_device():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from training.infra.gpu_health import check_gpu_memory

    x = torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda")  # 256 MiB of this run's own
    (r,) = check_gpu_memory([torch.cuda.current_device()], min_free=0.0)
    assert r["torch"] >= x.numel() and 0 < r["free"] < r["total"]
