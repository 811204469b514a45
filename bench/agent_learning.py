"""Your own agent learns: the shipped ReAct example (``examples/react_agent.py``, ``configs/react_agent.yaml``)
trained by its own run, three seeds.

Each seed is the example's whole run as a user starts it, ``sleuth train --config configs/react_agent.yaml
seed=S`` (through the CLI's ``main``): the tiny from-scratch policy, its SFT warm start on oracle episodes of
the agent itself (a scripted oracle behind the training proxy writes the tool calls in the agent's chat
template; tool results masked), then GRPO with the agent's episodes as rollouts. The task is the synthetic
multi-hop task v1 (:mod:`corpora.synthetic`, written once under the work directory, one BM25 index shared by
the seeds). The agent answers the held-out test questions greedily through the proxy, as ``sleuth eval``
runs it, three times: with the untrained tiny policy (before SFT), the SFT model (before RL) and the final
RL checkpoint (after RL). Reported per stage as mean ± sd over seeds: reward (the training reward: EM +
``agent.format_reward`` for a well-formed episode), EM, tool calls per question, EM per hop class; per seed
the EM of each stage and the training reward of the first and last steps; and the 95% paired bootstrap
interval of after RL - before RL (seeds and questions resampled, paired by seed and question).

    .venv/bin/python bench/agent_learning.py               # the three seeds (a finished seed is read back)
    .venv/bin/python bench/agent_learning.py --seeds 0     # one seed
    .venv/bin/python bench/agent_learning.py --report      # the table from the JSON only
    .venv/bin/python bench/agent_learning.py --set train.steps=10   # config overrides, for every seed

Writes ``bench/results/agent_learning.json`` and ``bench/results/agent_learning.md`` (``--results``); work
files under ``runs/agent_learning/`` (``--work``; an interrupted seed resumes from its last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIG = ROOT / "configs" / "react_agent.yaml"
SEEDS = (0, 1, 2)
STAGES = (("init", "untrained (before SFT)"), ("sft", "after SFT (before RL)"), ("rl", "after RL"))
FIRST_LAST = 5  # training steps averaged at each end of the reward curve


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def overrides(seed: int, work: Path, extra: list[str]) -> list[str]:
    """The example's config for ``seed``: its own run directory, the shared task data and index, then ``extra``."""
    data = work / "data"
    return [f"seed={seed}", f"out_dir={work / f's{seed}'}", f"retrieval.index_dir={work / 'index'}",
            *(f"data.{k}={data / f'{k}.jsonl'}" for k in ("corpus", "train", "test")), *extra]


def evaluate(cfg, model_path, retriever, test) -> dict:
    """Greedy episodes of the external agent on ``test`` with the policy at ``model_path``: per-question
    reward, EM, tool calls and hop class (``per_question``), their means, and EM and tool calls per hop class."""
    import eval.run as run_eval
    from agent.external.runner import runner_for
    from sleuth.pipeline import external_agent_env, load_llm

    external_agent_env(cfg)
    llm = load_llm(cfg, model_path)
    runner = runner_for(llm, cfg.agent)
    try:
        _, trajs = run_eval.evaluate_agent(llm, retriever, test, cfg.agent, top_k=cfg.retrieval.top_k,
                                           temperature=0.0, seed=cfg.seed, run_episodes=runner.loop_episodes)
    finally:
        runner.close()
    a = cfg.agent
    per = {"em": [t.verdict.get("em", 0.0) for t in trajs],
           "reward": [t.verdict.get(a.reward, 0.0) + a.format_reward * bool(t.verdict.get("format_ok")) for t in trajs],
           "searches": [float(t.num_search_calls) for t in trajs], "hops": [t.metadata.get("hops") for t in trajs]}
    out = {k: sum(v) / len(v) for k, v in per.items() if k != "hops"}
    for h in sorted({h for h in per["hops"] if h is not None}):
        idx = [i for i, x in enumerate(per["hops"]) if x == h]
        out[f"em_hops{h}"] = sum(per["em"][i] for i in idx) / len(idx)
        out[f"searches_hops{h}"] = sum(per["searches"][i] for i in idx) / len(idx)
    return {**out, "per_question": per}


