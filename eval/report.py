"""Reports over evaluation runs: the benchmarks x methods tables of search-agent papers, plots and JSON.

:func:`write_report` reads the ``summary.json`` of each ``<method>-<fingerprint>`` folder under the given run
directories (written by :func:`eval.run.run_benchmarks`) and writes to ``OUT``:

* ``report.md``: EM (benchmarks x methods, in percent, with the average over benchmarks as in Search-R1's
  Table 2, shown only for a method that has every benchmark of the table), F1 in a second table, cover-EM, supporting-paragraph recall where defined, and efficiency per
  method (mean search calls, turns, generated tokens, seconds per question); when some run was judged by an
  LLM (``sleuth eval --judge-model``), an LLM-judge accuracy table with the rate of unparseable verdicts;
* ``em_vs_search_calls.png``: mean EM against mean search calls per question, one point per method;
* ``em_by_hops.png``: EM by number of hops for the multi-hop benchmarks whose questions have hop counts;
* ``report.json``: the same numbers, machine-readable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eval.datasets import ALL, REGISTRY

ORDER = [*ALL, "sample"]
SCORE_TABLES = (("em", "EM"), ("f1", "F1"), ("cover_em", "cover-EM"), ("judge_acc", "LLM-judge accuracy"),
                ("recall", "Recall of supporting paragraphs"))
OPTIONAL_TABLES = ("judge_acc", "recall")  # shown only when some run has a value
EFFICIENCY = (("search_calls", "searches / q"), ("turns", "turns / q"), ("generated_tokens", "gen. tokens / q"),
              ("wall_s", "seconds / q"))


def find_summaries(run_dirs: list[str | Path]) -> list[dict[str, Any]]:
    """The run summaries under ``run_dirs`` (each either a ``<method>-<fingerprint>`` folder or a run directory
    holding such folders), in the order given. Raises ``FileNotFoundError`` naming a directory with none, and
    ``ValueError`` naming a summary that is not valid JSON."""
    out = []
    for d in map(Path, run_dirs):
        if not d.is_dir():
            raise FileNotFoundError(f"run directory not found: {d}")
        paths = [d / "summary.json"] if (d / "summary.json").exists() else sorted(d.glob("*/summary.json"))
        if not paths:
            raise FileNotFoundError(f"no evaluation summary under {d} (expected {d}/<method>-<fingerprint>/summary.json "
                                    "written by `sleuth eval --benchmarks`; `sleuth eval --qa` writes its table to "
                                    "<name>.md beside <name>.json instead)")
        for p in paths:
            if any(Path(x["_path"]).resolve() == p.resolve() for x in out):
                continue  # a run dir and one of its folders both given: each run once
            try:
                s = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not a valid evaluation summary ({e.msg} at line {e.lineno})") from None
            missing = [k for k in ("method", "fingerprint", "benchmarks") if not isinstance(s, dict) or k not in s]
            if missing or not isinstance(s["benchmarks"], dict):
                raise ValueError(f"{p}: not an evaluation summary written by `sleuth eval` (a JSON object with "
                                 f"'method', 'fingerprint' and a 'benchmarks' object; missing: {missing or ['benchmarks']})")
            s["_path"] = str(p)
            out.append(s)
    return out


def _labels(summaries: list[dict[str, Any]]) -> list[str]:
    """Column names: the method, with the fingerprint (and run dir) added where a method appears twice; the
    run dir's whole path where its name is not enough, so that every run has its own column."""
    methods = [s["method"] for s in summaries]
    labels = []
    for s in summaries:
        label = s["method"]
        if methods.count(s["method"]) > 1:
            label = f"{s['method']} ({Path(s['_path']).parent.parent.name}/{s['fingerprint'][:6]})"
        labels.append(label)
    for i, s in enumerate(summaries):
        if labels.count(labels[i]) > 1:  # same config in two run dirs of one name
            labels[i] = f"{s['method']} ({Path(s['_path']).parent.parent}/{s['fingerprint'][:6]})"
    return labels


def _bench_order(names: set[str]) -> list[str]:
    return [b for b in ORDER if b in names] + sorted(n for n in names if n not in ORDER)


