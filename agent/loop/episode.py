"""The agent loop as a LangGraph ``StateGraph``, one graph run per episode: what a server streaming one
request runs (:func:`run_episode`, with progress events). Its nodes and edges are those of
:mod:`agent.loop.nodes`; rollouts of many episodes run them as one graph over the batch
(:mod:`agent.loop.batch`).

    START -> policy [generate -> parse] -> tool [search -> observe] -> policy -> ... -> judge -> END
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from agent.loop.nodes import (
    AgentContext,
    EpisodeState,
    after_policy,
    after_tool,
    fail_episode,
    judge,
    new_episode,
    policy,
    tool,
)
from agent.trajectory import Trajectory
from corpora.formats import QAExample


def build_graph():
    """Compile the episode graph (structure only; runtime objects arrive through the config)."""
    g = StateGraph(EpisodeState)
    for name, fn in [("policy", policy), ("tool", tool), ("judge", judge)]:
        g.add_node(name, fn)
    g.add_edge(START, "policy")
    g.add_conditional_edges("policy", after_policy, ["tool", "judge"])
    g.add_conditional_edges("tool", after_tool, ["policy", "judge"])
    g.add_edge("judge", END)
    return g.compile()


GRAPH = build_graph()


EventSink = Callable[[dict[str, Any]], Awaitable[None]]


def step_event(node: str, update: dict[str, Any] | None, traj: Trajectory) -> dict[str, Any] | None:
    """The progress event of one graph step (``node`` returned ``update``), read from what the node
    recorded in ``traj``; ``None`` for steps without one (the judge, a policy step that found the token
    budget spent, an invalid action's error observation).

    * after a policy turn: ``{"type": "turn", "turn": i, "text": <the turn's generated text>,
      "action": "search" | "answer" | "invalid" | ..., "error": str | None, "judgement": str | None}``
      (``Turn.text``/``action``/``error``: why an invalid action was invalid; ``judgement``: the ReSeek
      self-judge of the previous observation, ``"useful"``/``"not useful"``, when the turn made one);
    * after a search: ``{"type": "search", "turn": i, "query": str, "doc_ids": [str], "hits": [Hit]}``
      (``Turn.query``, ``Turn.hit_ids`` and the :class:`retrieval.base.Hit` s themselves, with this query's
      scores, in retrieval order)."""
    update = update or {}
    if node == "policy" and "action" in update and traj.turns:
        t = traj.turns[-1]
        return {"type": "turn", "turn": t.index, "text": t.text, "action": t.action, "error": t.error,
                "judgement": t.judgement}
    if node == "tool" and "hits" in update and traj.turns:
        t = traj.turns[-1]
        return {"type": "search", "turn": t.index, "query": t.query, "doc_ids": list(t.hit_ids),
                "hits": list(update["hits"])}
    return None


async def run_episode(ctx: AgentContext, example: QAExample, group: int = 0,
                      on_event: EventSink | None = None) -> Trajectory:
    """Run one episode to its end. A backend failure ends the episode with ``stop_reason="error"``, the
    reason in ``metadata["error"]`` and ``metadata["service_down"]`` true when the backend or retriever as a
    whole was unavailable (:func:`agent.loop.scheduler.is_global`); it raises only when the prompt itself
    cannot be built (the tokenizer or chat template fails on it: a setup error that would fail every episode,
    so it is not hidden as one), and cancelling the task still cancels it.

    With ``on_event`` (an async callable taking one dict), the graph runs through LangGraph's
    ``astream(stream_mode="updates")`` instead of ``ainvoke`` and ``await on_event(event)`` is called
    after each policy turn and each search, with the events of :func:`step_event`, while the episode
    runs. The trajectory is the same either way; an exception raised by ``on_event`` fails the episode
    like a backend error."""
    state = new_episode(ctx, example, group)
    traj = state["traj"]
    config: RunnableConfig = {"configurable": {"ctx": ctx}, "recursion_limit": 2 * ctx.agent_cfg.max_turns + 8}
    async with ctx.scheduler.episode():
        try:
            if on_event is None:
                await GRAPH.ainvoke(state, config=config)
            else:
                async for step in GRAPH.astream(state, config=config, stream_mode="updates"):
                    for node, update in step.items():
                        event = step_event(node, update, traj)
                        if event is not None:
                            await on_event(event)
        except Exception as e:  # noqa: BLE001 - an episode fails cleanly with its reason
            fail_episode(traj, e)
    return traj
