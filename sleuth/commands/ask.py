"""``sleuth ask "question"``: run one episode and print the answer and the trajectory."""

from __future__ import annotations

from sleuth.commands.common import MODEL_HELP, add_config_arguments, config_from_args, model_config

HELP = "ask the agent a question; prints the answer and the turn-by-turn trajectory"


def add_arguments(p) -> None:
    p.add_argument("question")
    add_config_arguments(p)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--index", help="index directory (default: retrieval.index_dir)")
    p.add_argument("--answer", action="append", default=[], help="a gold answer, to score the episode")
    p.add_argument("--json", action="store_true", help="print the whole trajectory as JSON")


def run(args) -> int:
    import json

    from agent.loop.batch import run_episodes
    from agent.trajectory import Role
    from corpora.formats import QAExample
    from sleuth.pipeline import answer_judge, load_llm, open_retriever

    cfg = model_config(config_from_args(args), args.model)  # the model's trained settings, or the untrained note
    retriever = open_retriever(cfg, args.index)  # first: a missing index is the commonest mistake
    llm = load_llm(cfg, args.model)
    ex = QAExample(id="ask", question=args.question, golden_answers=args.answer or [""])
    (traj,) = run_episodes([ex], llm, retriever, cfg.agent, temperature=cfg.eval.temperature,
                           top_k=cfg.retrieval.top_k, seed=cfg.seed, judge=answer_judge(cfg))
    if args.json:
        print(json.dumps(traj.to_json(), ensure_ascii=False, indent=1))
        return 0
    for t in traj.turns:
        print(f"--- turn {t.index}: {t.action}" + (f" ({t.error})" if t.error else ""))
        print(f"[policy] {t.text.strip()}")
        if t.observation is not None:
            obs = t.observation if len(t.observation) < 1200 else t.observation[:1200] + " ..."
            print(f"[tool]   {obs}")
    n_tool = sum(r == Role.TOOL for r in traj.roles)
    print(f"\nanswer: {traj.answer!r}   (stop: {traj.stop_reason}; {traj.num_search_calls} searches; "
          f"{traj.num_policy_tokens} policy / {n_tool} tool tokens)")
    if args.answer:
        print(f"verdict: {traj.verdict}")
    return 0