def build_report(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Collect tables from summaries: ``{"methods", "benchmarks", "em": {bench: {method: value}}, "f1", ...,
    "average": {metric: {method: mean over the benchmarks some method has a value for; None for a method
    that lacks one of them}}, "efficiency": {method: {...}}, "by_hops":
    {bench: {method: {hops: em}}}, "same_questions": {bench: whether every run scored the same questions},
    "runs": [...]}`` (scores in [0, 1])."""
    labels = _labels(summaries)
    benches = _bench_order({b for s in summaries for b in s.get("benchmarks", {})})
    rep: dict[str, Any] = {"methods": labels, "benchmarks": benches, "average": {}, "efficiency": {}, "by_hops": {}}
    for key in (*(k for k, _ in SCORE_TABLES), "judge_unparseable"):
        rep[key] = {b: {lab: s["benchmarks"].get(b, {}).get(key) for lab, s in zip(labels, summaries)} for b in benches}
        rep["average"][key] = {}
        scored = [b for b in benches if any(v is not None for v in rep[key][b].values())]
        for lab in labels:
            vals = [rep[key][b][lab] for b in scored]
            # over the same benchmarks for every method: one that lacks some has no average
            rep["average"][key][lab] = sum(vals) / len(vals) if vals and None not in vals else None
    for lab, s in zip(labels, summaries):
        eff: dict[str, Any] = {}
        total = sum(m.get("n", 0) for m in s["benchmarks"].values())
        for key, _ in EFFICIENCY:
            pairs = [(m[key], m.get("n", 0)) for m in s["benchmarks"].values() if m.get(key) is not None]
            n = sum(w for _, w in pairs)
            eff[key] = sum(v * w for v, w in pairs) / n if n else None
        eff["n"] = total
        rep["efficiency"][lab] = eff
    for b in benches:
        spec = REGISTRY.get(b)
        hops = {lab: s["benchmarks"].get(b, {}).get("by_hops") or {} for lab, s in zip(labels, summaries)}
        multihop = spec.multihop if spec else any(s["benchmarks"].get(b, {}).get("multihop") for s in summaries)
        if multihop and any(hops.values()):
            rep["by_hops"][b] = {lab: {h: v["em"] for h, v in hp.items()} for lab, hp in hops.items()}
    rep["same_questions"] = {}  # False where the runs' question sets of a benchmark differ (limit, seed)
    for b in benches:
        sets = {tuple(m["question_ids"]) if m.get("question_ids") is not None else ("n", m.get("n"))
                for s in summaries if (m := s["benchmarks"].get(b))}
        rep["same_questions"][b] = len(sets) <= 1
    rep["runs"] = [
        {"method": s["method"], "fingerprint": s["fingerprint"], "summary": s["_path"],
         "benchmarks": {b: {k: v for k, v in m.items() if k != "question_ids"} for b, m in s["benchmarks"].items()}}
        for s in summaries
    ]
    return rep


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def to_markdown(rep: dict[str, Any]) -> str:
    """The report's tables as markdown."""
    methods = rep["methods"]
    parts = ["# Evaluation report", ""]
    ns = {}
    for b in rep["benchmarks"]:
        counts = sorted({r["benchmarks"][b].get("n", 0) for r in rep["runs"] if b in r["benchmarks"]})
        ns[b] = "/".join(map(str, counts)) + ("" if rep.get("same_questions", {}).get(b, True) else "*")
    for key, title in SCORE_TABLES:
        if key in OPTIONAL_TABLES and all(v is None for row in rep[key].values() for v in row.values()):
            continue
        parts += [f"## {title} (%)", "", "| benchmark | n | " + " | ".join(methods) + " |",
                  "|---|---:|" + "---:|" * len(methods)]
        for b in rep["benchmarks"]:
            parts.append(f"| {b} | {ns[b]} | " + " | ".join(_pct(rep[key][b][m]) for m in methods) + " |")
        parts.append("| **average** | | " + " | ".join(_pct(rep["average"][key][m]) for m in methods) + " |")
        if key == "judge_acc":
            parts.append("| *unparseable verdicts* | | "
                         + " | ".join(_pct(rep["average"]["judge_unparseable"][m]) for m in methods) + " |")
        parts.append("")
    parts += ["## Efficiency (mean per question)", "", "| method | questions | " + " | ".join(t for _, t in EFFICIENCY) + " |",
              "|---|---:|" + "---:|" * len(EFFICIENCY)]
    for m in methods:
        e = rep["efficiency"][m]
        parts.append(f"| {m} | {e['n']} | " + " | ".join("-" if e[k] is None else f"{e[k]:.2f}" for k, _ in EFFICIENCY) + " |")
    if not all(rep.get("same_questions", {}).values()):
        parts += ["", ("\\* the methods were scored on different questions of this benchmark (another --limit or "
                       "--seed): their numbers are not directly comparable.")]
    parts += ["", "Runs: " + "; ".join(f"{r['method']} `{r['fingerprint']}` ({r['summary']})" for r in rep["runs"]), ""]
    return "\n".join(parts)


def plot_em_vs_searches(rep: dict[str, Any], path: Path) -> None:
    """Scatter of average EM against mean search calls per question, one labelled point per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for m in rep["methods"]:
        x, y = rep["efficiency"][m]["search_calls"], rep["average"]["em"][m]
        if x is None or y is None:
            continue
        ax.scatter([x], [100 * y], s=60)
        ax.annotate(m, (x, 100 * y), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("mean search calls per question")
    ax.set_ylabel("EM (%), average over benchmarks")
    ax.set_title("EM vs. search calls")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_em_by_hops(rep: dict[str, Any], path: Path) -> bool:
    """Grouped bars of EM by hop count, one panel per multi-hop benchmark with hop counts. Returns whether
    there was anything to plot (nothing is written otherwise)."""
    if not rep["by_hops"]:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(rep["by_hops"])
    fig, axes = plt.subplots(1, len(benches), figsize=(4.5 * len(benches), 3.8), squeeze=False)
    methods = rep["methods"]
    width = 0.8 / max(len(methods), 1)
    for ax, b in zip(axes[0], benches):
        hops = sorted({int(h) for per in rep["by_hops"][b].values() for h in per})
        for j, m in enumerate(methods):
            per = rep["by_hops"][b].get(m, {})
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(hops))]
            # a method without EM for a hop count (not run there) gets no bar, not a bar at 0
            ys = [float("nan") if per.get(str(h)) is None else 100 * per[str(h)] for h in hops]
            ax.bar(xs, ys, width=width, label=m)
        ax.set_xticks(range(len(hops)), [f"{h} hops" for h in hops])
        ax.set_title(b)
        ax.set_ylabel("EM (%)")
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.0))  # all-zero bars would get a symmetric (negative) axis
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(run_dirs: list[str | Path], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and the PNG plots for ``run_dirs`` into ``out_dir``; returns the
    paths written. Raises ``FileNotFoundError`` for a run directory without summaries."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = build_report(find_summaries(run_dirs))
    paths = {"markdown": out / "report.md", "json": out / "report.json", "em_vs_search_calls": out / "em_vs_search_calls.png"}
    paths["markdown"].write_text(to_markdown(rep))
    paths["json"].write_text(json.dumps(rep, indent=1))
    plot_em_vs_searches(rep, paths["em_vs_search_calls"])
    if plot_em_by_hops(rep, out / "em_by_hops.png"):
        paths["em_by_hops"] = out / "em_by_hops.png"
    return paths


#: the columns of :func:`markdown_table`: summary key and header
COLUMNS = [("em", "EM"), ("f1", "F1"), ("cover_em", "cover-EM"), ("recall", "recall(sup)"),
           ("search_calls", "searches"), ("turns", "turns"), ("format_ok", "valid format")]


def markdown_table(rows: dict[str, dict[str, Any]], first: str = "policy") -> str:
    """A markdown table of named summaries (:func:`eval.run.evaluate_agent`'s), one row each: n, EM, F1,
    cover-EM, supporting-paragraph recall and valid format in percent, searches and turns per question."""
    head = f"| {first} | n | " + " | ".join(c for _, c in COLUMNS) + " |"
    sep = "|" + "---|" * (len(COLUMNS) + 2)
    lines = [head, sep]
    for name, s in rows.items():
        cells = []
        for key, _ in COLUMNS:
            v = s.get(key)
            pct = key in ("em", "f1", "cover_em", "recall", "format_ok")
            cells.append("-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.2f}"))
        lines.append(f"| {name} | {s.get('n', 0)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)





def format_summary(summary: dict[str, Any]) -> str:
    """A markdown table of one run's summary: one row per benchmark (LLM-judge accuracy and unparseable
    verdicts as two more columns when the run was judged)."""
    cols = [("em", "EM"), ("f1", "F1"), ("cover_em", "cover-EM"), ("recall", "recall"),
            ("search_calls", "searches"), ("turns", "turns"), ("generated_tokens", "gen. tokens"),
            ("wall_s", "s/question")]
    if any(m.get("judge_acc") is not None for m in summary.get("benchmarks", {}).values()):
        cols[3:3] = [("judge_acc", "LLM-judge"), ("judge_unparseable", "unparseable")]
    head = f"| {summary.get('method', '')} | n | " + " | ".join(c for _, c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for name, m in summary.get("benchmarks", {}).items():
        cells = [_fmt(m.get(k), k) for k, _ in cols]
        label = Path(name).name if "/" in name else name  # a QA file: its name
        lines.append(f"| {label} | {m.get('n', 0)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: Any, key: str) -> str:
    if v is None:
        return "-"
    if key in ("em", "f1", "cover_em", "recall", "judge_acc", "judge_unparseable"):
        return f"{100 * v:.1f}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def judge_line(summary: dict[str, Any], judge_model: str | None) -> str:
    """One line per QA file or benchmark of a judged run: the LLM-judge accuracy and the rate of unparseable
    verdicts (or that no answer reached the judge)."""
    lines = []
    for name, m in summary.get("benchmarks", {}).items():
        acc, bad = m.get("judge_acc"), m.get("judge_unparseable")
        lines.append(f"LLM-judge accuracy ({judge_model}) on {name}: " + ("-" if acc is None else f"{100 * acc:.1f}%")
                     + (" (no answer was sent to the judge)" if bad is None
                        else f" (unparseable verdicts: {100 * bad:.1f}%)"))
    return "\n".join(lines)


def failure_note(summary: dict[str, Any]) -> str | None:
    """The warning for questions whose episode ended on an error (a dead retrieval server): scored 0 like
    wrong answers, and computed again by the next run; ``None`` when there are none."""
    failed = {b: m for b, m in summary.get("benchmarks", {}).items() if m.get("errors")}
    if not failed:
        return None
    counts = ", ".join(f"{b}: {m['errors']} of {m.get('n', '?')}" for b, m in failed.items())
    first = next((m.get("first_error") for m in failed.values() if m.get("first_error")), None)
    return (f"warning: episodes stopped on an error and scored 0 ({counts}; 'error' in their prediction records"
            + (f"; the first: {first}" if first else "") + "); the next run of this command computes them again")
