"""``sleuth quickstart``: the main job, end to end, in two stages.

1. The shipped HotpotQA sample: index the sample corpus, build the tiny policy, SFT warm start, evaluate
   (before RL), GRPO, evaluate (after RL); the before/after table on the held-out test questions, written
   under ``out_dir`` (``results.md``, ``results.json``). It shows the whole path running on real data.
2. The synthetic multi-hop task (:mod:`corpora.synthetic`, task v1; ``configs/quickstart_synthetic.yaml``,
   under ``<out_dir>/synthetic``): its own tiny policy, an SFT warm start on chain-oracle trajectories, then
   the estimator that won ``bench/learning.py``'s comparison (evidence_igpo); EM and searches per hop class
   before and after RL on its held-out test questions. It shows RL learning. ``--skip-synthetic`` leaves it
   out; ``synthetic.KEY=VALUE`` overrides its config (``synthetic.train.steps=200``).

Each table comes with the EM difference and its 95% paired bootstrap interval over the questions. Re-running
reuses the indexes, the tiny policies, the SFT models and the RL checkpoints (resuming an interrupted run);
the evaluations run again. One at a time per ``out_dir`` (:func:`training.infra.checkpoint.run_dir_lock`;
another training there is refused before anything is written).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

from sleuth.commands.common import add_config_arguments

HELP = ("run the quickstart: HotpotQA sample (index, SFT, short GRPO run, evaluation before/after), then RL on a "
        "synthetic multi-hop task (EM and searches per hop class before/after)")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIGS / "quickstart.yaml"
SYNTHETIC_CONFIG = CONFIGS / "quickstart_synthetic.yaml"
PREFIX = "synthetic."  # overrides of the synthetic stage's config


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--synthetic-config", default=None,
                   help="the synthetic stage's YAML (default: configs/quickstart_synthetic.yaml); override its keys "
                        "with synthetic.KEY=VALUE")
    p.add_argument("--skip-synthetic", action="store_true", help="run the HotpotQA stages only")


def run(args) -> int:
    import time

    from sleuth.config import load_config
    from sleuth.pipeline import check_rollout_backend
    from training.infra.checkpoint import run_dir_lock

    t0 = time.time()
    overrides = list(args.overrides or [])
    cfg = load_config(args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None),
                      [o for o in overrides if not o.startswith(PREFIX)])
    syn = None
    if not args.skip_synthetic:  # validated before minutes of the first stage
        syn = synthetic_config(cfg, args.synthetic_config or SYNTHETIC_CONFIG,
                               [o[len(PREFIX):] for o in overrides if o.startswith(PREFIX)])
        check_rollout_backend(syn)
    check_rollout_backend(cfg)
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)
    with contextlib.ExitStack() as held:  # a second quickstart or training there is refused before it writes
        held.enter_context(one_torch_thread())
        held.enter_context(run_dir_lock(cfg.out_dir))
        if syn is not None:
            held.enter_context(run_dir_lock(syn.out_dir))
        parts = [run_hotpotqa(cfg, log, t0)]
        if syn is not None:
            parts.append(run_synthetic(syn, log))
    print()
    for title, table, proves in parts:
        print(f"{title}\n\n{table}\n\n{proves}\n")
    log("done: " + ", ".join(str(Path(c) / "results.md") for c in [cfg.out_dir, *([syn.out_dir] if syn else [])]))
    return 0


def synthetic_config(cfg, path, overrides: list[str]):
    """The synthetic stage's config: ``path`` with ``overrides``; ``out_dir`` defaults to ``<cfg.out_dir>/synthetic``,
    and unless set, ``data`` to task v1 written under ``<out_dir>/data`` and ``retrieval.index_dir`` to
    ``<out_dir>/index``. Raises :class:`sleuth.config.ConfigError` naming a bad key."""
    from sleuth.config import load_config

    first = load_config(path, [f"out_dir={Path(cfg.out_dir) / 'synthetic'}", *overrides])
    out = Path(first.out_dir)
    fill = [f"out_dir={out}"]
    if first.data.corpus is None and first.data.train is None and first.data.test is None:
        fill += [f"data.{k}={out / 'data' / f'{k}.jsonl'}" for k in ("corpus", "train", "test")]
    if "index_dir" not in first.retrieval.model_fields_set:
        fill.append(f"retrieval.index_dir={out / 'index'}")
    return load_config(path, [*fill, *overrides])


def _check_splits(cfg, test) -> None:
    """Refuse (``ValueError``) an empty split, or train and test questions that overlap."""
    from corpora import read_qa
    from sleuth.pipeline import data_paths

    train_ids = {e.id for e in read_qa(data_paths(cfg)["train"])}
    for split, n in (("test", len(test)), ("train", len(train_ids))):  # before minutes of SFT and RL
        if not n:
            raise ValueError(f"data.{split}: {data_paths(cfg)[split]} holds no questions")
    if train_ids & {e.id for e in test}:
        raise ValueError("train and test questions overlap: the quickstart never trains on test questions")


def _evaluate(cfg, retriever, test, name: str, model_path, log):
    """Greedy evaluation of ``model_path`` on ``test``: ``(summary, trajectories)``, written under ``out_dir/eval``."""
    import eval.run as run_eval
    from sleuth.pipeline import load_llm

    llm = load_llm(cfg, model_path)
    summary, trajs = run_eval.evaluate_agent(llm, retriever, test, cfg.agent, top_k=cfg.retrieval.top_k,
                                             temperature=cfg.eval.temperature, seed=cfg.seed)
    run_eval.write_eval_outputs(Path(cfg.out_dir) / "eval", name, summary, trajs)
    log(f"eval {name}: EM {summary['em']:.3f}  F1 {summary['f1']:.3f}  searches {summary['search_calls']:.2f}")
    return summary, trajs


def paired_interval(before: list[float], after: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``(mean difference, low, high)`` of ``after - before`` (per-question scores in the same order), with the
    95% percentile bootstrap interval over questions (``n_boot`` resamples, seeded). Raises ``ValueError``
    for lists of different or zero length."""
    if len(before) != len(after) or not before:
        raise ValueError(f"need two equally long non-empty score lists, got {len(before)} and {len(after)}")
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    rng, n = random.Random(seed), len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(n_boot))
    return sum(diffs) / n, means[int(0.025 * n_boot)], means[min(int(0.975 * n_boot), n_boot - 1)]


