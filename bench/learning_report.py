"""Tables and curves of ``bench/learning.py``'s comparison of estimators (both task versions, seeds).

Per task and estimator: final greedy test EM (mean and standard deviation over seeds), its gain over the
SFT warm start, a 95% bootstrap interval of its difference to GRPO (questions and seeds resampled, paired by
question), EM and mean searches per hop class, the largest fall of test EM below the run's best so far
(collapse), and minutes per run. Writes ``learning_compare.md`` and ``learning_compare.png``.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path


def max_drop(curve: list[dict], start: float | None = None) -> float:
    """The largest fall of test EM below its best so far over a run's evaluations (0 when it never fell),
    counting the SFT score ``start`` as the first point when given."""
    best, drop = (start if start is not None else float("-inf")), 0.0
    for c in curve:
        best = max(best, c["em"])
        drop = max(drop, best - c["em"])
    return drop


def bootstrap_diff(runs: list[list[float]], base: list[list[float]], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of ``mean(runs) - mean(base)``: each a list over seeds of per-question EMs (same
    questions in the same order). Seeds are resampled on each side and questions once per draw for both
    sides (paired). Returns ``(low, high)``."""
    rng = random.Random(seed)
    q = len(runs[0])
    out = []
    for _ in range(n):
        idx = [rng.randrange(q) for _ in range(q)]
        a = [runs[rng.randrange(len(runs))] for _ in runs]
        b = [base[rng.randrange(len(base))] for _ in base]
        ma = sum(r[i] for r in a for i in idx) / (len(a) * q)
        mb = sum(r[i] for r in b for i in idx) / (len(b) * q)
        out.append(ma - mb)
    out.sort()
    return out[int(0.025 * n)], out[int(0.975 * n) - 1]


