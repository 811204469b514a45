"""``sleuth quickstart``: the main job on the shipped sample, end to end.

Index the sample corpus, build the tiny policy, SFT warm start, evaluate (before RL), GRPO, evaluate
(after RL); print the before/after table on the held-out test questions and write it under ``out_dir``.
Re-running it reuses the index, the tiny policy, the SFT model and the GRPO checkpoints (resuming an
interrupted GRPO run); the two evaluations run again. One at a time per ``out_dir``
(:func:`training.infra.checkpoint.run_dir_lock`; another training there is refused before anything is
written).
"""

from __future__ import annotations

from pathlib import Path

from sleuth.commands.common import add_config_arguments

HELP = "run the quickstart: index, SFT warm start, short GRPO run, evaluation before/after on test questions"
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def add_arguments(p) -> None:
    add_config_arguments(p)


def run(args) -> int:
    import time

    from sleuth.config import load_config
    from sleuth.pipeline import check_rollout_backend
    from training.infra.checkpoint import run_dir_lock

    t0 = time.time()
    cfg = load_config(args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None), args.overrides)
    check_rollout_backend(cfg)
    with run_dir_lock(cfg.out_dir):  # a second quickstart or training there is refused before it writes anything
        return _run(cfg, t0)


def _run(cfg, t0: float) -> int:
    import json
    import time

    import eval.run as run_eval
    from corpora import read_qa
    from eval.report import markdown_table
    from sleuth.pipeline import (
        data_paths,
        ensure_index,
        held_out_questions,
        load_llm,
        resolve_model_path,
        run_rl_stage,
        run_sft_stage,
        save_run_config,
        tiny_policy_path,
    )

    out = Path(cfg.out_dir)
    save_run_config(cfg)
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)
    retriever = ensure_index(cfg, log)  # opened once, for SFT, RL and both evaluations
    test = held_out_questions(cfg)  # the questions `sleuth eval` scores under the same config
    train_ids = {e.id for e in read_qa(data_paths(cfg)["train"])}
    for split, n in (("test", len(test)), ("train", len(train_ids))):  # before minutes of SFT and GRPO
        if not n:
            raise ValueError(f"data.{split}: {data_paths(cfg)[split]} holds no questions")
    if train_ids & {e.id for e in test}:
        raise ValueError("train and test questions overlap: the quickstart never trains on test questions")

    rows: dict[str, dict] = {}

    def evaluate(name: str, model_path) -> None:
        llm = load_llm(cfg, model_path)
        summary, trajs = run_eval.evaluate_agent(llm, retriever, test, cfg.agent, top_k=cfg.retrieval.top_k,
                                                 temperature=cfg.eval.temperature, seed=cfg.seed)
        run_eval.write_eval_outputs(out / "eval", name, summary, trajs)
        rows[name] = summary
        log(f"eval {name}: EM {summary['em']:.3f}  F1 {summary['f1']:.3f}  searches {summary['search_calls']:.2f}")

    init = resolve_model_path(cfg.policy.model or tiny_policy_path(cfg, log))
    sft = run_sft_stage(cfg, retriever, log) if cfg.sft.enabled else init
    evaluate("after SFT (before RL)" if cfg.sft.enabled else "initial policy", sft)
    final = run_rl_stage(cfg, sft, retriever, resume=True, log=log)
    evaluate("after GRPO", final)

    table = markdown_table(rows, first=f"{len(test)} test questions")
    result = {"table": rows, "final_checkpoint": str(final), "wall_s": time.time() - t0, "config": cfg.model_dump()}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "results.md").write_text(table + "\n")
    print("\n" + table + "\n")
    log(f"done: {out / 'results.json'}, {out / 'results.md'}; trajectories and metrics under {out}")
    return 0
