"""The batch graph (agent/loop/batch.py): many episodes as one LangGraph run give the trajectories the
per-episode graph gives, in a number of graph steps set by the turns, not by the episodes."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from agent.loop.batch import BATCH_GRAPH, NEXT, arun_batch
from agent.loop.episode import run_episode
from agent.loop.nodes import make_context, new_episode
from corpora.formats import QAExample
from tests.test_agent_fakes import ScriptLLM

SCRIPTS = {"alpha": ["<search> Paris </search>", "<search> France </search>", "<answer> Paris </answer>"],
           "beta": ["<search> Berlin", "<answer> Berlin </answer>"],  # an invalid action, then an answer
           "gamma": ["<answer> Dijon </answer>"],
           "delta": ["<search> Rhine </search>"]}  # searches until the turns run out


def _examples() -> list[QAExample]:
    return [QAExample(f"{k}{i}", f"{k} question {i}?", ["Paris"]) for k in SCRIPTS for i in range(3)]


def test_batch_run_gives_the_per_episode_graphs_trajectories(tiny_llm, retriever, agent_cfg):
    cfg = agent_cfg.model_copy(update={"max_batch": 5})  # several backend calls per turn, one short
    examples = _examples()

    async def per_episode():
        ctx = make_context(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, cfg)
        return await asyncio.gather(*(run_episode(ctx, ex, group=i) for i, ex in enumerate(examples)))

    async def batched():
        ctx = make_context(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, cfg)
        return await arun_batch(ctx, [(ex, i) for i, ex in enumerate(examples)])

    want, got = asyncio.run(per_episode()), asyncio.run(asyncio.wait_for(batched(), 60))
    assert [asdict(t) for t in got] == [asdict(t) for t in want]
    assert {t.stop_reason for t in got} == {"answer", "max_turns"}
    assert any(t.turns[0].action == "invalid" for t in got)


def test_batch_graph_steps_follow_the_turns_not_the_episodes(tiny_llm, retriever, agent_cfg):
    async def steps(n: int) -> list[str]:
        ctx = make_context(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, agent_cfg)
        states = [new_episode(ctx, QAExample(f"d{i}", f"delta {i}?", ["x"]), i) | {NEXT: "policy"} for i in range(n)]
        config = {"configurable": {"ctx": ctx}, "recursion_limit": 50}
        return [node async for step in BATCH_GRAPH.astream({"episodes": states}, config=config, stream_mode="updates")
                for node in step]

    turns = agent_cfg.max_turns
    want = ["policy", "tool"] * (turns - 1) + ["policy", "judge"]
    assert asyncio.run(steps(2)) == want and asyncio.run(steps(40)) == want


def test_a_failing_search_ends_only_its_episode(tiny_llm, retriever, agent_cfg):
    class FailsOnBad:
        def search(self, queries, k):
            if "bad" in queries:
                raise ValueError("rejected query")
            return retriever.search(queries, k)

    scripts = {"good": ["<search> Paris </search>", "<answer> Paris </answer>"],
               "bad": ["<search> bad </search>", "<answer> x </answer>"]}
    ctx = make_context(ScriptLLM(tiny_llm.tokenizer, scripts), FailsOnBad(), agent_cfg)
    exs = [QAExample(f"{k}{i}", f"{k} {i}?", ["Paris"]) for k in scripts for i in range(3)]
    trajs = asyncio.run(asyncio.wait_for(arun_batch(ctx, [(ex, i) for i, ex in enumerate(exs)]), 60))
    assert [t.stop_reason for t in trajs] == ["answer"] * 3 + ["error"] * 3
    assert all("rejected query" in t.metadata["error"] and t.reward == 0.0 for t in trajs[3:])
