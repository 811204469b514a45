"""Benchmark: masked log-prob + loss, forward+backward, Sleuth's fused kernel vs naive PyTorch vs Liger-Kernel.

The grid: Qwen2.5 vocabulary V = 151,936; hidden H in {896, 2048, 3584}; N in {16k, 64k} tokens;
30% and 60% tool tokens, plus the target point (H 2048, N 64k, 40% tool). bf16 hidden states and LM head.

Methods (each: loss = masked mean of -log p(target), then backward to hidden and LM-head weight):
* ``naive``: LM head over all N -> float32 log_softmax -> gather -> masked mean (Search-R1 / verl style);
* ``sleuth``: training.model.kernels.masked_logprobs (policy rows only, row blocks x vocabulary chunks, online
  LSE, recompute in the backward);
* ``fused``: training.model.fused_loss.fused_token_loss, the opt-in path that computes the gradient in the forward
  (three LM-head matmuls per policy row instead of four; row blocks sized as Liger sizes its chunks);
* ``liger``: Liger-Kernel's LigerFusedLinearCrossEntropyLoss with ignore_index at tool tokens (if importable).

Reported per method: median fwd+bwd time (CUDA events, after warm-up), peak memory above the inputs
(torch.cuda.max_memory_allocated), achieved TFLOP/s of the useful LM-head work (6 N_policy H V: forward
logits plus the two backward products; the forward floor alone is 2 N_policy H V) and the time floor at
the measured bf16 matmul rate. Prints a table; writes bench/results/kernels.json.

Usage (GPU): ``python bench/kernels.py [--quick | --points H:N:FRAC ...] [--methods naive sleuth fused liger]
[--sweep] [--profile] [--repeat 5] [--target-repeat 10] [--chunk 8192] [--row-block 4096] [--out
bench/results/kernels.json]``. Without a GPU it exits with status 2 and a message, or runs ``--cpu-smoke``
(the reference path on tiny shapes against naive autograd) or ``--device cpu --tiny`` (every method's torch
path through the same timing and table code, at tiny shapes: checks the script, measures nothing).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.model import fused_loss as FL
from training.model import kernels as K

V_QWEN25 = 151_936
HIDDEN = (896, 2048, 3584)
TOKENS = (16_384, 65_536)
TOOL_FRACS = (0.3, 0.6)
TARGET = (2048, 65_536, 0.4)  # the acceptance point
SWEEP = [(8192, 1024), (8192, 2048), (8192, 4096), (8192, 8192), (16384, 2048), (16384, 4096), (4096, 8192)]
#: (chunk, row_block) of the fused path at the target point (None: its default, auto_row_block; V: one matmul)
FUSED_SWEEP = [(8192, 512), (8192, 2048), (V_QWEN25, None), (32768, None)]
METHODS = ("naive", "sleuth", "fused", "liger")
#: the tiny CPU run (--device cpu --tiny): (H, N, tool_frac) points and vocabulary
TINY_POINTS, TINY_V = [(32, 256, 0.4), (48, 512, 0.3)], 1000
#: the acceptance targets at the target point: fused time within this factor of the LM-head matmul floor
FLOOR_TARGET = 1.25


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


def loss_fused(h, w, t, m, chunk, impl="cuda", row_block=None):
    n = m.sum().clamp(min=1).float()
    return FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp / n, row_block=row_block, chunk_size=chunk,
                               impl=impl)[0]


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
    """Median fwd+bwd time of ``fn`` over ``repeat`` runs after a warm-up: CUDA events on a GPU (and the peak
    memory above the inputs), wall clock on the CPU (no memory figure there); ``loss``: the warm-up's value."""
    h, w, t, m = inputs
    cuda = h.is_cuda
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(repeat + 1):  # first run is the warm-up (build, cuBLAS handles, autotune)
        h.grad = None
        w.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = fn(h, w, t, m, chunk)
            loss.backward()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            loss = fn(h, w, t, m, chunk)
            loss.backward()
            dt = (time.perf_counter() - t0) * 1e3
        if i:
            times.append(dt)
        else:
            value = float(loss.detach())  # the warm-up's loss: the methods must agree on it
    h.grad = None
    w.grad = None
    out = {"ms": statistics.median(times), "ms_spread": max(times) - min(times), "loss": value}
    if cuda:
        out["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out


def matmul_tflops(dtype=torch.bfloat16, n: int = 8192, repeat: int = 10, device: str = "cuda") -> float:
    """The measured matmul rate (TFLOP/s) of ``n x n x n`` products: the floor's rate."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeat):
            a @ b
        return 2 * n**3 * repeat / (time.perf_counter() - t0) / 1e12
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


def bench_methods(args, device: str) -> tuple[dict, str | None]:
    """The methods of ``args.methods`` that can run on ``device``: the kernels on a GPU, their torch paths on
    the CPU (no Liger there). Returns ``(name -> loss function, why Liger is missing or None)``."""
    impl = "cuda" if device == "cuda" else "reference"
    avail = {"naive": loss_naive, "sleuth": partial(loss_sleuth, impl=impl, row_block=args.row_block),
             "fused": partial(loss_fused, impl=impl, row_block=args.fused_row_block)}
    liger_err = None
    if "liger" in args.methods:
        liger, liger_err = make_liger() if device == "cuda" else (None, "not run on the CPU")
        if liger is None:
            print(f"[bench] Liger-Kernel not importable ({liger_err}); its column is skipped", flush=True)
        else:
            avail["liger"] = liger
    return {m: avail[m] for m in args.methods if m in avail}, liger_err


def measure_point(point, V: int, methods: dict, args, device: str, dtype, peak_tf: float) -> dict:
    """Every method at one ``(H, N, tool_frac)`` point (the target point with ``args.target_repeat`` runs),
    and there with ``args.sweep`` / ``args.fused_sweep`` the ``(chunk, row_block)`` sweeps of sleuth / fused."""
    H, N, frac = point
    inputs = make_inputs(N, H, V, frac, device, dtype)
    n_pol = int(inputs[3].sum())
    useful = 6.0 * n_pol * H * V
    row = {"H": H, "N": N, "tool_frac": frac, "n_policy": n_pol, "V": V,
           "floor_ms": useful / (peak_tf * 1e12) * 1e3, "fwd_floor_flop": 2.0 * n_pol * H * V}
    target = tuple(point) == (TINY_POINTS[0] if args.tiny else TARGET)  # the acceptance point
    repeat = args.target_repeat if target and args.target_repeat else args.repeat
    row["repeat"] = repeat
    for name, fn in methods.items():
        try:
            r = time_fwd_bwd(fn, inputs, repeat, args.chunk)
            r["tflops"] = useful / (r["ms"] / 1e3) / 1e12
        except torch.cuda.OutOfMemoryError:
            r = {"oom": True}
        if device == "cuda":
            torch.cuda.empty_cache()
        row[name] = r
        print(f"[bench] H={H} N={N} tool={frac:.0%} {name}: {r}", flush=True)
    impl = "cuda" if device == "cuda" else "reference"
    for key, loss, pairs, on in (("sweep", loss_sleuth, SWEEP, args.sweep),
                                 ("fused_sweep", loss_fused, FUSED_SWEEP, args.fused_sweep)):
        if on and target:
            row[key] = []
            for chunk, rb in pairs:
                fn = partial(loss, impl=impl, row_block=rb)
                r = {"chunk": chunk, "row_block": rb, **time_fwd_bwd(fn, inputs, repeat, chunk)}
                row[key].append(r)
                print(f"[bench] {key} chunk={chunk} row_block={rb}: {r}", flush=True)
    return row


def run_gpu(args, device: str = "cuda") -> int:
    """The benchmark on ``device`` (``cpu``: the torch paths at tiny shapes with ``args.tiny``); writes
    ``args.out`` and prints the table and the targets."""
    if device == "cuda":
        K.load_extension()
        if args.profile:
            return run_profile(args)
    methods, liger_err = bench_methods(args, device)
    if device == "cuda":
        peak_tf, gpu, dtype = matmul_tflops(), torch.cuda.get_device_name(), torch.bfloat16
    else:
        peak_tf, gpu, dtype = matmul_tflops(torch.float32, 256, 3, "cpu"), f"CPU ({platform.machine()})", torch.float32
    print(f"[bench] {gpu}; measured matmul {peak_tf:.1f} TFLOP/s; torch {torch.__version__}", flush=True)
    V = TINY_V if args.tiny else V_QWEN25
    points = list(args.points or (TINY_POINTS if args.tiny else grid(args.quick)))
    target = tuple(TINY_POINTS[0] if args.tiny else TARGET)
    points.sort(key=lambda p: tuple(p) != target)  # the acceptance point first: a stopped run keeps it
    out = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "gpu": gpu,
        "device": device,
        "torch": torch.__version__,
        "matmul_tflops": peak_tf,
        "chunk": args.chunk,
        "row_block": args.row_block,
        "fused_row_block": args.fused_row_block or "auto",
        "repeat": args.repeat,
        "methods": list(methods),
        "liger": liger_err or "ok",
        "target_point": list(target),
        "rows": [],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for point in points:
        out["rows"].append(measure_point(point, V, methods, args, device, dtype, peak_tf))
        out["targets"] = targets(out)
        Path(args.out).write_text(json.dumps(out, indent=2))  # after every point: a stopped run keeps what it measured
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(out, list(methods))
    for t in out["targets"]:
        print(f"target: {t['name']}: {t['value']} ({'met' if t['met'] else 'NOT met' if t['met'] is False else '-'})")
    return 0


def targets(out: dict) -> list[dict]:
    """The acceptance targets of the fused path, judged on ``out``'s rows: ``{name, value, met}`` (``met``
    None where a figure is missing): at the target point within :data:`FLOOR_TARGET` of the LM-head matmul
    floor; at every point faster than Liger and no larger."""
    res = []
    for r in out["rows"]:
        vals = {m: r[m]["loss"] for m in METHODS if "loss" in r.get(m, {})}
        if len(vals) > 1:
            spread = (max(vals.values()) - min(vals.values())) / max(abs(min(vals.values())), 1e-9)
            res.append({"name": f"the methods' losses agree (1e-2) at H {r['H']}, N {r['N']}, {r['tool_frac']:.0%} tool",
                        "value": f"{spread:.1e}", "met": spread < 1e-2})
        f = r.get("fused", {})
        if [r["H"], r["N"], r["tool_frac"]] == list(out.get("target_point", TARGET)):
            ok = "ms" in f
            res.append({"name": f"fused <= {FLOOR_TARGET}x the matmul floor at H {r['H']}, N {r['N']}, "
                                f"{r['tool_frac']:.0%} tool", "value": f"{f['ms'] / r['floor_ms']:.2f}x" if ok else "-",
                        "met": f["ms"] <= FLOOR_TARGET * r["floor_ms"] if ok else None})
        li = r.get("liger", {})
        both = "ms" in f and "ms" in li and "peak_gib" in f and "peak_gib" in li
        name = f"fused faster than Liger and no larger at H {r['H']}, N {r['N']}, {r['tool_frac']:.0%} tool"
        value = f"{f['ms'] / li['ms']:.2f}x time, {f['peak_gib'] / li['peak_gib']:.2f}x memory" if both else "-"
        res.append({"name": name, "value": value,
                    "met": (f["ms"] < li["ms"] and f["peak_gib"] <= li["peak_gib"]) if both else None})
    return res


def _fmt(r: dict, key: str, fmt: str) -> str:
    if r.get("oom"):
        return "OOM"
    return format(r[key], fmt) if key in r else "-"


def _ratio(a: dict | None, b: dict | None, name: str) -> str:
    """``a`` against ``b`` as "time x, memory x" (memory only where both have it), ``name OOM`` when ``b`` ran
    out of memory, ``-`` when either is missing."""
    if a is None or b is None or a.get("oom") or "ms" not in a:
        return "-"
    if b.get("oom"):
        return f"{name} OOM"
    if "ms" not in b:
        return "-"
    mem = f", {a['peak_gib'] / max(b['peak_gib'], 1e-9):.2f}x" if "peak_gib" in a and "peak_gib" in b else ""
    return f"{a['ms'] / b['ms']:.2f}x{mem}"


def print_table(out: dict, methods: list[str]) -> None:
    print(
        f"\n{out['gpu']}  matmul {out['matmul_tflops']:.0f} TFLOP/s  chunk {out['chunk']}  "
        f"row block {out.get('row_block', '-')}  fused row block {out.get('fused_row_block', '-')}  {out['date']}"
    )
    head = f"{'H':>5} {'N':>6} {'tool':>5} {'floor ms':>9}"
    for m in methods:
        head += f" | {m + ' ms':>10} {'GiB':>7} {'TF/s':>6}"
    pairs = [("sleuth", "naive"), ("sleuth", "liger"), ("fused", "liger")]
    head += "".join(f" | {a}/{b} t, mem" for a, b in pairs) + " | sleuth/floor | fused/floor"
    print(head)
    for r in out["rows"]:
        line = f"{r['H']:>5} {r['N']:>6} {r['tool_frac']:>5.0%} {r['floor_ms']:>9.1f}"
        for m in methods:
            x = r[m]
            line += f" | {_fmt(x, 'ms', '10.1f'):>10} {_fmt(x, 'peak_gib', '7.2f'):>7} {_fmt(x, 'tflops', '6.0f'):>6}"
        line += "".join(f" | {_ratio(r.get(a), r.get(b), b):>18}" for a, b in pairs)
        for m in ("sleuth", "fused"):
            x = r.get(m, {})
            line += f" | {x['ms'] / r['floor_ms']:>11.2f}x" if "ms" in x else f" | {'-':>12}"
        print(line)
    for r in out["rows"]:
        for key in ("sweep", "fused_sweep"):
            for x in r.get(key, []):
                print(f"  {key} H={r['H']} N={r['N']} tool={r['tool_frac']:.0%}: chunk {x['chunk']:>6} row block "
                      f"{x['row_block'] or 'auto':>5}: {x['ms']:7.1f} ms {_fmt(x, 'peak_gib', '6.2f')} GiB")


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
    p.add_argument("--fused-row-block", type=positive_int, default=None,
                   help="policy rows per block of the fused path (default: training.model.fused_loss.auto_row_block)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["naive", "sleuth", "liger"],
                   help="methods to time (default naive sleuth liger; fused is the opt-in path)")
    p.add_argument("--target-repeat", type=positive_int, default=None,
                   help="timed runs at the target point (default: --repeat)")
    p.add_argument(
        "--sweep", action="store_true", help="also time (chunk, row_block) pairs at the target point"
    )
    p.add_argument("--fused-sweep", action="store_true",
                   help="also time the fused path's (chunk, row_block) pairs at the target point")
    p.add_argument("--points", nargs="+", type=_point_arg, metavar="H:N:FRAC",
                   help="grid points to run instead of the grid")
    p.add_argument("--profile", action="store_true", help="profile sleuth at the target point and exit")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kernels.json"))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny reference-only run that needs no GPU")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: every method's torch path through the same code (with --tiny; measures nothing)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and vocabulary (for --device cpu)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        return run_cpu_smoke()
    if args.device == "cpu":
        return run_gpu(args, "cpu")
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