def _em_change(before, after) -> str:
    d, lo, hi = paired_interval([t.verdict.get("em", 0.0) for t in before], [t.verdict.get("em", 0.0) for t in after])
    return f"{100 * d:+.1f} EM points (95% paired bootstrap interval over questions [{100 * lo:+.1f}, {100 * hi:+.1f}])"


def run_hotpotqa(cfg, log, t0: float) -> tuple[str, str, str]:
    """Stage 1 (the shipped HotpotQA sample, or ``data.*``); returns ``(title, markdown table, what it proves)``
    and writes ``results.md`` / ``results.json`` under ``out_dir``."""
    import json
    import time

    from eval.report import markdown_table
    from sleuth.pipeline import (
        ensure_index,
        held_out_questions,
        resolve_model_path,
        run_rl_stage,
        run_sft_stage,
        save_run_config,
        tiny_policy_path,
    )

    out = Path(cfg.out_dir)
    save_run_config(cfg)
    retriever = ensure_index(cfg, log)  # opened once, for SFT, RL and both evaluations
    test = held_out_questions(cfg)  # the questions `sleuth eval` scores under the same config
    _check_splits(cfg, test)
    init = resolve_model_path(cfg.policy.model or tiny_policy_path(cfg, log))
    sft = run_sft_stage(cfg, retriever, log) if cfg.sft.enabled else init
    first = "after SFT (before RL)" if cfg.sft.enabled else "initial policy"
    rows, trajs = {}, {}
    rows[first], trajs[first] = _evaluate(cfg, retriever, test, first, sft, log)
    final = run_rl_stage(cfg, sft, retriever, resume=True, log=log)
    est = cfg.train.algorithm.adv_estimator
    last = f"after {est.upper() if est == 'grpo' else est}"
    rows[last], trajs[last] = _evaluate(cfg, retriever, test, last, final, log)
    table = markdown_table(rows, first=f"{len(test)} test questions")
    change = _em_change(trajs[first], trajs[last])
    result = {"table": rows, "em_change": change, "final_checkpoint": str(final), "wall_s": time.time() - t0,
              "config": cfg.model_dump()}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "results.md").write_text(table + "\n")
    title = (f"HotpotQA sample ({len(test)} held-out questions), the tiny policy: SFT, then {cfg.train.steps} "
             f"{cfg.train.algorithm.adv_estimator} steps")
    proves = (f"What it proves: the whole path runs on real data (index, SFT warm start, multi-turn RL with the "
              f"tool-token loss mask, evaluation). RL moved EM by {change}: a model this small, with no world "
              f"knowledge, does not learn HotpotQA in {cfg.train.steps} steps; the synthetic table shows the learning.")
    return title, table, proves


