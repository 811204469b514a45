"""Many episodes as one LangGraph run: the rollout graph whose state is the whole batch.

:func:`agent.loop.episode.run_episode` runs one graph per episode, which a server streaming one request needs.
At rollout scale (Search-R1's step: 512 prompts x 5 episodes) LangGraph's bookkeeping, paid per graph run and
per step of every episode, cost more than the loop's own work: about 2.4 ms per episode-turn at 32
episodes, and more per episode-turn as the batch grows (``bench/rollout.py``). This graph has the same
nodes, ``policy`` (generate, parse), ``tool`` (search, observe) and ``judge``, but one step runs that node
for every episode waiting for it, concurrently: the scheduler still gathers one batched backend call per
turn, and LangGraph's cost is paid once per step of the batch instead of once per step of each episode.

Each episode takes the path the per-episode graph's edges give it (:func:`agent.loop.nodes.after_policy`,
:func:`agent.loop.nodes.after_tool`) through the same node functions, so its trajectory is the one
:func:`agent.loop.episode.run_episode` gives it. A backend or tool failure ends that episode alone
(:func:`agent.loop.nodes.fail_episode`). An episode counts as live for the scheduler
(:meth:`agent.loop.scheduler.Scheduler.episode`) only while its node runs, so the ones done with a step never
hold back the batches of the others.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from agent.judges import Judge
from agent.llm import LLM, run_sync
from agent.loop.nodes import (
    AgentContext,
    EpisodeState,
    after_policy,
    after_tool,
    fail_episode,
    judge,
    make_context,
    new_episode,
    policy,
    tool,
)
from agent.trajectory import Trajectory
from corpora.formats import QAExample
from retrieval.base import Retriever

NEXT = "next"  # an episode's key: the node it waits for ("policy", "tool", "judge"), or "done"


class BatchState(TypedDict):
    """The graph's state: every episode's :class:`agent.loop.nodes.EpisodeState` (in order; updated in
    place)."""
    episodes: list[EpisodeState]


async def _run_each(name: str, fn: Callable, route: Callable | None, state: BatchState,
                    config: RunnableConfig) -> BatchState:
    """Run node ``fn`` for every episode waiting for ``name``, concurrently, each registered with the
    scheduler for the length of its own call; then send each on by ``route`` (``None``: done). A failure
    ends its episode alone."""
    sched = config["configurable"]["ctx"].scheduler
    waiting = [st for st in state["episodes"] if st[NEXT] == name]
    slots = [sched.episode() for _ in waiting]
    for slot in slots:  # all registered before any request is made: a batch waits for all of them
        await slot.__aenter__()

    async def one(st: EpisodeState, slot: Any) -> None:
        try:
            st.update(await fn(st, config))
            st[NEXT] = route(st, config) if route is not None else "done"
        except Exception as e:  # noqa: BLE001 - an episode fails cleanly with its reason
            fail_episode(st["traj"], e)
            st[NEXT] = "done"
        finally:
            await slot.__aexit__(None, None, None)

    await asyncio.gather(*(one(st, slot) for st, slot in zip(waiting, slots, strict=True)))
    return {"episodes": state["episodes"]}


async def policy_step(state: BatchState, config: RunnableConfig) -> BatchState:
    """:func:`agent.loop.nodes.policy` for every episode at a policy turn."""
    return await _run_each("policy", policy, after_policy, state, config)


async def tool_step(state: BatchState, config: RunnableConfig) -> BatchState:
    """:func:`agent.loop.nodes.tool` for every episode whose turn called the tool (or was invalid)."""
    return await _run_each("tool", tool, after_tool, state, config)


async def judge_step(state: BatchState, config: RunnableConfig) -> BatchState:
    """:func:`agent.loop.nodes.judge` for every episode that ended (the failed ones were scored already)."""
    return await _run_each("judge", judge, None, state, config)


async def branch_step(state: BatchState, config: RunnableConfig) -> BatchState:
    """After a tool step: the run's ``after_tool(episodes)`` hook (``config["configurable"]``) returns new
    episode states (e.g. copies of partial episodes, :func:`fork`), which join the batch."""
    added = config["configurable"]["after_tool"](state["episodes"])
    state["episodes"].extend(added)
    return {"episodes": state["episodes"]}


def _next_step(state: BatchState) -> str:
    waiting = {st[NEXT] for st in state["episodes"]}
    return "policy" if "policy" in waiting else "tool" if "tool" in waiting else "judge"


def build_batch_graph(branching: bool = False):
    """Compile the batch graph: ``policy`` and ``tool`` steps alternate while an episode waits for one
    (``policy`` first), then one ``judge`` step. ``branching``: a ``branch`` step (:func:`branch_step`)
    follows every ``tool`` step."""
    g = StateGraph(BatchState)
    nodes = [("policy", policy_step), ("tool", tool_step), ("judge", judge_step)]
    for name, fn in nodes + ([("branch", branch_step)] if branching else []):
        g.add_node(name, fn)
    g.add_edge(START, "policy")
    g.add_conditional_edges("policy", _next_step, ["policy", "tool", "judge"])
    if branching:
        g.add_edge("tool", "branch")
        g.add_conditional_edges("branch", _next_step, ["policy", "tool", "judge"])
    else:
        g.add_conditional_edges("tool", _next_step, ["policy", "tool", "judge"])
    g.add_edge("judge", END)
    return g.compile()


BATCH_GRAPH = build_batch_graph()
BRANCH_GRAPH = build_batch_graph(branching=True)

AfterTool = Callable[[list[EpisodeState]], list[EpisodeState]]


def fork(state: EpisodeState) -> EpisodeState:
    """An independent copy of a running episode's state (its trajectory deep-copied): it continues from the
    same tokens, and samples its own continuation."""
    return copy.deepcopy(state)


async def arun_states(ctx: AgentContext, states: list[EpisodeState],
                      after_tool: AfterTool | None = None) -> list[Trajectory]:
    """Run episode states to their ends as one graph run: fresh ones (:func:`agent.loop.nodes.new_episode`)
    or episodes resumed from a prefix (a trajectory cut and extended by the caller, at its ``turn``). An
    episode waits for the node of its state's ``"next"`` key (default ``"policy"``). With ``after_tool``,
    the hook runs after every tool step on all the episodes and the states it returns join the run (ARPO's
    branching). Returns the trajectories of ``states`` then of the added ones, in order."""
    states = list(states)
    for st in states:
        st.setdefault(NEXT, "policy")
    if states:
        rounds = 3 if after_tool is not None else 2
        config: RunnableConfig = {"configurable": {"ctx": ctx, "after_tool": after_tool},
                                  "recursion_limit": rounds * ctx.agent_cfg.max_turns + 8}
        graph = BATCH_GRAPH if after_tool is None else BRANCH_GRAPH
        await graph.ainvoke({"episodes": states}, config=config)
    return [st["traj"] for st in states]


async def arun_batch(ctx: AgentContext, episodes: list[tuple[QAExample, int]]) -> list[Trajectory]:
    """Run one episode per ``(example, group)`` in ``episodes`` to its end, as one graph run; trajectories
    in the same order. Raises what building a prompt raises (a setup error that would fail every episode),
    before any episode runs."""
    return await arun_states(ctx, [new_episode(ctx, ex, group) for ex, group in episodes])


async def arun_episodes(ctx: AgentContext, examples: list[QAExample], n_samples: int = 1) -> list[Trajectory]:
    """Run ``n_samples`` episodes per example concurrently; trajectories come back grouped by example
    (group id = example index), in order. The episodes run as one LangGraph graph over the whole batch
    (:func:`arun_batch`), with the same steps and the same trajectories as
    :func:`agent.loop.episode.run_episode` gives each of them."""
    return await arun_batch(ctx, [(ex, i) for i, ex in enumerate(examples) for _ in range(n_samples)])


def run_episodes(
    examples: list[QAExample],
    llm: LLM,
    retriever: Retriever,
    cfg: Any,
    *,
    n_samples: int = 1,
    temperature: float | None = None,
    top_k: int = 3,
    seed: int | None = None,
    judge: Judge | None = None,
) -> list[Trajectory]:
    """Synchronous entry point: roll out ``n_samples`` episodes per example with batched generation.

    ``cfg`` is an :class:`agent.config.AgentConfig`; ``temperature`` overrides ``cfg.temperature``
    (0 = greedy). Returns ``len(examples) * n_samples`` trajectories. Called where an event loop already
    runs (a Jupyter cell), the episodes run in a fresh loop on a helper thread.
    """
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    ctx = make_context(llm, retriever, cfg, temperature=temperature, top_k=top_k, judge=judge)
    return run_sync(arun_episodes(ctx, examples, n_samples))  # also inside a running event loop (Jupyter)


def run_states(build: Callable[[AgentContext], list[EpisodeState]], llm: LLM, retriever: Retriever | None,
               cfg: Any, *, after_tool: AfterTool | None = None, top_k: int = 3,
               judge: Judge | None = None) -> list[Trajectory]:
    """Synchronous entry point of :func:`arun_states`: ``build(ctx)`` makes the episode states in the run's
    :class:`agent.loop.nodes.AgentContext` (its tokenizer, protocol and judge), then they run to their ends
    (with the ``after_tool`` hook)."""
    ctx = make_context(llm, retriever, cfg, top_k=top_k, judge=judge)
    return run_sync(arun_states(ctx, build(ctx), after_tool))
