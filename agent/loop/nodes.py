"""The agent loop's nodes and edges: plain functions of one episode's state, shared by the per-episode graph
(:mod:`agent.loop.episode`) and the batch graph (:mod:`agent.loop.batch`).

    START -> policy [generate -> parse] -> tool [search -> observe] -> policy -> ... -> judge -> END
                                      |    \\-> [observe_error] (invalid action)
                                      \\-> (answer, or budget spent) -> judge

The runtime (scheduler, tokenizer, config, judge) comes in through LangGraph's
``config["configurable"]["ctx"]``, an :class:`AgentContext` (:func:`make_context`). Every token is appended to
the episode's :class:`~agent.trajectory.Trajectory` exactly once, with its role and turn, so the trainer
trains on exactly what the policy saw. Everything that depends on the tool protocol (``agent.protocol``:
Search-R1 tags or native function calling) is asked of the one :class:`agent.protocols.base.ToolProtocol`
object of the run; the judges are in :mod:`agent.judges`; optional ReSeek self-judge
(``<judge>useful|not useful</judge>``, ``agent.self_judge``).
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig

from agent.judges import Judge, configured_judge
from agent.llm import LLM, SamplingParams, decode, encode, end_of_turn_ids
from agent.loop.scheduler import Scheduler, is_global
from agent.metrics import rule_verdict
from agent.protocols.base import Action, ToolProtocol, check_chat_template, format_docs, split_judgement
from agent.protocols.build import make_protocol
from agent.trajectory import Role, Trajectory, Turn
from corpora.formats import QAExample
from retrieval.base import Retriever

_EPISODE_IDS = itertools.count()  # the episodes of this process, numbered (next() is atomic under the GIL)


class EpisodeState(TypedDict, total=False):
    """The LangGraph state of one episode; ``traj`` is appended to in place, the rest is per turn."""
    traj: Trajectory
    turn: int  # the current turn, 1-based
    text: str  # the policy's text in the current turn
    finish_reason: str  # the backend's finish reason for the current turn ("stop" / "length")
    eos: bool  # the current turn ended with an end-of-turn (EOS) token (the turn's last policy token)
    action: Action
    hits: list
    finish: str  # "" while running; else the stop reason
    episode: str  # this episode's id within the process (SamplingParams.episode: routes its turns to one engine)
    weight_version: Any  # the weights that generated the current turn, as the backend reported them (or None)



@dataclass
class AgentContext:
    """What the nodes need at run time. ``agent_cfg`` is a :class:`agent.config.AgentConfig`-like object
    (``max_turns``, ``max_new_tokens``, ``max_total_tokens``, ``max_obs_tokens``, ``max_doc_chars``,
    ``max_query_chars``, ``reward``, ``format_reward``, ``short_prompt``, ``chat_template``); ``protocol`` is
    the run's tool protocol and ``judge`` its episode judge (both chosen once, by :func:`make_context`)."""

    scheduler: Scheduler
    tokenizer: Any
    agent_cfg: Any
    params: SamplingParams
    protocol: ToolProtocol
    judge: Judge
    top_k: int = 3
    _tag_ids: dict[str, list[int]] = field(default_factory=dict)

    def ids(self, text: str) -> list[int]:
        if text not in self._tag_ids:
            self._tag_ids[text] = encode(self.tokenizer, text)
        return self._tag_ids[text]

    @property
    def eos_ids(self) -> set[int]:
        """The backend's end-of-turn ids (:func:`agent.llm.end_of_turn_ids`), else the tokenizer's EOS."""
        ids = getattr(getattr(self.scheduler, "llm", None), "eos_ids", None)
        return ids if ids else end_of_turn_ids(self.tokenizer)


def _ctx(config: RunnableConfig) -> AgentContext:
    return config["configurable"]["ctx"]


