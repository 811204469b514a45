"""The GPU check's tables, in bench/RESULTS.md's markdown form, from the parts' JSON alone (standard library only,
so the report prints even where a part's imports fail).

One function per part (:func:`kernel_table`, :func:`drift_table`, :func:`train_table`, :func:`faiss_line`,
:func:`tests_line`) and :func:`report`, which puts a bench/gpu_check.py result together: the parts' status,
then the three tables of the results (kernel, drift, training step with the FAISS line).
"""

from __future__ import annotations

#: (method, column label) of the kernel table, in order
KERNEL_METHODS = (("naive", "naive"), ("sleuth", "sleuth"), ("fused", "fused"), ("liger", "liger"))


def _cell(r: dict | None, key: str, fmt: str) -> str:
    if not isinstance(r, dict):
        return "-"
    if r.get("oom"):
        return "OOM"
    return format(r[key], fmt) if key in r else "-"


def _vs(a: dict | None, b: dict | None) -> str:
    """``a`` against ``b``: "time x, memory x" where both ran."""
    if not (isinstance(a, dict) and isinstance(b, dict)) or "ms" not in a or "ms" not in b:
        return "-"
    mem = f", {a['peak_gib'] / max(b['peak_gib'], 1e-9):.2f}x" if "peak_gib" in a and "peak_gib" in b else ""
    return f"{a['ms'] / b['ms']:.2f}x{mem}"


def kernel_table(out: dict) -> str:
    """bench/kernels.py's JSON as RESULTS.md's kernel table plus its targets and the fused path's sweep."""
    methods = [(m, lab) for m, lab in KERNEL_METHODS if any(m in r for r in out.get("rows", []))]
    head = "|    H |     N | tool | floor ms | " + " | ".join(f"{lab} ms | {lab} GiB" for _, lab in methods)
    head += " | sleuth/floor | fused/floor | fused/sleuth t, mem | fused/liger t, mem |"
    lines = [head, "|---" * (4 + 2 * len(methods) + 4) + "|"]
    for r in out.get("rows", []):
        cells = [f"| {r['H']} | {r['N']} | {r['tool_frac']:.0%} | {r['floor_ms']:.1f}"]
        cells += [f"{_cell(r.get(m), 'ms', '.1f')} | {_cell(r.get(m), 'peak_gib', '.2f')}" for m, _ in methods]
        for m in ("sleuth", "fused"):
            x = r.get(m, {})
            cells.append(f"{x['ms'] / r['floor_ms']:.2f}x" if "ms" in x else "-")
        cells += [_vs(r.get("fused"), r.get("sleuth")), _vs(r.get("fused"), r.get("liger"))]
        lines.append(" | ".join(cells) + " |")
    for r in out.get("rows", []):
        for x in r.get("fused_sweep", []):
            lines.append(f"- fused at H {r['H']}, N {r['N']}: chunk {x['chunk']}, row block {x['row_block'] or 'auto'}:"
                         f" {x['ms']:.1f} ms, {_cell(x, 'peak_gib', '.2f')} GiB")
    for t in out.get("targets", []):
        state = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"- target: {t['name']}: {t['value']} ({state})")
    return "\n".join(lines)


DRIFT_COLUMNS = [("lp_diff_abs_mean", "mean abs", ".2e"), ("lp_diff_abs_max", "max abs", ".3f"),
                 ("ratio_p01", "ratio p01", ".4f"), ("ratio_p50", "ratio p50", ".4f"), ("ratio_p99", "ratio p99", ".4f"),
                 ("ratio_max", "ratio max", ".3f"), ("kl_k3", "k3 KL", ".2e"), ("tis_capped", "share > TIS cap", ".2e")]
DRIFT_LABELS = {"bf16": "bf16 weights, bf16 autocast", "fp32": "fp32 weights", "fp32_autocast":
                "fp32 weights, bf16 autocast", "control": "fp32 weights (control)"}


