"""Behaviour priming against plain SFT before the same RL, on the learning benchmark's synthetic task (v1).

Behaviour priming (Jin, Paladugu and Xiong, 2025, arXiv 2510.06534) warm-starts the policy on trajectories that
show information verification, adaptive search and error recovery, and compares with SFT on as many random or
merely correct trajectories. Here each SFT set is built by its registered builder (``sft.data`` ``primed``,
``random``, ``correct``: :mod:`training.sft_data`) from the same 60 training questions as
``bench/learning.py``'s warm start (a third per hop class), a pool of 8 primed-oracle trajectories per question.
A primed trajectory must show adaptive search and error recovery with a correct answer: authority evaluation
cannot show with one result per search, and information verification (a search after the answer is found)
rarely fits this task's 4 turns beside the others (in a pool of 120, 14 showed it and none with both others).
Of the pool of 480, 22 trajectories qualify, so each set holds ``N_SET`` = 20 (the plain warm start: 60). Each set trains the same tiny
policy with the same SFT recipe (``learning.SFT``), then GRPO runs ``learning.MID_BUDGET`` (60 steps) with the
comparison's settings. The plain-SFT row is ``bench/learning.py``'s own warm start (the scripted chain
oracle) and its ``grpo-mid`` runs. Reported: test EM (greedy, 90 questions) after SFT and after RL, searches
per hop class, the behaviours of each SFT set.

    .venv/bin/python bench/priming.py --seeds 0          # the three sets, seed 0
    .venv/bin/python bench/priming.py --report           # the table from the JSON only

Writes ``bench/results/priming.json``; work files under ``runs/learning/priming-*``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the root: bench/retrieval.py must not hide the retrieval package

JSON_PATH = ROOT / "bench" / "results" / "priming.json"
SETS = ("primed", "random", "correct")
REQUIRED = ("adaptive_search", "error_recovery")
N_SET = 20  # trajectories per SFT set: 22 of the pool of 480 qualify as primed; every set the same size


def build_sft(data: str, retriever, train) -> tuple[Path, dict]:
    """The SFT checkpoint of set ``data`` (built once) and the set's statistics."""
    import learning as L

    from agent.backends.hf import TransformersLLM
    from corpora import read_corpus
    from sleuth.config import SFTConfig
    from training.sft_data import SFTDataRequest, build_sft_data

    out = L.WORK / f"priming-{data}" / "sft"
    stats_path = out.parent / "sft_stats.json"
    if (out / "config.json").exists():
        return out, json.loads(stats_path.read_text())
    cfg = L.base_config()
    qs = L.sft_questions(train)
    titles = {p.id: p.title for p in read_corpus(L.WORK / "data" / "corpus.jsonl")}
    llm = TransformersLLM.from_pretrained(str(L.WORK / "tiny"))
    sft_cfg = SFTConfig(**L.SFT, data=data, data_options={"n": N_SET, "pool_factor": 8, "required": list(REQUIRED)})
    req = SFTDataRequest(qs, llm.tokenizer, retriever, cfg.agent, titles, L.RETRIEVAL_TOP_K, seed=0)
    trajs = build_sft_data(sft_cfg, req)
    L.train_sft(llm, trajs, out, sft_cfg)
    stats = {"n": len(trajs), "em": sum(t.verdict.get("em", 0.0) for t in trajs) / len(trajs),
             "searches": sum(t.num_search_calls for t in trajs) / len(trajs), **req.stats}
    stats_path.write_text(json.dumps(stats, indent=1))
    return out, stats


def run_set(data: str, seed: int, retriever, train, test, res: dict) -> None:
    """SFT set ``data`` (built once), its greedy test evaluation, ``MID_BUDGET`` GRPO steps of ``seed`` from it and
    the evaluation after: recorded in ``res["runs"]["<data>-s<seed>"]`` and written to the JSON."""
    import learning as L
    import torch

    from agent.backends.hf import load_model_and_tokenizer
    from training.trainer import rl_train

    sft_dir, stats = build_sft(data, retriever, train)
    model, tok = load_model_and_tokenizer(str(sft_dir), device="cpu")
    cfg = L.base_config(seed, "grpo", {**L.COMPARE, **L.MID_BUDGET})
    sft_ev = L.evaluate(model, tok, retriever, test, cfg)
    run_dir = sft_dir.parent / f"grpo-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    torch.manual_seed(seed)
    t0 = time.time()
    rl_train(cfg.train, cfg.agent, model, tok, retriever, train, run_dir, seed=cfg.seed, top_k=cfg.retrieval.top_k)
    rl_ev = L.evaluate(model, tok, retriever, test, cfg)
    res["runs"][f"{data}-s{seed}"] = {"data": data, "seed": seed, "sft_set": stats, "sft": sft_ev, "rl": rl_ev,
                                      "steps": cfg.train.steps, "wall_s": time.time() - t0}
    JSON_PATH.write_text(json.dumps(res, indent=1))
    L.log(f"{data}-s{seed}: test EM {100 * sft_ev['em']:.1f} (SFT) -> {100 * rl_ev['em']:.1f} (RL)")


def table(res: dict) -> str:
    """The markdown table of the runs, with ``bench/learning.py``'s plain warm start and its 60-step GRPO."""
    import learning as L

    plain = json.loads(L.JSON_PATH.read_text()) if L.JSON_PATH.exists() else {"runs": {}}
    hops = L.TASKS["v1"]["hops"]

    def cells(ev):
        return " | ".join(f"{100 * ev.get(f'em_hops{h}', 0):.0f} / {ev.get(f'search_hops{h}', 0):.2f}" for h in hops)

    lines = ["| SFT set | seed | SFT test EM | after 60 GRPO steps | " + " | ".join(f"{h}-hop EM / searches (RL)"
                                                                          for h in hops) + " |",
             "|---|---|---|---|" + "---|" * len(hops)]
    for s in sorted({r["seed"] for r in res["runs"].values()}):
        g = plain["runs"].get(f"grpo-mid-s{s}")
        if g and "sft" in plain:
            lines.append(f"| plain (scripted oracle) | {s} | {100 * plain['sft']['em']:.1f} | {100 * g['rl_em']:.1f} | "
                         f"{cells(g['final'])} |")
        for data in SETS:
            r = res["runs"].get(f"{data}-s{s}")
            if r:
                lines.append(f"| {data} | {s} | {100 * r['sft']['em']:.1f} | {100 * r['rl']['em']:.1f} | {cells(r['rl'])} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--report", action="store_true", help="only print the table of the JSON")
    args = ap.parse_args()
    import learning as L
    import torch

    L.use_task("v1")
    res = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {"runs": {}}
    if not args.report:
        torch.set_num_threads(1)
        retriever, train, test = L.prepare()
        for seed in args.seeds:
            for data in args.sets:
                if f"{data}-s{seed}" not in res["runs"]:
                    run_set(data, seed, retriever, train, test, res)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
