"""Benchmark: masked log-prob + loss, forward+backward, Sleuth's fused kernel vs naive PyTorch vs Liger-Kernel.

The grid: Qwen2.5 vocabulary V = 151,936; hidden H in {896, 2048, 3584}; N in {16k, 64k} tokens;
30% and 60% tool tokens, plus the target point (H 2048, N 64k, 40% tool). bf16 hidden states and LM head.

Methods (each: loss = masked mean of -log p(target), then backward to hidden and LM-head weight):
* ``naive``: LM head over all N -> float32 log_softmax -> gather -> masked mean (Search-R1 / verl style);
* ``sleuth``: training.model.kernels.masked_logprobs (policy rows only, row blocks x vocabulary chunks, online
  LSE, recompute in the backward);
* ``liger``: Liger-Kernel's LigerFusedLinearCrossEntropyLoss with ignore_index at tool tokens (if importable).

Reported per method: median fwd+bwd time (CUDA events, after warm-up), peak memory above the inputs
(torch.cuda.max_memory_allocated), achieved TFLOP/s of the useful LM-head work (6 N_policy H V: forward
logits plus the two backward products; the forward floor alone is 2 N_policy H V) and the time floor at
the measured bf16 matmul rate. Prints a table; writes bench/results/kernels.json.

Usage (GPU): ``python bench/kernels.py [--quick | --points H:N:FRAC ...] [--sweep] [--profile] [--repeat 5]
[--chunk 8192] [--row-block 4096] [--out bench/results/kernels.json]``.
Without a GPU it exits with status 2 and a message, or runs ``--cpu-smoke``: the reference path on tiny
shapes, to check that the script runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.model import kernels as K

V_QWEN25 = 151_936
HIDDEN = (896, 2048, 3584)
TOKENS = (16_384, 65_536)
TOOL_FRACS = (0.3, 0.6)
TARGET = (2048, 65_536, 0.4)  # the acceptance point
SWEEP = [(8192, 1024), (8192, 2048), (8192, 4096), (8192, 8192), (16384, 2048), (16384, 4096), (4096, 8192)]


def grid(quick: bool) -> list[tuple[int, int, float]]:
    if quick:
        return [(896, 16_384, 0.3), TARGET]
    pts = [(h, n, f) for h in HIDDEN for n in TOKENS for f in TOOL_FRACS]
    return pts + [TARGET]


def parse_point(text: str) -> tuple[int, int, float]:
    """``"H:N:tool_frac"`` (e.g. ``2048:65536:0.4``) -> ``(H, N, tool_frac)`` with H, N >= 1 and
    0 <= tool_frac < 1; raises ``ValueError`` (argparse: a usage error)."""
    try:
        h, n, f = text.split(":")
        h, n, f = int(h), int(n), float(f)
        if h < 1 or n < 1 or not 0 <= f < 1:
            raise ValueError
        return h, n, f
    except ValueError as e:
        raise ValueError(f"grid point must be H:N:tool_frac with H, N >= 1 and 0 <= tool_frac < 1, "
                         f"e.g. 2048:65536:0.4; got {text!r}") from e


def _point_arg(text: str) -> tuple[int, int, float]:
    """argparse type of ``--points``: :func:`parse_point`, its error a usage error with its message."""
    try:
        return parse_point(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_inputs(N: int, H: int, V: int, tool_frac: float, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(N, H, generator=g, device=device, dtype=torch.float32).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g, device=device, dtype=torch.float32) / H**0.5 * 3).to(dtype)
    w.requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g, device=device)
    m = torch.rand(N, generator=g, device=device) >= tool_frac  # True at policy tokens
    return h, w, t, m


def loss_naive(h, w, t, m, chunk):
    logp = torch.log_softmax((h @ w.T).float(), dim=-1)
    lp = logp.gather(-1, t[:, None]).squeeze(-1)
    mf = m.float()
    return -(lp * mf).sum() / mf.sum().clamp(min=1)


def loss_sleuth(h, w, t, m, chunk, impl="cuda", row_block=4096):
    lp, _ = K.masked_logprobs(h, w, t, m, chunk, row_block=row_block, impl=impl)
    mf = m.float()
    return -(lp * mf).sum() / mf.sum().clamp(min=1)


def make_liger():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # noqa: BLE001 - optional dependency: any import failure means "skip"
        return None, f"{type(e).__name__}: {e}"
    fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")

    def loss_liger(h, w, t, m, chunk):
        out = fn(w, h, torch.where(m, t, torch.full_like(t, -100)))
        return out[0] if isinstance(out, tuple) else out

    return loss_liger, None


def time_fwd_bwd(fn, inputs, repeat: int, chunk: int) -> dict:
    h, w, t, m = inputs
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(repeat + 1):  # first run is the warm-up (build, cuBLAS handles, autotune)
        h.grad = None
        w.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(h, w, t, m, chunk).backward()
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    h.grad = None
    w.grad = None
    return {"ms": statistics.median(times), "ms_spread": max(times) - min(times), "peak_gib": peak / 2**30}


def matmul_tflops(dtype=torch.bfloat16, n: int = 8192, repeat: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * repeat / (start.elapsed_time(end) / 1e3) / 1e12


def run_profile(args) -> int:
    """torch.profiler over 3 fwd+bwd of the sleuth path at the target point: time per CUDA kernel."""
    H, N, frac = TARGET
    inputs = make_inputs(N, H, V_QWEN25, frac, "cuda", torch.bfloat16)
    fn = partial(loss_sleuth, row_block=args.row_block)
    time_fwd_bwd(fn, inputs, 1, args.chunk)  # warm-up
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            inputs[0].grad = inputs[1].grad = None
            fn(*inputs, args.chunk).backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return 0


def run_gpu(args) -> int:
    dev = "cuda"
    K.load_extension()
    if args.profile:
        return run_profile(args)
    liger, liger_err = make_liger()
    if liger is None:
        print(f"[bench] Liger-Kernel not importable ({liger_err}); its column is skipped", flush=True)
    peak_tf = matmul_tflops()
    gpu = torch.cuda.get_device_name()
    print(f"[bench] {gpu}; measured bf16 matmul {peak_tf:.0f} TFLOP/s; torch {torch.__version__}", flush=True)
    methods = {"naive": loss_naive, "sleuth": partial(loss_sleuth, row_block=args.row_block)}
    if liger is not None:
        methods["liger"] = liger
    rows = []
    points = args.points or grid(args.quick)
    for H, N, frac in points:
        inputs = make_inputs(N, H, V_QWEN25, frac, dev, torch.bfloat16)
        n_pol = int(inputs[3].sum())
        useful = 6.0 * n_pol * H * V_QWEN25
        row = {
            "H": H,
            "N": N,
            "tool_frac": frac,
            "n_policy": n_pol,
            "V": V_QWEN25,
            "floor_ms": useful / (peak_tf * 1e12) * 1e3,
            "fwd_floor_flop": 2.0 * n_pol * H * V_QWEN25,
        }
        for name, fn in methods.items():
            try:
                r = time_fwd_bwd(fn, inputs, args.repeat, args.chunk)
                r["tflops"] = useful / (r["ms"] / 1e3) / 1e12
            except torch.cuda.OutOfMemoryError:
                r = {"oom": True}
            torch.cuda.empty_cache()
            row[name] = r
            print(f"[bench] H={H} N={N} tool={frac:.0%} {name}: {r}", flush=True)
        if args.sweep and (H, N, frac) == TARGET:
            row["sweep"] = []
            for chunk, rb in SWEEP:
                fn = partial(loss_sleuth, row_block=rb)
                r = {"chunk": chunk, "row_block": rb, **time_fwd_bwd(fn, inputs, args.repeat, chunk)}
                row["sweep"].append(r)
                print(f"[bench] sweep chunk={chunk} row_block={rb}: {r}", flush=True)
        rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    out = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "matmul_tflops": peak_tf,
        "chunk": args.chunk,
        "row_block": args.row_block,
        "repeat": args.repeat,
        "liger": liger_err or "ok",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print_table(out, list(methods))
    return 0


def _fmt(r: dict, key: str, fmt: str) -> str:
    if r.get("oom"):
        return "OOM"
    return format(r[key], fmt) if key in r else "-"


def print_table(out: dict, methods: list[str]) -> None:
    print(
        f"\n{out['gpu']}  bf16 matmul {out['matmul_tflops']:.0f} TFLOP/s  chunk {out['chunk']}  "
        f"row block {out.get('row_block', '-')}  {out['date']}"
    )
    head = f"{'H':>5} {'N':>6} {'tool':>5} {'floor ms':>9}"
    for m in methods:
        head += f" | {m + ' ms':>10} {'GiB':>7} {'TF/s':>6}"
    head += " | sleuth/naive t, mem | sleuth/liger t, mem"
    print(head)
    for r in out["rows"]:
        line = f"{r['H']:>5} {r['N']:>6} {r['tool_frac']:>5.0%} {r['floor_ms']:>9.1f}"
        for m in methods:
            x = r[m]
            line += f" | {_fmt(x, 'ms', '10.1f'):>10} {_fmt(x, 'peak_gib', '7.2f'):>7} {_fmt(x, 'tflops', '6.0f'):>6}"
        s = r.get("sleuth", {})
        for other in ("naive", "liger"):
            o = r.get(other)
            if o is None or o.get("oom") or s.get("oom") or "ms" not in s:
                line += f" | {'-' if o is None else (f'{other} OOM' if o.get('oom') else '-'):>19}"
            else:
                line += f" | {s['ms'] / o['ms']:>8.2f}x {s['peak_gib'] / max(o['peak_gib'], 1e-9):>8.2f}x"
        print(line)
    for r in out["rows"]:
        for x in r.get("sweep", []):
            print(
                f"  sweep H={r['H']} N={r['N']} tool={r['tool_frac']:.0%}: chunk {x['chunk']:>6} row block "
                f"{x['row_block']:>5}: {x['ms']:7.1f} ms {x['peak_gib']:6.2f} GiB"
            )


def run_cpu_smoke() -> int:
    """Tiny shapes through the reference path and the naive loss: checks the script, measures nothing."""
    N, H, V = 64, 32, 1000
    h, w, t, m = make_inputs(N, H, V, 0.4, "cpu", torch.float32)
    t0 = time.perf_counter()
    a = loss_sleuth(h, w, t, m, 256, impl="reference")
    a.backward()
    a = a.detach()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    b = loss_naive(h, w, t, m, 256)
    b.backward()
    b = b.detach()
    ok = (
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        and torch.allclose(gh, h.grad, atol=1e-6)
        and torch.allclose(gw, w.grad, atol=1e-6)
    )
    print(
        f"[bench --cpu-smoke] reference vs naive on N={N} H={H} V={V}: loss {a.item():.6f} vs {b.item():.6f}; "
        f"grads {'match' if ok else 'DIFFER'} ({time.perf_counter() - t0:.2f} s). No timings on CPU."
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from sleuth.commands.common import positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two grid points only (smallest + the target)")
    p.add_argument("--repeat", type=positive_int, default=5, help="timed runs per method (median reported)")
    p.add_argument("--chunk", type=positive_int, default=8192, help="vocabulary chunk of the sleuth kernel")
    p.add_argument("--row-block", type=positive_int, default=4096, help="policy rows per block of the sleuth kernel")
    p.add_argument(
        "--sweep", action="store_true", help="also time (chunk, row_block) pairs at the target point"
    )
    p.add_argument("--points", nargs="+", type=_point_arg, metavar="H:N:FRAC",
                   help="grid points to run instead of the grid")
    p.add_argument("--profile", action="store_true", help="profile sleuth at the target point and exit")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kernels.json"))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny reference-only run that needs no GPU")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        return run_cpu_smoke()
    if not torch.cuda.is_available():
        print(
            "bench/kernels.py needs a CUDA GPU (H100/H200); none is visible. "
            "Run with --cpu-smoke to check the script on CPU.",
            file=sys.stderr,
        )
        return 2
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
