"""bench/gpu_check.sh, the one-command GPU check: its CPU dry run end to end (every part at tiny shapes through
the same code, JSON and tables checked), and the orchestration it relies on on a GPU (timeouts that kill a part's
process group, test counts, card names, exit bits, the report of partial results)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gc():
    return _load("gpu_check")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of the whole check (about a minute on two cores)."""
    d = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "SLEUTH_GPU_WHEELS": str(d / "none")}
    env.pop("SLEUTH_KERNELS", None)
    r = subprocess.run([str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(d / "check.json"),
                        "--markdown", str(d / "check.md")], cwd=d, env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert (d / "check.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads((d / "check.json").read_text()), (d / "check.md").read_text()


def test_dry_run_every_part_ok(dry_run, gc):
    r, res, _ = dry_run
    assert r.returncode == 0 and res["exit_code"] == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert res["dry_run"] is True and res["card"] == "cpu"
    assert list(res["parts"]) == [p.name for p in gc.PARTS]
    for name, p in res["parts"].items():
        assert p["status"] == "ok", (name, p.get("message"))
        assert p["wall_s"] > 0 and p["result"]


def test_dry_run_tests_part_counts_the_gpu_tests_as_skipped(dry_run):
    t = dry_run[1]["parts"]["tests"]["result"]
    assert t["failed"] == t["errors"] == t["passed"] == 0
    assert t["skipped"] >= 143 + 20  # the kernels' GPU tests and the fused path's


def test_dry_run_kernel_methods_agree_and_are_timed(dry_run):
    k = dry_run[1]["parts"]["kernels"]["result"]
    assert k["device"] == "cpu" and k["methods"] == ["naive", "sleuth", "fused"]  # no Liger on the CPU
    assert len(k["rows"]) == 2
    for row in k["rows"]:
        for m in ("naive", "sleuth", "fused"):
            assert row[m]["ms"] > 0 and row[m]["tflops"] > 0
        losses = [row[m]["loss"] for m in ("naive", "sleuth", "fused")]
        assert max(losses) - min(losses) < 1e-4 * abs(losses[0]) and losses[0] > 0
    assert len(k["rows"][0]["fused_sweep"]) == 4 and "fused_sweep" not in k["rows"][1]
    agree = [t for t in k["targets"] if "agree" in t["name"]]
    assert len(agree) == 2 and all(t["met"] for t in agree)


def test_dry_run_drift_fp32_control_is_zero_and_bf16_is_not(dry_run):
    d = dry_run[1]["parts"]["drift"]["result"]
    assert set(d["rows"]) == {"bf16", "fp32", "fp32_autocast", "control"}
    ctrl = d["rows"]["control"]
    assert ctrl["tokens"] > 0 and ctrl["offpolicy/lp_diff_abs_max"] < 1e-4 and ctrl["offpolicy/lp_diff_abs_mean"] < 1e-5
    for mode in ("bf16", "fp32", "fp32_autocast"):
        r = d["rows"][mode]
        assert r["tokens"] > 0 and r["rollout"] == "bf16"
        # bf16 rollouts differ from any scoring by bf16 rounding: well above the control, far below a nat
        assert 1e-5 < r["offpolicy/lp_diff_abs_mean"] < 0.05 and r["offpolicy/lp_diff_abs_max"] < 0.5
        q = [r[f"offpolicy/ratio_p{p}"] for p in ("01", "05", "50", "95", "99")] + [r["offpolicy/ratio_max"]]
        assert q == sorted(q) and 0.5 < q[0] <= 1.0 <= q[-1] < 2.0
        assert r["offpolicy/tis_capped"] == 0.0 and r["tis_cap"] == 2.0
    assert d["rollout"]["gen_tokens_per_s"] > 0


def test_dry_run_train_steps_have_every_phase(dry_run, gc):
    t = dry_run[1]["parts"]["train"]["result"]
    train = _load("gpu_train")
    assert t["exit_code"] == 0 and len(t["steps"]) == 3 and len(t["records"]) == 3
    for s in t["steps"]:
        assert list(s["phases"]) == list(train.PHASES.values())
        for phase in ("rollout", "score", "update"):
            assert s["phases"][phase] > 0
        assert s["episodes"] == 4 and s["gen_tokens"] > 0 and s["gen_tokens_per_s"] > 0 and s["tool_tokens"] > 0
        assert s["step_s"] >= s["phases"]["rollout"] + s["phases"]["update"]
    assert t["steps"][-1]["phases"]["checkpoint"] > 0 and t["checkpoint_gib"] > 0  # the last step checkpoints
    assert t["server_warmup_s"] > 0 and "retrieval.url=http://127.0.0.1:" in " ".join(t["argv"])
    assert t["argv"][:4] == ["sleuth", "train", "--config", "configs/search_r1_qwen2.5_3b.yaml"]


def test_dry_run_faiss_fallback_matches_the_cpu_index(dry_run):
    f = dry_run[1]["parts"]["faiss"]["result"]
    assert f["on_gpu"] is False and f["vectors"] == 10_000
    assert f["rows_identical"] == f["top1_agree"] == f["topk_overlap"] == f["cpu_exact_top1"] == 1.0
    assert f["score_max_abs_diff"] == 0.0


def test_dry_run_markdown_has_the_three_tables(dry_run):
    md = dry_run[2]
    assert "CPU dry run" in md and "| part | status | budget s | timeout s | wall s | note |" in md
    assert "|    H |     N | tool | floor ms | naive ms |" in md
    assert "| rollout | trainer scoring | tokens | mean abs |" in md
    assert "| step | episodes | searches |" in md and "FAISS" in md
    assert md == dry_run[0].stdout[dry_run[0].stdout.index("GPU check, "):].split("\nresult: ")[0]


def test_parts_fit_in_eight_minutes(gc):
    assert sum(p.timeout_s for p in gc.PARTS) == 8 * 60
    assert all(p.budget_s < p.timeout_s for p in gc.PARTS)
    assert sorted(p.bit for p in gc.PARTS) == [1, 2, 4, 8, 16]


def test_a_part_over_its_timeout_is_killed_with_its_children(gc, tmp_path):
    marker = tmp_path / "child_alive"
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            f"\"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).write_text('x')\"]); time.sleep(30)")
    rc, secs = gc.run_process([sys.executable, "-c", code], timeout_s=1.0)
    assert rc is None and 1.0 <= secs < 10
    import time

    time.sleep(3.5)
    assert not marker.exists(), "the part's child outlived the timeout"
    part = gc.Part("drift", 4, 1, 120, "gpu_drift.py", ("--help-me-fail",))
    res = gc.run_script(part, False, tmp_path, dict(os.environ))
    assert res["status"] == "failed" and "exited 2" in res["message"]


def test_junit_counts_and_card_names(gc, tmp_path):
    (tmp_path / "r.xml").write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" '
                                    'failures="2" skipped="3" tests="10" time="4.5"/></testsuites>')
    assert gc.junit_counts(tmp_path / "r.xml") == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3,
                                                   "seconds": 4.5}
    assert gc.card_slug("NVIDIA H100 80GB HBM3") == "h100" and gc.card_slug("NVIDIA H200") == "h200"
    assert gc.card_slug("NVIDIA A100-SXM4-80GB") == "a100" and gc.card_slug("Some GPU") == "some_gpu"


