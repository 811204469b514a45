"""Weight sync to a fleet of engine processes: push time over a gloo transfer group against shared-disk
safetensors, for the tiny test policy and larger random Qwen2 shapes, and the probe check after it.

Starts ``--engines`` ``sleuth serve-engine`` processes (``--server vllm``: ``vllm serve`` processes with the
gloo weight-transfer backend, :mod:`agent.backends.vllm_gloo`, run from vLLM's environment; gloo only) on each
model (127.0.0.1), pushes the model's weights
``--repeats`` times per transport and bucket size through :class:`training.rollout.fleet_sync.FleetSync`
(each push verified on every engine), and reports the median push time, the rate (model bytes per second,
to every engine at once) and the verification time. The first push over gloo forms the transfer group; it is
reported apart (``form_s``) and left out of the median.

    .venv/bin/python bench/fleet_sync.py [--shapes tiny,small] [--engines 2] [--repeats 3] [--transports gloo,disk]
    .venv-vllm/bin/python bench/fleet_sync.py --server vllm --shapes vtiny,small

Prints a table and writes ``bench/results/fleet_sync.json`` (``fleet_sync_vllm.json`` for ``--server vllm``;
``--out`` elsewhere). vLLM's CPU attention needs a head size of 32 or more: ``vtiny`` is the tiny policy of the
vLLM tests, ``half`` the layer shapes of Qwen2.5-0.5B (24 layers, hidden 896; this tokenizer's 400-token
vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
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
    "vtiny": {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64},
    "half": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864},
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


def engine_command(server: str, model_dir: Path, port: int) -> list[str]:
    """The command line of one engine: ``sleuth serve-engine``, or ``vllm serve`` taking gloo pushes."""
    if server == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", "1024", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
                "--weight-transfer-config", '{"backend": "gloo"}']
    return [sys.executable, "-m", "sleuth.cli", "serve-engine", "--model", str(model_dir), "--served-model-name",
            "bench", "--port", str(port), "--threads", "1", "--device", "cpu"]


def start_engines(server: str, model_dir: Path, n: int, logs: Path) -> tuple[list[subprocess.Popen], list[str]]:
    from agent.backends.fleet import wait_until_up
    from agent.backends.vllm_plugin import plugin_path

    env = dict(os.environ)
    if server == "vllm":
        extra = plugin_path(str(logs / "plugin"))
        env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), extra, env.get("PYTHONPATH", "")) if p)}
    procs, urls = [], []
    for i in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(logs / f"engine{i}.log", "wb")  # noqa: SIM115 - the process writes it
        procs.append(subprocess.Popen(engine_command(server, model_dir, port), cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_until_up(u, 1200, "the benchmark's engine")
    return procs, urls


def bench_shape(shape: str, engines: int, repeats: int, buckets_mb: list[float], work: Path, server: str = "sleuth",
                transports: tuple[str, ...] = ("gloo", "disk")) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.backends.fleet import Fleet
    from agent.backends.hf import sequence_logprobs
    from training.rollout.fleet_sync import FleetSync, FullState, SyncSettings
    from training.rollout.weight_sync import probe_ids

    model_dir = build_model(shape, work / shape)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    procs, urls = start_engines(server, model_dir, engines, work)
    rows = []
    try:
        fleet = Fleet(urls, tok, "bench")
        ids = probe_ids(tok)
        version = 0
        for transport in transports:
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
                rows.append({"server": server, "shape": shape, "params": sum(p.numel() for p in model.parameters()),
                             "model_mb": nbytes / 2**20, "transport": transport, "bucket_mb": mb,
                             "buckets": int(stats["sync/buckets"]), "engines": engines, "push_s": push,
                             "mb_per_s": nbytes / 2**20 / push, "verify_s": statistics.median(verify),
                             "form_s": form, "repeats": repeats})
                print(_row(rows[-1]), flush=True)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)  # vllm serve has child processes
            p.wait()
    return rows


HEADER = ("| server | shape | params | model MB | transport | bucket MB | buckets | engines | push s (median) | MB/s | "
          "verify s | first push s (forms the group) |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _row(r: dict) -> str:
    form = f"{r['form_s']:.3f}" if r["form_s"] is not None else "-"
    return (f"| {r.get('server', 'sleuth')} | {r['shape']} | {r['params']:,} | {r['model_mb']:.2f} | {r['transport']} | {r['bucket_mb']:g} | "
            f"{r['buckets']} | {r['engines']} | {r['push_s']:.3f} | {r['mb_per_s']:.1f} | {r['verify_s']:.3f} | {form} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,small", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--buckets-mb", default="1024,8", help="bucket sizes in MiB, comma-separated (default 1024,8)")
    ap.add_argument("--server", default="sleuth", choices=("sleuth", "vllm"),
                    help="the engines: sleuth serve-engine, or vllm serve (gloo pushes only)")
    ap.add_argument("--transports", default=None, help="comma-separated of gloo, disk (default: both; vllm: gloo)")
    ap.add_argument("--out", default=None, help="default bench/results/fleet_sync.json (vllm: fleet_sync_vllm.json)")
    args = ap.parse_args(argv)
    transports = tuple(t for t in (args.transports or ("gloo" if args.server == "vllm" else "gloo,disk")).split(",") if t)
    if not transports or set(transports) - {"gloo", "disk"} or (args.server == "vllm" and "disk" in transports):
        ap.error(f"--transports {args.transports!r}: gloo and/or disk (vllm serve takes gloo only)")
    out = args.out or str(ROOT / "bench/results" / ("fleet_sync_vllm.json" if args.server == "vllm" else "fleet_sync.json"))
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
            rows += bench_shape(shape, args.engines, args.repeats, buckets_mb, Path(tmp), args.server, transports)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