def _mean_sd(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{100 * xs[0]:.1f}"
    return f"{100 * statistics.mean(xs):.1f} ± {100 * statistics.stdev(xs):.1f}"


def _runs_of(res: dict, est: str) -> list[dict]:
    return [r for name, r in sorted(res["runs"].items())
            if name.rpartition("-")[0] == est and name.rpartition("-")[2][1:].isdigit() and "rl_em" in r]


def _with_long(res: dict, estimators) -> list[str]:
    """``estimators`` and, after them, each ``<estimator>-long``, ``-mid`` and ``-short`` that has runs (the
    longer, the middle and the shorter budget; GRPO's first among each budget's)."""
    out = list(estimators)
    for label in ("long", "mid", "short"):
        out += sorted({n.rpartition("-")[0] for n in res["runs"] if n.rpartition("-")[0].endswith(f"-{label}")},
                      key=lambda e, label=label: (e != f"grpo-{label}", e))
    return out


def _baseline(est: str) -> str:
    """The GRPO runs ``est`` is compared with: GRPO's at the same budget (``grpo-short`` for ``x-short``)."""
    for label in ("mid", "short"):
        if est.endswith(f"-{label}"):
            return f"grpo-{label}"
    return "grpo"


def task_table(task: str, res: dict, estimators: dict, hops: tuple[int, ...]) -> list[str]:
    """The markdown rows of one task's comparison (header included)."""
    sft = {**res["sft"], **res.get("sft_detail", {})}
    hop_hdr = " | ".join(f"{h}-hop EM / searches" for h in hops)
    lines = [f"### Task {task}", "",
             (f"| estimator | seeds | test EM (mean ± sd) | vs SFT | vs GRPO, 95% CI | {hop_hdr} | max fall below best | "
             "minutes |"), "|---|---|---|---|---|" + "---|" * len(hops) + "---|---|"]
    hop_cells = " | ".join(f"{100 * sft.get(f'em_hops{h}', 0):.0f} / {sft.get(f'search_hops{h}', float('nan')):.2f}"
                           for h in hops)
    lines.append(f"| SFT warm start | - | {100 * sft['em']:.1f} | - | - | {hop_cells} | - | - |")
    for est in _with_long(res, estimators):
        rs = _runs_of(res, est)
        if not rs:
            continue
        base_runs = _runs_of(res, _baseline(est))
        base = [r["final"]["per_question"] for r in base_runs if "per_question" in r["final"]]
        ems = [r["rl_em"] for r in rs]
        gain = statistics.mean(ems) - res["sft"]["em"]
        pq = [r["final"]["per_question"] for r in rs if "per_question" in r["final"]]
        ci = "-"
        if est != _baseline(est) and base and len(pq) == len(rs):
            lo, hi = bootstrap_diff(pq, base)
            diff = statistics.mean(ems) - statistics.mean(r["rl_em"] for r in base_runs)
            ci = f"{100 * diff:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
        cells = []
        for h in hops:
            em = [r["final"].get(f"em_hops{h}", 0.0) for r in rs]
            sc = [r["final"].get(f"search_hops{h}", float("nan")) for r in rs]
            cells.append(f"{100 * statistics.mean(em):.0f} / {statistics.mean(sc):.2f}")
        drop = max(max_drop(r["curve"], r["sft_em"]) for r in rs)
        minutes = statistics.mean(r["wall_s"] for r in rs) / 60
        label = f"{est.rpartition('-')[0]}, {rs[0]['steps']} steps" if est.endswith(("-long", "-mid", "-short")) else est
        lines.append(f"| {label} | {len(rs)} | {_mean_sd(ems)} | {100 * gain:+.1f} | {ci} | {' | '.join(cells)} | "
                     f"{100 * drop:.1f} | {minutes:.1f} |")
    return lines


def stability_rows(task: str, res: dict) -> list[str]:
    out = []
    for name, r in sorted(res["runs"].items()):
        if name.startswith("stability-") and r.get("curve"):
            c = r["curve"]
            best = max(p["em"] for p in c)
            out.append(f"| {task} | {name} | {r.get('steps', c[-1]['step'])} | {100 * r['sft_em']:.1f} | "
                       f"{100 * best:.1f} | {100 * c[-1]['em']:.1f} | {100 * max_drop(c):.1f} | "
                       f"{'done' if 'rl_em' in r else 'running'} |")
    return out


def compare_report(by_task: dict[str, dict], results: Path, estimators: dict, tasks: dict) -> str:
    """Write ``learning_compare.md`` and ``learning_compare.png`` from each task's results JSON; returns the
    markdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: list[str] = []
    stab: list[str] = []
    for task, res in by_task.items():
        if "sft" not in res:
            continue
        lines += task_table(task, res, estimators, tasks[task]["hops"]) + [""]
        stab += stability_rows(task, res)
    if stab:
        lines += ["### Stability runs", "", ("| task | run | steps | SFT EM | best test EM | last test EM | "
                  "max fall below best | state |"), "|---|---|---|---|---|---|---|---|", *stab, ""]
    md = "\n".join(lines)
    print(md)
    (results / "learning_compare.md").write_text(md)
    fig, axes = plt.subplots(1, len(by_task), figsize=(7 * len(by_task), 4.8), squeeze=False)
    for ax, (task, res) in zip(axes[0], by_task.items(), strict=True):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
        for est in _with_long(res, estimators):
            rs = [r for r in _runs_of(res, est) if r.get("curve")]
            if not rs:
                continue
            steps = sorted({c["step"] for r in rs for c in r["curve"]})
            mean = [statistics.mean(c["em"] for r in rs for c in r["curve"] if c["step"] == s) for s in steps]
            ax.plot([0, *steps], [100 * res["sft"]["em"], *(100 * m for m in mean)], label=f"{est} ({len(rs)})",
                    ls="-" if est in ("grpo", "gigpo", "igpo") or est.endswith("-long") else "--")
        for name, r in res["runs"].items():
            if name.startswith("stability-") and r.get("curve"):
                ax.plot([c["step"] for c in r["curve"]], [100 * c["em"] for c in r["curve"]], color="black",
                        lw=1, alpha=0.6, label=name)
        ax.set_xlabel("RL step")
        ax.set_ylabel("test EM (greedy, %), mean over seeds")
        ax.set_title(f"task {task}: estimators at the same budget")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(results / "learning_compare.png", dpi=100)
    plt.close(fig)
    return md