def test_judge_marks_a_missing_gpu_measurement(gc):
    faiss = next(p for p in gc.PARTS if p.name == "faiss")
    res = gc.judge(faiss, {"status": "ok", "result": {"on_gpu": False}, "wall_s": 1}, dry=False)
    assert res["status"] == "skipped" and "faiss-gpu" in res["message"]
    assert gc.judge(faiss, {"status": "ok", "result": {"on_gpu": False}, "wall_s": 1}, dry=True)["status"] == "ok"
    kern = next(p for p in gc.PARTS if p.name == "kernels")
    res = gc.judge(kern, {"status": "ok", "result": {"liger": "ModuleNotFoundError: x"}, "wall_s": 1}, dry=False)
    assert res["status"] == "ok" and "no Liger column" in res["message"]


def test_report_of_failed_and_partial_parts(gc):
    tables = _load("gpu_tables")
    res = {"parts": {"tests": {"status": "timeout", "budget_s": 85, "timeout_s": 110, "message": "m"},
                     "train": {"status": "timeout", "budget_s": 170, "timeout_s": 190,
                               "result": {"steps": [{"phases": {"rollout": 1.0}, "peak_alloc_gib": {}}]}},
                     "drift": {"status": "failed", "budget_s": 35, "timeout_s": 60, "result": {"rows": {"x": {}}}}}}
    text = tables.report(res)
    assert "| tests | timeout | 85 | 110 |" in text and "(no result: timeout)" in text
    assert "| 1 | - | - | - | - | 1.00 | 0.00 |" in text  # the step the train part finished before its timeout
    assert "(partial result, not tabulated: KeyError" in text
