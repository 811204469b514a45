"""Weight sync to a fleet of engine processes: push time over a gloo transfer group against shared-disk
safetensors, for the tiny test policy and a larger random Qwen2 shape, and the probe check after it.

Starts ``--engines`` ``sleuth serve-engine`` processes on each model (127.0.0.1), pushes the model's weights
``--repeats`` times per transport and bucket size through :class:`training.rollout.fleet_sync.FleetSync`
(each push verified on every engine), and reports the median push time, the rate (model bytes per second,
to every engine at once) and the verification time. The first push over gloo forms the transfer group; it is
reported apart (``form_s``) and left out of the median.

    .venv/bin/python bench/fleet_sync.py [--shapes tiny,small] [--engines 2] [--repeats 3]

Prints a table and writes ``bench/results/fleet_sync.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

#: model shapes: a tiny policy, and a random 24M-parameter Qwen2 (97 MB in fp32) with the same tokenizer
SHAPES = {
    "tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64},
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1536},
}


def build_model(shape: str, out: Path) -> Path:
    """The tiny policy's tokenizer with a random Qwen2 of ``shape``, saved to ``out``."""
    from corpora.formats import Passage, QAExample
    from sleuth.config import TinyPolicyConfig
    from training.model.tiny import create_tiny_policy

    passages = [Passage.make("p0", "Paris", "Paris is the capital and most populous city of France.")]
    questions = [QAExample("q0", "What is the capital of France?", ["Paris"])]
    cfg = TinyPolicyConfig(vocab_size=400, max_position_embeddings=1024, **SHAPES[shape])
    return create_tiny_policy(out, passages, questions, cfg, seed=0)


def start_engines(model_dir: Path, n: int, logs: Path) -> tuple[list[subprocess.Popen], list[str]]:
    from agent.backends.fleet import wait_until_up

    procs, urls = [], []
    for i in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(logs / f"engine{i}.log", "wb")  # noqa: SIM115 - the process writes it
        procs.append(subprocess.Popen([sys.executable, "-m", "sleuth.cli", "serve-engine", "--model", str(model_dir),
                                       "--served-model-name", "bench", "--port", str(port), "--threads", "1",
                                       "--device", "cpu"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_until_up(u, 600, "the benchmark's engine")
    return procs, urls


def bench_shape(shape: str, engines: int, repeats: int, buckets_mb: list[float], work: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.backends.fleet import Fleet
    from agent.backends.hf import sequence_logprobs
    from training.rollout.fleet_sync import FleetSync, FullState, SyncSettings
    from training.rollout.weight_sync import probe_ids

    model_dir = build_model(shape, work / shape)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    procs, urls = start_engines(model_dir, engines, work)
    rows = []
    try:
        fleet = Fleet(urls, tok, "bench")
        ids = probe_ids(tok)
        version = 0
        for transport in ("gloo", "disk"):
            for mb in buckets_mb:
                settings = SyncSettings(transport=transport, bucket_bytes=int(mb * 2**20), timeout_s=300,
                                        shared_dir=str(work / "shared"))
                sync = FleetSync(fleet, settings, rank=0)
                times, verify, form = [], [], None
                for r in range(repeats + (transport == "gloo")):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(1e-3)
                    want = sequence_logprobs(model, ids)
                    version += 1
                    t0 = time.perf_counter()
                    stats = sync.sync(FullState(model), version, ids, want, 1e-4)
                    total = time.perf_counter() - t0
                    if stats["sync/engines_verified"] != engines:
                        raise RuntimeError(f"an engine failed verification: {fleet.describe()}")
                    if transport == "gloo" and r == 0:
                        form = stats["sync/push_s"]
                        continue
                    times.append(stats["sync/push_s"])
                    verify.append(total - stats["sync/push_s"])
                push = statistics.median(times)
                rows.append({"shape": shape, "params": sum(p.numel() for p in model.parameters()),
                             "model_mb": nbytes / 2**20, "transport": transport, "bucket_mb": mb,
                             "buckets": int(stats["sync/buckets"]), "engines": engines, "push_s": push,
                             "mb_per_s": nbytes / 2**20 / push, "verify_s": statistics.median(verify),
                             "form_s": form, "repeats": repeats})
                print(_row(rows[-1]), flush=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return rows


HEADER = ("| shape | params | model MB | transport | bucket MB | buckets | engines | push s (median) | MB/s | "
          "verify s | first push s (forms the group) |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _row(r: dict) -> str:
    form = f"{r['form_s']:.3f}" if r["form_s"] is not None else "-"
    return (f"| {r['shape']} | {r['params']:,} | {r['model_mb']:.2f} | {r['transport']} | {r['bucket_mb']:g} | "
            f"{r['buckets']} | {r['engines']} | {r['push_s']:.3f} | {r['mb_per_s']:.1f} | {r['verify_s']:.3f} | {form} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,small", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--buckets-mb", default="1024,8", help="bucket sizes in MiB, comma-separated (default 1024,8)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/fleet_sync.json"))
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or args.engines < 1 or args.repeats < 1:
        ap.error(f"unknown shapes {unknown} (of {sorted(SHAPES)}), or --engines/--repeats below 1")
    buckets_mb = [float(x) for x in args.buckets_mb.split(",") if x]
    torch.set_num_threads(1)
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sleuth-fleet-bench-") as tmp:
        for shape in shapes:
            rows += bench_shape(shape, args.engines, args.repeats, buckets_mb, Path(tmp))
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