# -- nodes --------------------------------------------------------------------------------------------
async def generate(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Sample the policy's next turn (at most ``max_new_tokens`` and the episode's remaining token
    budget) and append it as policy tokens."""
    ctx, traj = _ctx(config), state["traj"]
    budget = min(ctx.agent_cfg.max_new_tokens, ctx.agent_cfg.max_total_tokens - len(traj))
    if budget <= 0:
        return {"finish": "max_tokens", "text": ""}
    params = replace(ctx.params, max_new_tokens=budget, episode=state.get("episode"))
    gen = await ctx.scheduler.generate(traj.token_ids, params)
    traj.append(gen.token_ids, Role.POLICY, state["turn"], gen.logprobs)
    eos = bool(gen.token_ids) and gen.token_ids[-1] in ctx.eos_ids
    return {"text": gen.text, "finish_reason": gen.finish_reason, "eos": eos,
            "weight_version": gen.meta.get("weight_version")}


def parse(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Parse the turn's action and record it as a :class:`Turn`; a malformed action becomes
    ``kind='invalid'`` with its reason."""
    ctx, traj = _ctx(config), state["traj"]
    judgement, judge_error, text = None, None, state["text"]
    if getattr(ctx.agent_cfg, "self_judge", False):
        judgement, judge_error, text = split_judgement(text)
    if judge_error:
        action = Action("invalid", error=judge_error)
    else:
        action = ctx.protocol.parse(text, state.get("finish_reason", "stop"))
    n_policy = sum(1 for r, t in zip(traj.roles, traj.turn_ids) if t == state["turn"] and r == Role.POLICY)
    traj.turns.append(
        Turn(
            index=state["turn"],
            text=state["text"],
            action=action.kind,
            query=action.content if action.kind == "search" else None,
            answer=action.content if action.kind == "answer" else None,
            error=action.error,
            n_policy_tokens=n_policy,
            judgement=judgement,
            weight_version=state.get("weight_version"),
        )
    )
    if action.kind == "answer":
        traj.answer = action.content
    return {"action": action}


