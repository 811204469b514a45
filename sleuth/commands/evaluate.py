"""``sleuth eval``: run the agent on a QA file (or a method on the benchmarks) and report EM / F1 / cover-EM,
and with ``--judge-model`` (or ``eval.judge_model``) LLM-as-judge accuracy."""

from __future__ import annotations

from sleuth.commands._common import add_config_arguments, config_from_args, positive_int

HELP = "evaluate the agent on a QA file: EM, F1, cover-EM, searches, turns, supporting-paragraph recall"


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--qa", help="QA JSONL file, FlashRAG format (default: data.test, else the shipped sample's "
                   "test questions)")
    p.add_argument("--index", help="index directory (default: retrieval.index_dir)")
    p.add_argument("--model", help="model directory (a checkpoint, or its checkpoints/latest) or hub id (default: policy.model, else the untrained tiny policy)")
    p.add_argument("--method", default="agent",
                   help="agent (default), or with --benchmarks: direct, rag, ircot, search_o1")
    p.add_argument("--judge-model", help="LLM-as-judge model directory or hub id, loaded like --model, or 'none' "
                   "for no judge (default: eval.judge_model, else no judge); policy: eval.judge_unparseable")
    p.add_argument("--benchmarks", help="comma-separated benchmark names or 'all' (see eval.datasets)")
    p.add_argument("--limit", type=positive_int,
                   help="evaluate at most this many questions (seeded sub-sample; default: eval.limit, else all)")
    p.add_argument("--seed", type=int, help="seed of the --limit sub-sample (default: the config's seed)")
    p.add_argument("--data-dir", help="root of the benchmark files (default: $SLEUTH_DATA_DIR, else ../shared/data "
                   "beside the project)")
    p.add_argument("--out", help="output directory (default: <out_dir>/eval)")


def run(args) -> int:
    from pathlib import Path

    from corpora import read_qa
    from sleuth.pipeline import (
        data_paths,
        evaluate_agent,
        load_llm,
        markdown_table,
        open_retriever,
        other_model_config,
        write_eval_outputs,
    )

    cfg = config_from_args(args)
    if args.qa and args.benchmarks:
        raise ValueError("--qa and --benchmarks exclude each other: the benchmarks read their own files "
                         "(--data-dir); give one of them")
    limit = args.limit if args.limit is not None else cfg.eval.limit
    seed = args.seed if args.seed is not None else cfg.seed
    out = Path(args.out or Path(cfg.out_dir) / "eval")
    qa = Path(args.qa) if args.qa else data_paths(cfg)["test"]
    # names, method and questions first: a typo should not wait for the index and the model
    if args.benchmarks:
        _check_benchmarks(args.benchmarks, args.method, args.data_dir, limit, seed)
    else:
        if args.method != "agent":
            raise ValueError("--method other than 'agent' needs --benchmarks")
        examples = read_qa(qa)
        if limit is not None:
            from eval.datasets import subsample

            examples = subsample(examples, limit, seed)
    # first: a missing index is the commonest mistake; direct inference retrieves nothing and needs none
    retriever = None if args.benchmarks and args.method == "direct" else open_retriever(cfg, args.index)
    llm = load_llm(cfg, args.model)
    judge_model = args.judge_model or cfg.eval.judge_model
    if judge_model and judge_model.strip().lower() == "none":  # --judge-model none turns a configured judge off
        judge_model = None
    judge_llm = None
    if judge_model:  # the policy judging itself reuses the loaded backend
        judge_llm = llm if judge_model == (args.model or cfg.policy.model) else load_llm(
            other_model_config(cfg), judge_model, episodes=False)  # a judge reads one answer, not an episode
    judge_options = {"unparseable": cfg.eval.judge_unparseable}
    if args.benchmarks:
        from eval.run import SUMMARY, format_summary, run_benchmarks

        result = run_benchmarks(args.benchmarks.split(","), args.method, limit, seed, out, llm,
                                retriever, cfg.agent, args.data_dir, top_k=cfg.retrieval.top_k,
                                temperature=cfg.eval.temperature,
                                index_dir=args.index or cfg.retrieval.index_dir,
                                model_dir=args.model or cfg.policy.model or str(Path(cfg.out_dir) / "tiny"),
                                judge_llm=judge_llm, judge_options=judge_options if judge_llm else None,
                                judge_model_dir=judge_model)
        print(format_summary(result))
        failed = {b: m["errors"] for b, m in result["benchmarks"].items() if m.get("errors")}
        if failed:  # scored 0 like wrong answers: say so, or a dead retrieval server reads as a bad model
            print(f"\nwarning: episodes stopped on an error and scored 0 ({', '.join(f'{b}: {n}' for b, n in failed.items())}; "
                  "'error' in their prediction records); the next run of this command computes them again")
        print(f"\nwrote {Path(result['run_dir']) / SUMMARY} (all metrics) and the predictions beside it")
        return 0
    summary, trajs = evaluate_agent(llm, retriever, examples, cfg)
    if judge_llm is not None:
        from eval.methods import trajectory_record
        from eval.metrics import aggregate
        from eval.run import judge_records

        records = judge_records([trajectory_record(t) for t in trajs], judge_llm, **judge_options)
        judged = aggregate(records, by_hops=False)
        summary.update({k: judged[k] for k in ("judge_acc", "n_judged", "judge_unparseable")}, judge_model=judge_model)
    summary.update(qa=str(qa), model=str(args.model or cfg.policy.model or "tiny"))
    name = Path(qa).stem
    write_eval_outputs(out, name, summary, trajs)
    table = markdown_table({summary["model"]: summary})
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    if judge_llm is not None:
        acc, bad = summary.get("judge_acc"), summary.get("judge_unparseable")
        print(f"\nLLM-judge accuracy ({judge_model}): " + ("-" if acc is None else f"{100 * acc:.1f}%")
              + (" (no answer was sent to the judge)" if bad is None else f" (unparseable verdicts: {100 * bad:.1f}%)"))
    failed = [t for t in trajs if t.stop_reason == "error"]
    if failed:  # scored 0 like wrong answers: say so, or a dead retrieval server reads as a bad model
        print(f"\nwarning: {len(failed)} of {len(trajs)} episodes stopped on an error and scored 0 "
              f"(metadata.error in the trajectories); the first: {failed[0].metadata.get('error')}")
    print(f"\nwrote {out / (name + '.json')}, {out / (name + '.md')} and the trajectories")
    return 0


def _check_benchmarks(benchmarks: str, method: str, data_dir: str | None, limit: int | None, seed: int) -> None:
    """Raise the error ``run_benchmarks`` would, before the index and the model are loaded: an unknown
    benchmark or method (``ValueError`` listing the known ones), a missing benchmark file
    (``FileNotFoundError``) or a malformed question (``DataFormatError`` naming file, line and field; every
    file is read, which takes well under a second for the seven benchmarks)."""
    from eval.datasets import expand_benchmarks, load_benchmark, locate_benchmark
    from eval.methods import get_method

    get_method(method)
    names = expand_benchmarks(benchmarks.split(","))
    for name in names:  # every missing file is named before any is read
        locate_benchmark(name, data_dir)
    for name in names:
        load_benchmark(name, data_dir, limit, seed)
