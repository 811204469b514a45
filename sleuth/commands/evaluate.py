"""``sleuth eval``: run a method (the agent by default) on a QA file or on the benchmarks and report EM / F1 /
cover-EM, and with ``--judge-model`` (or ``eval.judge_model``) LLM-as-judge accuracy. One path for both:
:func:`eval.run.run_benchmarks` (a resumable prediction cache, a summary per run)."""

from __future__ import annotations

from sleuth.commands.common import (
    MODEL_HELP,
    add_config_arguments,
    config_from_args,
    model_config,
    positive_int,
)

HELP = "evaluate a method on a QA file or the benchmarks: EM, F1, cover-EM, searches, turns, supporting recall"


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--qa", help="QA file in any format the benchmarks ship in (default: data.test, else the shipped "
                   "sample's test questions)")
    p.add_argument("--index", help="index directory (default: retrieval.index_dir)")
    p.add_argument("--model", help=MODEL_HELP)
    from eval.methods import EVAL_METHODS

    p.add_argument("--method", default="agent", help=f"the evaluation method: {EVAL_METHODS.help('agent')}")
    p.add_argument("--judge-model", help="LLM-as-judge model directory or hub id, loaded like --model, or 'none' "
                   "for no judge (default: eval.judge_model, else no judge); policy: eval.judge_unparseable")
    p.add_argument("--benchmarks", help="comma-separated benchmark names or 'all' (see eval.datasets)")
    p.add_argument("--limit", type=positive_int,
                   help="evaluate at most this many questions (seeded sub-sample; default: eval.limit, else all)")
    p.add_argument("--seed", type=int, help="seed of the --limit sub-sample (default: the config's seed)")
    p.add_argument("--data-dir", help="root of the benchmark files (default: $SLEUTH_DATA_DIR, else the folder "
                   "`sleuth data get` fills: sleuth/data under the user's cache directory)")
    p.add_argument("--out", help="output directory (default: <out_dir>/eval)")


def run(args) -> int:
    from pathlib import Path

    import eval.run as run_eval
    from eval.methods import get_method
    from eval.report import failure_note, format_summary, judge_line
    from sleuth.pipeline import data_paths, load_llm, open_retriever, other_model_config

    cfg = model_config(config_from_args(args), args.model)  # the model's trained settings, or the untrained note
    if args.qa and args.benchmarks:
        raise ValueError("--qa and --benchmarks exclude each other: the benchmarks read their own files "
                         "(--data-dir); give one of them")
    limit = args.limit if args.limit is not None else cfg.eval.limit
    seed = args.seed if args.seed is not None else cfg.seed
    out = Path(args.out or Path(cfg.out_dir) / "eval")
    targets = args.benchmarks.split(",") if args.benchmarks else [str(args.qa or data_paths(cfg)["test"])]
    # names, method and questions first: a typo should not wait for the index and the model
    run_eval.check_targets(targets, args.method, args.data_dir, limit, seed)
    method = get_method(args.method)
    # first: a missing index is the commonest mistake; direct inference retrieves nothing and needs none
    retriever = open_retriever(cfg, args.index) if method.retrieves else None
    llm = load_llm(cfg, args.model)
    judge_model = args.judge_model or cfg.eval.judge_model
    if judge_model and judge_model.strip().lower() == "none":  # --judge-model none turns a configured judge off
        judge_model = None
    judge_llm = None
    if judge_model:  # the policy judging itself reuses the loaded backend
        judge_llm = llm if judge_model == (args.model or cfg.policy.model) else load_llm(
            other_model_config(cfg), judge_model, episodes=False)  # a judge reads one answer, not an episode
    external = None
    if method.episodes and cfg.agent.kind == "external":  # its episodes over a proxy of the policy
        from agent.external.runner import runner_for
        from sleuth.pipeline import external_agent_env

        external_agent_env(cfg, args.index)
        external = runner_for(llm, cfg.agent)
    try:
        result = run_eval.run_benchmarks(
            targets, args.method, limit, seed, out, llm, retriever, cfg.agent, args.data_dir,
            top_k=cfg.retrieval.top_k, temperature=cfg.eval.temperature, index_dir=args.index or cfg.retrieval.index_dir,
            model_dir=args.model or cfg.policy.model or str(Path(cfg.out_dir) / "tiny"), judge_llm=judge_llm,
            judge_options={"unparseable": cfg.eval.judge_unparseable} if judge_llm else None,
            judge_model_dir=judge_model, keep_trajectories=method.episodes,
            **({"run_episodes": external.loop_episodes} if external is not None else {}))
    finally:
        if external is not None:
            external.close()
    print(format_summary(result))
    if judge_llm is not None:
        print("\n" + judge_line(result, judge_model))
    note = failure_note(result)
    if note:  # scored 0 like wrong answers: say so, or a dead retrieval server reads as a bad model
        print("\n" + note)
    print(f"\nwrote {Path(result['run_dir']) / run_eval.SUMMARY} (all metrics) and the predictions beside it")
    return 0