def run_seed(seed: int, work: Path, extra: list[str]) -> dict:
    """The example's run for ``seed`` (resumed when interrupted), then the three evaluations."""
    from corpora import read_qa
    from corpora.synthetic import SPEC, write
    from sleuth.cli import main
    from sleuth.config import load_config
    from sleuth.pipeline import data_paths, held_out_questions, open_retriever, rl_run_dir
    from training.infra.checkpoint import latest_checkpoint

    if not (work / "data" / "test.jsonl").exists():
        write(work / "data", SPEC)
    over = overrides(seed, work, extra)
    cfg = load_config(CONFIG, over)
    t0, c0 = time.time(), time.process_time()
    resume = ["--resume"] if latest_checkpoint(rl_run_dir(cfg)) is not None else []
    if main(["train", "--config", str(CONFIG), *resume, *over]) != 0:
        raise RuntimeError(f"sleuth train failed for seed {seed}")
    train_s, train_cpu = time.time() - t0, time.process_time() - c0
    retriever = open_retriever(cfg)
    test = held_out_questions(cfg)
    if {q.id for q in test} & {q.id for q in read_qa(data_paths(cfg)["train"])}:
        raise RuntimeError("train and test questions overlap")
    models = {"init": Path(cfg.out_dir) / "tiny", "sft": Path(cfg.out_dir) / "sft",
              "rl": latest_checkpoint(rl_run_dir(cfg))}
    evals = {k: evaluate(cfg, m, retriever, test) for k, m in models.items()}
    steps = [json.loads(x) for x in (rl_run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in steps]
    return {"seed": seed, **evals, "steps": len(steps),
            "train_reward_first": statistics.mean(rewards[:FIRST_LAST]),
            "train_reward_last": statistics.mean(rewards[-FIRST_LAST:]),
            "train_search_calls_first": statistics.mean(r["search_calls"] for r in steps[:FIRST_LAST]),
            "train_search_calls_last": statistics.mean(r["search_calls"] for r in steps[-FIRST_LAST:]),
            "train_wall_s": train_s, "train_cpu_s": train_cpu, "wall_s": time.time() - t0,
            "cpu_s": time.process_time() - c0}


def paired_bootstrap(runs: list[dict], key: str, before: str = "sft", after: str = "rl", n: int = 2000,
                     seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)`` of ``after - before`` in per-question ``key`` over seeds and questions: the 95%
    percentile interval resamples seeds, and questions once per draw for every seed (paired by seed and
    question). Raises ``ValueError`` for no runs or runs of different question counts."""
    diffs = [[a - b for a, b in zip(r[after]["per_question"][key], r[before]["per_question"][key], strict=True)]
             for r in runs]
    if not diffs or len({len(d) for d in diffs}) != 1 or not diffs[0]:
        raise ValueError(f"need runs over the same non-empty questions, got {[len(d) for d in diffs]}")
    q = len(diffs[0])
    rng = random.Random(seed)
    draws = []
    for _ in range(n):
        idx = [rng.randrange(q) for _ in range(q)]
        pick = [diffs[rng.randrange(len(diffs))] for _ in diffs]
        draws.append(sum(d[i] for d in pick for i in idx) / (len(pick) * q))
    draws.sort()
    mean = sum(map(sum, diffs)) / (len(diffs) * q)
    return mean, draws[int(0.025 * n)], draws[min(int(0.975 * n), n - 1)]


def _ms(xs: list[float], fmt: str) -> str:
    """Mean ± sd of ``xs`` (the value alone for one)."""
    return f"{xs[0]:{fmt}}" if len(xs) < 2 else f"{statistics.mean(xs):{fmt}} ± {statistics.stdev(xs):{fmt}}"


def _ems(run: dict, sep: str = " / ") -> str:
    """The EM (%) of ``run`` at each stage, joined by ``sep``."""
    return sep.join(f"{100 * run[k]['em']:.1f}" for k, _ in STAGES)


def report(res: dict, results: Path) -> str:
    """The markdown tables (per stage, mean ± sd over seeds; per seed) and the paired intervals; printed and
    written to ``<results>/agent_learning.md``."""
    runs = [res["runs"][k] for k in sorted(res["runs"], key=int)]
    if not runs:
        return ""
    hops = sorted(int(k[len("em_hops"):]) for k in runs[0]["sft"] if k.startswith("em_hops"))
    n_q = len(runs[0]["sft"]["per_question"]["em"])
    head = ["policy", "reward", "EM", "tool calls / question", *(f"{h}-hop EM" for h in hops)]
    lines = [f"{n_q} held-out questions, {len(runs)} seed(s), mean ± sd over seeds", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, name in STAGES:
        cells = [_ms([r[key]["reward"] for r in runs], ".3f"), _ms([100 * r[key]["em"] for r in runs], ".1f"),
                 _ms([r[key]["searches"] for r in runs], ".2f"),
                 *(_ms([100 * r[key][f"em_hops{h}"] for r in runs], ".0f") for h in hops)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", (f"| seed | EM untrained / SFT / RL | tool calls SFT / RL | training reward, first / last "
                   f"{FIRST_LAST} steps | steps | minutes (CPU minutes) |"), "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['seed']} | {_ems(r)} | "
                     f"{r['sft']['searches']:.2f} / {r['rl']['searches']:.2f} | "
                     f"{r['train_reward_first']:.3f} / {r['train_reward_last']:.3f} | {r['steps']} | "
                     f"{r['wall_s'] / 60:.1f} ({r['cpu_s'] / 60:.1f}) |")
    lines.append("")
    for key, scale, fmt, unit in (("reward", 1.0, "+.3f", ""), ("em", 100.0, "+.1f", " EM points")):
        d, lo, hi = paired_bootstrap(runs, key)
        lines.append(f"- {key}, after RL - after SFT: {scale * d:{fmt}}{unit}, 95% paired bootstrap interval "
                     f"[{scale * lo:{fmt}}, {scale * hi:{fmt}}] (seeds and questions resampled)")
    md = "\n".join(lines) + "\n"
    print(md)
    results.mkdir(parents=True, exist_ok=True)
    (results / "agent_learning.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    from sleuth.commands.common import positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS), help="seeds to run (default 0 1 2)")
    ap.add_argument("--report", action="store_true", help="only print and write the tables from the JSON")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every seed (repeatable); runs of other overrides are not mixed")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "agent_learning", help="work directory")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="results directory")
    args = ap.parse_args(argv)
    path = args.results / "agent_learning.json"
    res = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    if not args.report:
        import torch

        if res["runs"] and res.get("overrides", []) != args.extra:
            raise SystemExit(f"{path} holds runs with overrides {res.get('overrides', [])}, not {args.extra}: "
                             "move it away (or give --results) to start over")
        torch.set_num_threads(args.threads)
        for seed in args.seeds:
            if str(seed) in res["runs"]:
                log(f"seed {seed}: done (EM {100 * res['runs'][str(seed)]['rl']['em']:.1f})")
                continue
            over = " ".join(overrides(seed, args.work, args.extra))
            log(f"seed {seed}: sleuth train --config configs/react_agent.yaml {over}")
            res["runs"][str(seed)] = r = run_seed(seed, args.work, args.extra)
            res["config"], res["overrides"] = CONFIG.read_text(), args.extra
            args.results.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res, indent=1))
            log(f"seed {seed}: EM {_ems(r, ' -> ')}, reward "
                f"{r['sft']['reward']:.3f} -> {r['rl']['reward']:.3f} ({r['wall_s'] / 60:.1f} min)")
    report(res, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
