"""``sleuth dashboard RUN_DIR``: draw a training run's health metrics (metrics.jsonl) as one PNG."""

from __future__ import annotations

HELP = "draw a training run's health dashboard (reward, validity, degeneracy, searches, entropy, KL) as a PNG"


def add_arguments(p) -> None:
    p.add_argument("run_dir", help="a training run directory with metrics.jsonl (e.g. runs/quickstart/grpo)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/dashboard.png)")


def run(args) -> int:
    from training.infra.monitors import plot_dashboard

    print(plot_dashboard(args.run_dir, args.out))
    return 0
