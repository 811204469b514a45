"""``sleuth report``: tables (benchmarks x methods), plots and JSON over evaluation runs."""

from __future__ import annotations

import argparse

HELP = "Report evaluation runs: EM/F1 tables (benchmarks x methods), EM-vs-searches and EM-by-hops plots, JSON."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories written by `sleuth eval --benchmarks` (or their <method>-<fingerprint> folders)")
    p.add_argument("--out", default="runs/report", help="output directory (default: runs/report)")


def run(args: argparse.Namespace) -> int:
    from eval.report import write_report

    paths = write_report(args.run_dirs, args.out)
    print(paths["markdown"].read_text())
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