async def search(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Run the turn's query through the batching scheduler's retriever (top-k hits)."""
    ctx = _ctx(config)
    hits = await ctx.scheduler.search(state["action"].content, ctx.top_k)
    turn = state["traj"].turns[-1]
    turn.hit_ids = [h.id for h in hits]
    state["traj"].retrieved_ids.extend(h.id for h in hits)
    return {"hits": hits}


def _append_observation(ctx: AgentContext, state: EpisodeState, body: str) -> EpisodeState:
    """Append the tool result as tool tokens: ``\\n\\n<information>body</information>\\n\\n`` (Search-R1) or
    the chat template's tool message (function calling), cutting the body so that the observation fits
    both ``max_obs_tokens`` and the episode's token budget (the closing text is kept); ``Turn.observation``
    is the body as appended (the cut text when it was cut). Only this delta is tokenised; earlier tokens
    are never re-tokenised."""
    traj, cfg = state["traj"], ctx.agent_cfg
    # the turn's last policy token is the last token so far: the tool answers right after the turn
    eos_text = decode(ctx.tokenizer, traj.token_ids[-1:]) if state.get("eos") else None
    head_text, tail_text = ctx.protocol.observation_frame(eos_text)
    head, tail = ctx.ids(head_text), ctx.ids(tail_text)
    room = min(cfg.max_obs_tokens, cfg.max_total_tokens - len(traj)) - len(head) - len(tail)
    if room <= 0:
        return {"finish": "max_tokens"}
    body_ids = encode(ctx.tokenizer, body)
    if len(body_ids) > room:  # record the cut text: what the policy read (the self-judge is scored on it)
        body_ids = body_ids[:room]
        body = decode(ctx.tokenizer, body_ids)
    ids = head + body_ids + tail
    traj.append(ids, Role.TOOL, state["turn"])
    turn = traj.turns[-1]
    turn.observation = body
    turn.n_tool_tokens = len(ids)
    return {"turn": state["turn"] + 1}


def observe(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Append the retrieved documents as an ``<information>`` block of tool tokens."""
    ctx = _ctx(config)
    return _append_observation(ctx, state, format_docs(state["hits"], ctx.agent_cfg.max_doc_chars))


def observe_error(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Append the invalid-action hint as an ``<information>`` block of tool tokens (never trained on)."""
    ctx = _ctx(config)
    return _append_observation(ctx, state, ctx.protocol.invalid_hint(state["action"].error))


async def judge(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    ctx, traj = _ctx(config), state["traj"]
    traj.stop_reason = "answer" if traj.answer is not None else (state.get("finish") or "max_turns")
    fn = ctx.judge
    if getattr(fn, "blocking", False):  # an LLM judge: keep the event loop (other episodes) running
        traj.reward, traj.verdict = await asyncio.to_thread(fn, traj)
    else:
        traj.reward, traj.verdict = fn(traj)
    return {"finish": traj.stop_reason}


# -- graph steps --------------------------------------------------------------------------------------
# Each graph step costs LangGraph bookkeeping (~0.1-0.3 ms per episode on a CPU core), which a tiny model
# on CPU does not hide, so the fine-grained nodes above run as two steps per turn: ``policy`` (generate,
# then parse) and ``tool`` (search, then observe; or observe_error). bench/rollout.py measures the effect.
async def policy(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """One policy turn: :func:`generate` then :func:`parse`."""
    out = await generate(state, config)
    if not out.get("finish"):
        out.update(parse({**state, **out}, config))
    return out


async def tool(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """The tool's answer: :func:`search` then :func:`observe`, or :func:`observe_error` after an invalid
    action."""
    if state["action"].kind == "search":
        out = await search(state, config)
        out.update(observe({**state, **out}, config))
        return out
    return observe_error(state, config)


# -- edges --------------------------------------------------------------------------------------------
def after_policy(state: EpisodeState, config: RunnableConfig) -> str:
    """Edge after a policy turn: judge on an answer, a spent budget or the last turn; else run the tool."""
    if state.get("finish"):
        return "judge"
    if state["action"].kind == "answer":
        return "judge"
    if state["turn"] >= _ctx(config).agent_cfg.max_turns:
        return "judge"  # no answer before the turn budget ended
    return "tool"


def after_tool(state: EpisodeState, config: RunnableConfig) -> str:
    """Edge after a tool step: back to the policy unless the token budget is spent."""
    return "judge" if state.get("finish") else "policy"


#: the example's metadata an episode's trajectory carries: its hop count and dataset, its supporting passages, and
#: the entity chain (synthetic questions) or named entities a question was built from (E-GRPO's gold entities)
EPISODE_METADATA = ("hops", "dataset", "supporting_ids", "chain", "entities")


def new_episode(ctx: AgentContext, example: QAExample, group: int = 0,
                prompt_ids: list[int] | None = None) -> EpisodeState:
    """The start state of an episode of ``example``: its trajectory holding the prompt (raises what the
    tokenizer or chat template raises on it), at turn 1. ``prompt_ids``: another task prompt than the
    protocol's for the question (e.g. AdaSearch's parametric-mode prompt), as token ids."""
    traj = Trajectory(question_id=example.id, question=example.question,
                      golden_answers=list(example.golden_answers), group=group,
                      metadata={k: v for k, v in example.metadata.items() if k in EPISODE_METADATA})
    ids = ctx.protocol.prompt_ids(example.question) if prompt_ids is None else list(prompt_ids)
    traj.append(ids, Role.PROMPT, 0)
    return {"traj": traj, "turn": 1, "finish": "", "episode": f"ep-{next(_EPISODE_IDS)}"}


def fail_episode(traj: Trajectory, e: BaseException) -> None:
    """End an episode on a backend or tool failure ``e``: ``stop_reason="error"``, the reason in
    ``metadata["error"]``, ``metadata["service_down"]`` from :func:`agent.loop.scheduler.is_global`, reward
    0."""
    traj.stop_reason = "error"
    traj.metadata["error"] = f"{type(e).__name__}: {e}"
    traj.metadata["service_down"] = is_global(e)  # a service unavailable, not this request's fault
    traj.reward, traj.verdict = 0.0, rule_verdict(None, traj.golden_answers) | {"format_ok": False}


def make_context(llm: LLM, retriever: Retriever | None, cfg: Any, *, temperature: float | None = None,
                 top_k: int = 3, judge: Judge | None = None, scheduler: Scheduler | None = None) -> AgentContext:
    """An :class:`AgentContext` for :func:`agent.loop.batch.arun_episodes` /
    :func:`agent.loop.episode.run_episode` (e.g. inside a server's event loop, where one scheduler is shared
    by all requests): the tool protocol of ``cfg.protocol`` (:func:`agent.protocols.build.make_protocol`) and,
    unless ``judge`` is given, the judge of ``cfg`` (:func:`agent.judges.configured_judge`; with
    ``cfg.judge == "llm"`` the policy backend itself judges). Raises ``ValueError`` when
    ``cfg.max_obs_tokens`` cannot hold an observation's framing and one token, or for
    ``agent.chat_template=on`` without a chat template (:func:`check_chat_template`)."""
    check_chat_template(llm.tokenizer, cfg)  # now, not at every episode's first prompt
    proto = make_protocol(llm.tokenizer, cfg)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature if temperature is None else temperature,
                            top_p=cfg.top_p, stop=proto.stop_strings)
    sched = scheduler or Scheduler(llm, retriever, max_batch=cfg.max_batch)
    ctx = AgentContext(sched, llm.tokenizer, cfg, params, proto, judge or configured_judge(cfg, llm), top_k=top_k)
    frames = map(proto.observation_frame, (None, getattr(llm.tokenizer, "eos_token", None)))  # without / with EOS
    frame = max(len(ctx.ids(head)) + len(ctx.ids(tail)) for head, tail in frames)
    if cfg.max_obs_tokens <= frame:  # else every episode would end at its first tool result, as max_tokens
        raise ValueError(f"agent.max_obs_tokens={cfg.max_obs_tokens} leaves no room for a tool result: its "
                         f"framing ({proto.name} protocol) takes {frame} tokens; use more than {frame}")
    return ctx