def synthetic_data(cfg, log) -> None:
    """Write task v1 of :mod:`corpora.synthetic` under ``<out_dir>/data`` when ``data.*`` point there and a file
    is missing (the default of :func:`synthetic_config`); data elsewhere is used as it is."""
    from corpora.synthetic import SPEC, write
    from sleuth.pipeline import data_paths

    here = Path(cfg.out_dir) / "data"
    paths = data_paths(cfg)
    if all(p == here / f"{k}.jsonl" for k, p in paths.items()) and not all(p.exists() for p in paths.values()):
        log(f"writing the synthetic multi-hop task (corpora/synthetic.py, task v1) to {here}")
        write(here, SPEC)


def hop_table(before, after) -> tuple[str, dict]:
    """The markdown table of EM (%) and searches per question by hop class, before and after RL (each a list of
    judged trajectories with ``metadata["hops"]``, one per question), and its numbers as a dict."""
    classes = sorted({t.metadata.get("hops") for t in before if t.metadata.get("hops") is not None})
    lines = ["| hop class | n | EM after SFT | EM after RL | searches after SFT | searches after RL |",
             "|---|---|---|---|---|---|"]
    numbers = {}
    for h in [*classes, None]:
        b = [t for t in before if h is None or t.metadata.get("hops") == h]
        a = [t for t in after if h is None or t.metadata.get("hops") == h]
        row = {"n": len(b), "em_sft": sum(t.verdict.get("em", 0.0) for t in b) / len(b),
               "em_rl": sum(t.verdict.get("em", 0.0) for t in a) / len(a),
               "searches_sft": sum(t.num_search_calls for t in b) / len(b),
               "searches_rl": sum(t.num_search_calls for t in a) / len(a)}
        numbers["all" if h is None else f"{h}-hop"] = row
        lines.append(f"| {'all' if h is None else f'{h}-hop'} | {row['n']} | {100 * row['em_sft']:.1f} | "
                     f"{100 * row['em_rl']:.1f} | {row['searches_sft']:.2f} | {row['searches_rl']:.2f} |")
    return "\n".join(lines), numbers


@contextlib.contextmanager
def one_torch_thread():
    """Run the block with one torch CPU thread (the previous count restored after it). Both policies are tiny
    (two layers of 96 and 64 hidden units), too small to gain much from a second thread, and on a machine
    shared with other jobs OpenMP threads that wait for a busy core slow every step two to three times over."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_synthetic(cfg, log) -> tuple[str, str, str]:
    """Stage 2 (the synthetic multi-hop task); returns ``(title, markdown table, what it proves)`` and writes
    ``results.md`` / ``results.json`` under its ``out_dir``."""
    import json
    import time

    from sleuth.pipeline import ensure_index, held_out_questions, run_rl_stage, run_sft_stage, save_run_config

    t0 = time.time()
    cpu0 = time.process_time()
    out = Path(cfg.out_dir)
    save_run_config(cfg)
    synthetic_data(cfg, log)
    retriever = ensure_index(cfg, log)
    test = held_out_questions(cfg)
    _check_splits(cfg, test)
    sft = run_sft_stage(cfg, retriever, log)  # builds the task's own tiny policy first
    _, before = _evaluate(cfg, retriever, test, "after SFT (before RL)", sft, log)
    final = run_rl_stage(cfg, sft, retriever, resume=True, log=log)
    _, after = _evaluate(cfg, retriever, test, f"after {cfg.train.algorithm.adv_estimator}", final, log)
    table, numbers = hop_table(before, after)
    change = _em_change(before, after)
    result = {"by_hops": numbers, "em_change": change, "final_checkpoint": str(final),
              "wall_s": time.time() - t0, "cpu_s": time.process_time() - cpu0, "config": cfg.model_dump()}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "results.md").write_text(table + "\n")
    by = {k: f"{v['searches_rl']:.2f}" for k, v in numbers.items() if k != "all"}
    title = (f"Synthetic multi-hop task ({len(test)} held-out questions, invented entities), its own tiny policy: "
             f"SFT, then {cfg.train.steps} {cfg.train.algorithm.adv_estimator} steps")
    proves = (f"What it proves: RL works. It raised EM by {change} on questions never trained on, and the policy "
              f"searches as often as each question needs ({' / '.join(by.values())} "
              f"searches for {' / '.join(by)} questions).")
    return title, table, proves
