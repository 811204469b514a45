"""The GPU check: every measurement that needs an H100/H200, in one run of at most 8 minutes.

Parts, in order, each with a time budget (the expected wall time on an H100, estimated from
``bench/results/kernels_h200.json``, ``kernels.json`` and ``gpu_scale_h200.json``) and a timeout (the five sum to
8 minutes):

========  ========  =========  ====================================================================================
part      budget s  timeout s  what it runs
========  ========  =========  ====================================================================================
tests     85        110        ``pytest -m gpu`` on the kernels' GPU tests (the extension's JIT build, ~40 s, first)
kernels   60        90         ``bench/kernels.py``: the grid and the target point (10 runs there), naive, sleuth,
                               fused and Liger (where importable), and the fused path's (chunk, row block) sweep
drift     40        60         ``bench/gpu_drift.py``: bf16 rollouts of the 0.5B-shaped policy vs the trainer's scoring
faiss     10        30         ``bench/gpu_faiss.py``: the dense index's GPU path vs the CPU (flat, 100k vectors)
train     170       190        ``bench/gpu_train.py``: ``sleuth train``, 3 steps of the Search-R1 recipe at 0.5B
========  ========  =========  ====================================================================================

Each part runs in its own process (its own CUDA context, killed with its process group when it overruns; the
message names the part and its timeout) and writes its JSON; a part that fails or overruns does not stop the
others, and what it wrote before is kept. The result, one JSON with every part's status, budget, wall time and
result, goes to ``bench/results/gpu_check_<card>.json`` (the card from ``nvidia-smi``, e.g. ``h100``), and the
tables print in ``bench/RESULTS.md``'s markdown form (``--markdown PATH`` writes them to a file as well). The
exit status is a bit mask of the parts that did not finish well: tests 1, kernels 2, drift 4, faiss 8, train 16
(a part skipped for a missing package counts as not finished on a GPU: its result is missing).

``--dry-run`` runs every part on the CPU at tiny shapes through the same code (the GPU tests then skip; the
kernel methods take their torch paths; drift in bf16 and fp32; the train part through its retrieval server;
FAISS on the CPU), the parts in this process to share one import of torch: it checks the script in about a
minute, measures nothing, and writes to a temporary file unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import gpu_tables

GPU_TESTS = ("tests/test_kernels_gpu.py", "tests/test_fused_loss_gpu.py")


@dataclass(frozen=True)
class Part:
    """One part of the check: its exit-status bit, H100 budget and timeout (seconds), and the script and
    arguments it runs on a GPU and in the dry run (``None``: the tests part, which runs pytest)."""

    name: str
    bit: int
    budget_s: int
    timeout_s: int
    script: str | None
    gpu_args: tuple[str, ...] = ()
    dry_args: tuple[str, ...] = ()


PARTS = (
    Part("tests", 1, 85, 110, None),
    Part("kernels", 2, 60, 90, "kernels.py",
         ("--methods", "naive", "sleuth", "fused", "liger", "--repeat", "3", "--target-repeat", "10", "--fused-sweep"),
         ("--device", "cpu", "--tiny", "--methods", "naive", "sleuth", "fused", "liger", "--repeat", "1",
          "--fused-sweep")),
    Part("drift", 4, 40, 60, "gpu_drift.py", (),
         ("--device", "cpu", "--tiny", "--episodes", "2", "--samples", "2", "--control-episodes", "2",
          "--new-tokens", "8", "--turns", "2")),
    Part("faiss", 8, 10, 30, "gpu_faiss.py", (), ("--tiny",)),
    Part("train", 16, 170, 190, "gpu_train.py", (), ("--device", "cpu", "--tiny")),
)
#: dry-run seconds per part before it is reported as over budget (no timeout: it runs in this process)
DRY_BUDGET_S = {"tests": 30, "kernels": 20, "drift": 30, "faiss": 10, "train": 60}


def card() -> tuple[str, str, str]:
    """``(slug, name, driver)`` of the first GPU (``nvidia-smi``, else torch), e.g. ``("h100", "NVIDIA H100 80GB
    HBM3", "580.159.04")``; ``("cpu", "CPU", "-")`` without one."""
    name, driver = None, "-"
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            name, driver = (x.strip() for x in r.stdout.splitlines()[0].split(",", 1))
    if name is None:
        try:
            import torch

            name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        except Exception:  # noqa: BLE001 - no usable torch: no card
            name = None
    return ("cpu", "CPU", driver) if name is None else (card_slug(name), name, driver)


def card_slug(name: str) -> str:
    """The file-name tag of a GPU's name: its model number (``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA A100-SXM4-80GB`` -> ``a100``), else the name in lower case with ``_`` for other characters."""
    m = re.search(r"(?<![A-Za-z0-9])([A-Z]{1,2}\d{2,4})(?![0-9])", name)
    return m.group(1).lower() if m else re.sub(r"\W+", "_", name).strip("_").lower()


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return r.stdout.strip() or "-"


def run_process(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` from the repository root in its own process group, its output to ours; kill the group at
    ``timeout_s``. Returns ``(exit status or None when killed, seconds)``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    return rc, round(time.perf_counter() - t0, 1)


def junit_counts(path: Path) -> dict:
    """Test counts of a pytest ``--junitxml`` report."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "seconds": float(suite.get("time", 0))}


def run_tests(part: Part, dry: bool, work: Path, env: dict) -> dict:
    """The GPU tests under pytest; on a GPU every one must pass (none skipped), in the dry run they skip."""
    xml = work / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", *GPU_TESTS]
    rc, secs = run_process(cmd, part.timeout_s, env)
    res = {"wall_s": secs}
    if xml.exists():
        res["result"] = {"command": f"pytest -m gpu {' '.join(GPU_TESTS)}", **junit_counts(xml)}
    if rc is None:
        return res | {"status": "timeout", "message": f"tests overran their {part.timeout_s} s timeout"}
    r = res.get("result", {})
    ok = rc == 0 and r.get("failed", 1) == 0 and r.get("errors", 1) == 0 and (dry or r.get("skipped", 1) == 0)
    msg = "" if ok else f"pytest exited {rc}: {r.get('failed', '?')} failed, {r.get('errors', '?')} errors, " \
                        f"{r.get('skipped', '?')} skipped"
    return res | {"status": "ok" if ok else "failed", "message": msg}


def run_script(part: Part, dry: bool, work: Path, env: dict) -> dict:
    """A part's script: its own process on a GPU (killed at the timeout), this process in the dry run."""
    out = work / f"{part.name}.json"
    args = [*(part.dry_args if dry else part.gpu_args), "--out", str(out)]
    if dry:
        t0 = time.perf_counter()
        try:
            spec = importlib.util.spec_from_file_location(f"gpu_check_{part.name}", BENCH / part.script)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            rc = mod.main(args)
            rc = rc if isinstance(rc, int) else 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - a failing part is reported, the others run
            traceback.print_exc()
            rc = 1
        secs = round(time.perf_counter() - t0, 1)
    else:
        rc, secs = run_process([sys.executable, str(BENCH / part.script), *args], part.timeout_s, env)
    res = {"wall_s": secs}
    if out.exists():
        res["result"] = json.loads(out.read_text())
    if rc is None:
        return res | {"status": "timeout", "message": f"{part.name} overran its {part.timeout_s} s timeout (budget "
                                                      f"{part.budget_s} s); the result holds what it wrote before"}
    if rc != 0 or "result" not in res:
        return res | {"status": "failed", "message": f"{part.script} exited {rc}" + ("" if out.exists() else
                                                                                     ", no JSON written")}
    return res | {"status": "ok", "message": ""}


def judge(part: Part, res: dict, dry: bool) -> dict:
    """Mark a finished part ``skipped`` where its measurement could not happen on a GPU (FAISS without a GPU
    build, Liger absent is only noted), and note a dry-run part over its dry budget."""
    r = res.get("result") or {}
    if part.name == "faiss" and res["status"] == "ok" and not dry and not r.get("on_gpu"):
        res.update(status="skipped", message="faiss sees no GPU (install a faiss GPU build, e.g. faiss-gpu-cu12); the "
                                             "CPU fallback was compared")
    if part.name == "kernels" and res["status"] == "ok" and r.get("liger", "ok") != "ok":
        res["message"] = f"no Liger column: {r['liger']}"
    if dry and res.get("wall_s", 0) > DRY_BUDGET_S[part.name]:
        res["message"] = (res.get("message", "") + f" (over its dry-run budget of {DRY_BUDGET_S[part.name]} s)").strip()
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every part on the CPU at tiny shapes (checks the script)")
    p.add_argument("--parts", nargs="+", choices=[x.name for x in PARTS], default=[x.name for x in PARTS],
                   help="run only these parts (in the fixed order)")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/gpu_check_<card>.json; the dry "
                                               "run: a temporary file)")
    p.add_argument("--markdown", default=None, help="also write the tables to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slug, name, driver = card()
    if not args.dry_run and slug == "cpu":
        print("bench/gpu_check.py: no GPU visible (nvidia-smi, torch); use --dry-run to check the script on the CPU",
              file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp()) / "gpu_check_dryrun.json" if args.dry_run
                                           else BENCH / "results" / f"gpu_check_{slug}.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    import torch

    res = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "card": slug, "gpu": name,
           "driver": driver, "torch": torch.__version__, "commit": commit(), "dry_run": args.dry_run,
           "command": "bench/gpu_check.sh" + (" --dry-run" if args.dry_run else "")
                      + (f" --parts {' '.join(args.parts)}" if len(args.parts) < len(PARTS) else ""),
           "budget_s": sum(p.budget_s for p in PARTS if p.name in args.parts),
           "timeout_s": sum(p.timeout_s for p in PARTS if p.name in args.parts), "parts": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for part in PARTS:
            if part.name not in args.parts:
                continue
            print(f"\n=== {part.name} (budget {part.budget_s} s, timeout {part.timeout_s} s) ===", flush=True)
            run = run_tests if part.script is None else run_script
            r = judge(part, run(part, args.dry_run, Path(d), env), args.dry_run)
            res["parts"][part.name] = {"status": r["status"], "budget_s": part.budget_s, "timeout_s": part.timeout_s,
                                       **{k: v for k, v in r.items() if k != "status"}}
            print(f"=== {part.name}: {r['status']} in {r.get('wall_s')} s {r.get('message', '')}", flush=True)
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    res["exit_code"] = sum(p.bit for p in PARTS if p.name in res["parts"] and res["parts"][p.name]["status"] != "ok")
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    text = gpu_tables.report(res)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    bad = [f"{n} ({p['status']})" for n, p in res["parts"].items() if p["status"] != "ok"]
    print(f"result: {out}; {res['wall_s']} s; " + (f"not ok: {', '.join(bad)}; exit {res['exit_code']}" if bad
                                                    else "every part ok"))
    return res["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
