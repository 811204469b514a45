"""Rebuild the example report in ``eval/example/``: the five methods on the shipped HotpotQA sample.

Steps (CPU, a few minutes on 2 cores): BM25 index of ``corpora/sample/corpus.jsonl``; the tiny policy
(BPE tokenizer + tiny Qwen2 from seed 0, :mod:`training.model.tiny`) warm-started by SFT on oracle
trajectories of the *train* questions (:mod:`training.sft`); then ``direct``, ``rag``, ``ircot``,
``search_o1`` and ``agent`` on the 100 *test* questions through :func:`eval.run.run_benchmarks`, and
:func:`eval.report.write_report` into ``eval/example/``. Work files go to ``runs/eval_example`` (re-running reuses
the index, the model and every cached prediction). Agent, policy and SFT settings come from ``--config``
(default ``configs/quickstart.yaml``: a checkpoint is only fair to evaluate in the prompt format it was
trained on). The committed report evaluates the quickstart's RL checkpoint (``sleuth quickstart`` first):
``--model runs/quickstart/grpo/checkpoints/step_000008``.

    .venv/bin/python examples/make_eval_report.py [--work runs/eval_example] [--epochs 6] [--limit 100]
        [--config YAML] [--model CHECKPOINT_DIR]   # skip the SFT and evaluate an existing checkpoint
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "eval" / "example"
QUICKSTART_CONFIG = ROOT / "configs" / "quickstart.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/eval_example")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--methods", default="direct,rag,ircot,search_o1,agent")
    p.add_argument("--model", default=None, help="evaluate this checkpoint (e.g. the quickstart's) instead of building one")
    p.add_argument("--config", default=str(QUICKSTART_CONFIG),
                   help="the config whose agent, policy and SFT settings to use (default: the quickstart's, so its "
                        "checkpoint is evaluated with the prompt format it was trained on)")
    args = p.parse_args(argv)

    import torch

    from agent.backends.hf import TransformersLLM, load_model_and_tokenizer
    from corpora.formats import read_corpus
    from corpora.qa import read_qa
    from corpora.sample import sample_paths
    from eval.report import format_summary, write_report
    from eval.run import run_benchmarks
    from retrieval.index import build_index, load_retriever
    from sleuth.config import load_config
    from training.model.tiny import create_tiny_policy
    from training.sft import oracle_trajectories, sft_train

    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = load_config(args.config)
    work = Path(args.work)
    paths = sample_paths()
    index_dir = work / "index"
    if not (index_dir / "manifest.json").exists():
        build_index(paths["corpus"], index_dir, build_dense=False)
    retriever = load_retriever(index_dir, "bm25")

    model_dir = Path(args.model) if args.model else work / "policy"
    if not (model_dir / "config.json").exists():
        passages = read_corpus(paths["corpus"])
        train = read_qa(paths["train"])
        tmp = create_tiny_policy(work / "policy_init", passages, train, cfg.policy.tiny, seed=cfg.seed)
        model, tok = load_model_and_tokenizer(str(tmp), device="cpu")
        titles = {q.id: q.title for q in passages}
        trajs = oracle_trajectories(train, tok, retriever, cfg.agent, titles, cfg.retrieval.top_k)
        hist = sft_train(model, tok, trajs, cfg.sft.model_copy(update={"epochs": args.epochs}), seed=cfg.seed)
        print("SFT:", json.dumps(hist[-1]))
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    llm = TransformersLLM.from_pretrained(str(model_dir), device="cpu")

    run_dir = work / "run"
    for method in args.methods.split(","):
        s = run_benchmarks(["sample"], method, args.limit, 0, run_dir, llm, retriever, cfg.agent,
                           top_k=cfg.retrieval.top_k, temperature=0.0, index_dir=index_dir, model_dir=model_dir,
                           batch_size=25)
        print(format_summary(s))
    written = write_report([run_dir], HERE)
    print(written["markdown"].read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