def drift_table(out: dict) -> str:
    """bench/gpu_drift.py's JSON: one row per trainer scoring mode (the ``offpolicy/`` metrics)."""
    lines = ["| rollout | trainer scoring | tokens | " + " | ".join(c[1] for c in DRIFT_COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(DRIFT_COLUMNS)]
    for mode, r in out.get("rows", {}).items():
        cells = [format(r[f"offpolicy/{k}"], f) if f"offpolicy/{k}" in r else "-" for k, _, f in DRIFT_COLUMNS]
        lines.append(f"| {r['rollout']} | {DRIFT_LABELS.get(mode, mode)} | {r['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TRAIN_PHASES = ("rollout", "collate", "score", "advantages", "rollout_correction", "update", "sync", "log",
                "checkpoint")


def train_table(out: dict) -> str:
    """bench/gpu_train.py's JSON: one row per step (seconds per phase, tokens, generated tokens/s, peak memory)
    and a line of the run's totals."""
    lines = ["| step | episodes | searches | gen tokens | tool tokens | " + " | ".join(f"{n} s" for n in TRAIN_PHASES)
             + " | step s | gen tokens/s | peak GiB |", "|---" * (len(TRAIN_PHASES) + 8) + "|"]
    for i, s in enumerate(out.get("steps", []), 1):
        peak = max(s["peak_alloc_gib"].values()) if s.get("peak_alloc_gib") else "-"
        cells = [f"{s['phases'].get(n, 0.0):.2f}" for n in TRAIN_PHASES]
        lines.append(f"| {i} | {s.get('episodes', '-')} | {s.get('searches', '-')} | {s.get('gen_tokens', '-')} | "
                     f"{s.get('tool_tokens', '-')} | " + " | ".join(cells) + f" | {s.get('step_s', '-')} | "
                     f"{s.get('gen_tokens_per_s', '-')} | {peak} |")
    pol = out.get("policy", {})
    lines.append(f"\nPolicy: {pol.get('params', 0) / 1e9:.3f}B parameters, {pol.get('dtype', '-')}; setup (policy "
                 f"saved, index, server) {out.get('setup_s', '-')} s, `sleuth train` {out.get('train_s', '-')} s of "
                 f"which start-up {out.get('startup_s', '-')} s; peak allocated {out.get('peak_alloc_gib', '-')} GiB, "
                 f"reserved {out.get('peak_reserved_gib', '-')} GiB; checkpoint {out.get('checkpoint_gib', '-')} GiB.")
    return "\n".join(lines)


def faiss_line(out: dict) -> str:
    """bench/gpu_faiss.py's JSON as one sentence."""
    where = "GPU" if out.get("on_gpu") else "CPU (faiss sees no GPU: the fallback)"
    return (f"FAISS {out['faiss']} flat, {out['vectors']:,} x {out['dim']} random unit vectors, {out['queries']} "
            f"queries, top-{out['k']}: `use_gpu` searched on the {where} in {1e3 * out['gpu_search_s']:.1f} ms, the "
            f"CPU index in {1e3 * out['cpu_search_s']:.1f} ms; identical result rows {out['rows_identical']:.3f}, "
            f"top-1 agreement {out['top1_agree']:.3f}, top-{out['k']} overlap {out['topk_overlap']:.4f}, largest "
            f"score difference {out['score_max_abs_diff']:.1e}; top-1 as float64's: CPU {out['cpu_exact_top1']:.3f}, "
            f"GPU path {out['gpu_exact_top1']:.3f}.")


def tests_line(out: dict) -> str:
    return (f"`{out.get('command', 'pytest')}`: {out.get('passed', 0)} passed, {out.get('failed', 0)} failed, "
            f"{out.get('errors', 0)} errors, {out.get('skipped', 0)} skipped in {out.get('seconds', 0):.0f} s.")


def _section(part: dict | None, render) -> str:
    if not part or not part.get("result"):
        return f"(no result: {part.get('status', 'not run') if part else 'not run'})"
    try:
        return render(part["result"])
    except (KeyError, TypeError, ValueError) as e:  # a partial result (a part stopped midway)
        return f"(partial result, not tabulated: {type(e).__name__}: {e})"


def report(res: dict) -> str:
    """The whole check as markdown: header, parts' status, then the kernel, drift and training tables."""
    parts = res.get("parts", {})
    dry = " -- CPU dry run" if res.get("dry_run") else ""
    head = (f"GPU check, {res.get('date', '-')}, {res.get('gpu', '-')} (driver {res.get('driver', '-')}), torch "
            f"{res.get('torch', '-')}, commit {res.get('commit', '-')}{dry}. `{res.get('command', 'bench/gpu_check.sh')}`")
    lines = [head, "", "| part | status | budget s | timeout s | wall s | note |", "|---|---|---|---|---|---|"]
    for name, p in parts.items():
        lines.append(f"| {name} | {p['status']} | {p['budget_s']} | {p['timeout_s']} | {p.get('wall_s', '-')} | "
                     f"{p.get('message', '')} |")
    lines += ["", "**Kernel tests.** " + _section(parts.get("tests"), tests_line),
              "", "**Masked loss, fwd+bwd.**", "", _section(parts.get("kernels"), kernel_table),
              "", "**Rollout/trainer drift.**", "", _section(parts.get("drift"), drift_table),
              "", "**`sleuth train`, 3 steps.**", "", _section(parts.get("train"), train_table),
              "", _section(parts.get("faiss"), faiss_line)]
    return "\n".join(lines) + "\n"
