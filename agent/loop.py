"""The agent loop as a LangGraph ``StateGraph``, one graph run per episode.

    START -> policy [generate -> parse] -> tool [search -> observe] -> policy -> ... -> judge -> END
                                      |    \\-> [observe_error] (invalid action)
                                      \\-> (answer, or budget spent) -> judge

Nodes are plain functions of the episode state; the runtime (scheduler, tokenizer, config, judge) comes in
through LangGraph's ``config["configurable"]["ctx"]``. Every token is appended to the episode's
:class:`~agent.trajectory.Trajectory` exactly once, with its role and turn, so the trainer trains on
exactly what the policy saw. Tool protocols (``agent.protocol``): Search-R1 tags (:mod:`agent.protocol`) or
native function calling through the chat template (:mod:`agent.function_call`); optional ReSeek self-judge
(``<judge>useful|not useful</judge>``, ``agent.self_judge``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from agent import function_call, protocol
from agent.judges import normalize_answer, rule_verdict
from agent.llm import LLM, SamplingParams, decode, encode, end_of_turn_ids, run_sync
from agent.scheduler import Scheduler, is_global
from agent.trajectory import Role, Trajectory, Turn
from corpora.formats import QAExample
from retrieval.base import Retriever


class EpisodeState(TypedDict, total=False):
    """The LangGraph state of one episode; ``traj`` is appended to in place, the rest is per turn."""
    traj: Trajectory
    turn: int  # the current turn, 1-based
    text: str  # the policy's text in the current turn
    finish_reason: str  # the backend's finish reason for the current turn ("stop" / "length")
    eos: bool  # the current turn ended with an end-of-turn (EOS) token (the turn's last policy token)
    action: protocol.Action
    hits: list
    finish: str  # "" while running; else the stop reason


Judge = Callable[[Trajectory], tuple[float, dict[str, Any]]]


@dataclass
class AgentContext:
    """What the nodes need at run time. ``agent_cfg`` is a :class:`agent.config.AgentConfig`-like object
    (``max_turns``, ``max_new_tokens``, ``max_total_tokens``, ``max_obs_tokens``, ``max_doc_chars``,
    ``max_query_chars``, ``reward``, ``format_reward``, ``short_prompt``, ``chat_template``)."""

    scheduler: Scheduler
    tokenizer: Any
    agent_cfg: Any
    params: SamplingParams
    top_k: int = 3
    judge: Judge | None = None
    _tag_ids: dict[str, list[int]] = field(default_factory=dict)
    _tool_template: function_call.ToolTemplate | None = None

    def ids(self, text: str) -> list[int]:
        if text not in self._tag_ids:
            self._tag_ids[text] = encode(self.tokenizer, text)
        return self._tag_ids[text]

    @property
    def protocol(self) -> str:
        return getattr(self.agent_cfg, "protocol", "search_r1")

    @property
    def eos_ids(self) -> set[int]:
        """The backend's end-of-turn ids (:func:`agent.llm.end_of_turn_ids`), else the tokenizer's EOS."""
        ids = getattr(getattr(self.scheduler, "llm", None), "eos_ids", None)
        return ids if ids else end_of_turn_ids(self.tokenizer)

    def observation_frame(self, eos_text: str | None) -> tuple[str, str]:
        """The text written before and after a tool result: ``<information>`` tags (Search-R1), or the
        chat template's tool message (function calling; see :class:`agent.function_call.ToolTemplate`).
        ``eos_text`` is the text of the end-of-turn token the policy's turn ended with (``None`` if it
        ended otherwise): the template's turn close is not written again when it starts with that token."""
        if self.protocol == "function_call":
            if self._tool_template is None:
                self._tool_template = function_call.ToolTemplate.of(self.tokenizer)
            t = self._tool_template
            return t.head(eos_text, eos_text is not None), t.after
        return "\n\n<information>", "</information>\n\n"


def _ctx(config: RunnableConfig) -> AgentContext:
    return config["configurable"]["ctx"]


# -- prompt -------------------------------------------------------------------------------------------
def prompt_ids(tokenizer: Any, question: str, agent_cfg: Any) -> list[int]:
    """Token ids of the task prompt. Search-R1: the model's chat template when it has one (``chat_template``
    auto/on), else the plain Search-R1 instruction (or the one-line prompt for the tiny policy). Function
    calling: the chat template with the search tool declared (:func:`agent.function_call.prompt_ids`). Both
    ask for ReSeek's ``<judge>`` with ``agent_cfg.self_judge`` (except the one-line prompt)."""
    self_judge = getattr(agent_cfg, "self_judge", False)
    if getattr(agent_cfg, "protocol", "search_r1") == "function_call":
        return function_call.prompt_ids(tokenizer, question, self_judge)
    text = protocol.build_prompt(question, short=agent_cfg.short_prompt, self_judge=self_judge)
    return user_message_ids(tokenizer, text, agent_cfg)


def check_chat_template(tokenizer: Any, agent_cfg: Any) -> None:
    """Raise ``ValueError`` when ``agent_cfg.chat_template`` is ``on`` but ``tokenizer`` has no chat
    template (``auto`` uses one only when it is there)."""
    if getattr(agent_cfg, "chat_template", "auto") == "on" and not getattr(tokenizer, "chat_template", None):
        raise ValueError("agent.chat_template=on, but the model's tokenizer has no chat template; use "
                         "agent.chat_template=auto (the template when there is one) or off")


def user_message_ids(tokenizer: Any, text: str, agent_cfg: Any) -> list[int]:
    """Token ids of a one-message user prompt ``text``, ready for generation: through the model's chat
    template (with the generation prompt) when ``agent_cfg.chat_template`` is ``on``, or ``auto`` and the
    tokenizer has one; else BOS (when the tokenizer has one) and the plain text. Raises ``ValueError`` for
    ``on`` without a template (:func:`check_chat_template`)."""
    check_chat_template(tokenizer, agent_cfg)
    use_chat = agent_cfg.chat_template == "on" or (
        agent_cfg.chat_template == "auto" and getattr(tokenizer, "chat_template", None)
    )
    if use_chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    return bos + encode(tokenizer, text)


# -- nodes --------------------------------------------------------------------------------------------
async def generate(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Sample the policy's next turn (at most ``max_new_tokens`` and the episode's remaining token
    budget) and append it as policy tokens."""
    ctx, traj = _ctx(config), state["traj"]
    budget = min(ctx.agent_cfg.max_new_tokens, ctx.agent_cfg.max_total_tokens - len(traj))
    if budget <= 0:
        return {"finish": "max_tokens", "text": ""}
    gen = await ctx.scheduler.generate(traj.token_ids, replace(ctx.params, max_new_tokens=budget))
    traj.append(gen.token_ids, Role.POLICY, state["turn"], gen.logprobs)
    eos = bool(gen.token_ids) and gen.token_ids[-1] in ctx.eos_ids
    return {"text": gen.text, "finish_reason": gen.finish_reason, "eos": eos}


def parse(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Parse the turn's action and record it as a :class:`Turn`; a malformed action becomes
    ``kind='invalid'`` with its reason."""
    ctx, traj = _ctx(config), state["traj"]
    judgement, judge_error, text = None, None, state["text"]
    if getattr(ctx.agent_cfg, "self_judge", False):
        judgement, judge_error, text = protocol.split_judgement(text)
    if judge_error:
        action = protocol.Action("invalid", error=judge_error)
    elif ctx.protocol == "function_call":
        action = function_call.parse_action(text, state.get("finish_reason", "stop"), ctx.agent_cfg.max_query_chars)
    else:
        action = protocol.parse_action(text, max_query_chars=ctx.agent_cfg.max_query_chars)
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
    head_text, tail_text = ctx.observation_frame(eos_text)
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
    return _append_observation(ctx, state, protocol.format_docs(state["hits"], ctx.agent_cfg.max_doc_chars))


def observe_error(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    """Append the invalid-action hint as an ``<information>`` block of tool tokens (never trained on)."""
    ctx = _ctx(config)
    if ctx.protocol == "function_call":
        body = f"Error: invalid action ({state['action'].error}). Call the search tool with a JSON object " \
               '{"name": "search", "arguments": {"query": ...}} or reply with <answer>...</answer>.'
    else:
        body = protocol.INVALID_HINT.format(reason=state["action"].error)
    return _append_observation(ctx, state, body)


def self_judge_agreement(traj: Trajectory) -> tuple[int, int]:
    """ReSeek self-judge bookkeeping: ``(agreeing, total)`` over the turns that rated the previous
    observation. A rating agrees when it says ``useful`` exactly when that observation's documents (titles
    and texts, not the ``Doc i`` labels) contain a normalised golden answer (the information that leads to
    the answer)."""
    golds = [g for g in (normalize_answer(x) for x in traj.golden_answers) if g]
    agree = total = 0
    for prev, turn in zip(traj.turns, traj.turns[1:]):
        if turn.judgement is None or prev.action != "search" or prev.observation is None:
            continue
        docs = normalize_answer(protocol.docs_content(prev.observation))
        useful = any(g in docs for g in golds)
        total += 1
        agree += int((turn.judgement == "useful") == useful)
    return agree, total


def rule_judge(reward_metric: str = "em", format_reward: float = 0.0, self_judge_reward: float = 0.0) -> Judge:
    """The default judge: EM / F1 / cover-EM of the answer (reward = the chosen metric), plus
    ``format_reward`` when every turn was well formed and the episode ended with an answer, plus
    ``self_judge_reward`` times the fraction of self-judgements that agree with the gold (ReSeek).

    The verdict is the per-episode reward record: ``em``, ``f1``, ``cover_em``, ``format_ok`` and, when
    the episode judged itself, ``self_judge_acc`` and ``self_judgements``."""

    def judge(traj: Trajectory) -> tuple[float, dict[str, Any]]:
        verdict: dict[str, Any] = rule_verdict(traj.answer, traj.golden_answers)
        verdict["format_ok"] = bool(traj.answer is not None and all(t.error is None for t in traj.turns))
        return verdict[reward_metric] + (format_reward if verdict["format_ok"] else 0.0), verdict

    return with_self_judge(judge, self_judge_reward)


def with_self_judge(fn: Judge, self_judge_reward: float = 0.0) -> Judge:
    """``fn`` plus ReSeek's self-judge term: ``self_judge_reward`` times the fraction of self-judgements that
    agree with the gold (:func:`self_judge_agreement`) is added to the reward, and the verdict gets
    ``self_judge_acc`` and ``self_judgements``, when the episode judged itself. Keeps ``fn.blocking``."""

    def judge(traj: Trajectory) -> tuple[float, dict[str, Any]]:
        reward, verdict = fn(traj)
        agree, total = self_judge_agreement(traj)
        if total:
            verdict["self_judge_acc"] = agree / total
            verdict["self_judgements"] = total
            reward += self_judge_reward * agree / total
        return reward, verdict

    judge.blocking = getattr(fn, "blocking", False)  # type: ignore[attr-defined]
    return judge


async def judge(state: EpisodeState, config: RunnableConfig) -> EpisodeState:
    ctx, traj = _ctx(config), state["traj"]
    traj.stop_reason = "answer" if traj.answer is not None else (state.get("finish") or "max_turns")
    fn = ctx.judge or rule_judge(ctx.agent_cfg.reward, ctx.agent_cfg.format_reward,
                                 getattr(ctx.agent_cfg, "self_judge_reward", 0.0))
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
    whole was unavailable (:func:`agent.scheduler.is_global`); it raises only when the prompt itself cannot be
    built (the tokenizer or chat template fails on it: a setup error that would fail every episode, so it is
    not hidden as one), and cancelling the task still cancels it.

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


def new_episode(ctx: AgentContext, example: QAExample, group: int = 0) -> EpisodeState:
    """The start state of an episode of ``example``: its trajectory holding the prompt (raises what the
    tokenizer or chat template raises on it), at turn 1."""
    traj = Trajectory(question_id=example.id, question=example.question,
                      golden_answers=list(example.golden_answers), group=group,
                      metadata={k: v for k, v in example.metadata.items() if k in ("hops", "dataset", "supporting_ids")})
    traj.append(prompt_ids(ctx.tokenizer, example.question, ctx.agent_cfg), Role.PROMPT, 0)
    return {"traj": traj, "turn": 1, "finish": ""}


def fail_episode(traj: Trajectory, e: BaseException) -> None:
    """End an episode on a backend or tool failure ``e``: ``stop_reason="error"``, the reason in
    ``metadata["error"]``, ``metadata["service_down"]`` from :func:`agent.scheduler.is_global`, reward 0."""
    traj.stop_reason = "error"
    traj.metadata["error"] = f"{type(e).__name__}: {e}"
    traj.metadata["service_down"] = is_global(e)  # a service unavailable, not this request's fault
    traj.reward, traj.verdict = 0.0, rule_verdict(None, traj.golden_answers) | {"format_ok": False}


async def arun_episodes(ctx: AgentContext, examples: list[QAExample], n_samples: int = 1) -> list[Trajectory]:
    """Run ``n_samples`` episodes per example concurrently; trajectories come back grouped by example
    (group id = example index), in order. The episodes run as one LangGraph graph over the whole batch
    (:func:`agent.batch_graph.arun_batch`), with the same steps and the same trajectories as
    :func:`run_episode` gives each of them."""
    from agent.batch_graph import arun_batch

    return await arun_batch(ctx, [(ex, i) for i, ex in enumerate(examples) for _ in range(n_samples)])


def stop_strings(cfg: Any) -> tuple[str, ...]:
    """Stop strings of the configured tool protocol (EOS always stops a turn as well)."""
    if getattr(cfg, "protocol", "search_r1") == "function_call":
        return function_call.STOP_STRINGS
    return protocol.STOP_STRINGS


def configured_llm_judge(judge_llm: LLM, cfg: Any) -> Judge:
    """The LLM judge of ``agent.judge: llm`` (:func:`agent.llm_judge.llm_judge` with ``cfg.llm_judge``'s
    options and ``cfg.reward``/``cfg.format_reward``, plus ReSeek's self-judge term) asking ``judge_llm``:
    the policy backend by default (:func:`make_context`), or the backend of ``agent.llm_judge.model`` that the
    composition root builds (``sleuth.pipeline.answer_judge``)."""
    from agent.llm_judge import llm_judge

    jc = cfg.llm_judge
    return with_self_judge(llm_judge(judge_llm, jc.unparseable, cfg.reward, cfg.format_reward, jc.max_new_tokens),
                           getattr(cfg, "self_judge_reward", 0.0))


def make_context(llm: LLM, retriever: Retriever | None, cfg: Any, *, temperature: float | None = None,
                 top_k: int = 3, judge: Judge | None = None, scheduler: Scheduler | None = None) -> AgentContext:
    """An :class:`AgentContext` for :func:`arun_episodes` / :func:`run_episode` (e.g. inside a server's
    event loop, where one scheduler is shared by all requests). With ``cfg.judge == "llm"`` and no
    ``judge`` given, the policy backend itself judges the answers (:func:`configured_llm_judge`).
    Raises ``ValueError`` when ``cfg.max_obs_tokens`` cannot hold an observation's framing and one token, or
    for ``agent.chat_template=on`` without a chat template (:func:`check_chat_template`)."""
    check_chat_template(llm.tokenizer, cfg)  # now, not at every episode's first prompt
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature if temperature is None else temperature,
                            top_p=cfg.top_p, stop=stop_strings(cfg))
    sched = scheduler or Scheduler(llm, retriever, max_batch=cfg.max_batch)
    if judge is None and getattr(cfg, "judge", "rule") == "llm":
        judge = configured_llm_judge(llm, cfg)
    ctx = AgentContext(sched, llm.tokenizer, cfg, params, top_k=top_k, judge=judge)
    frames = map(ctx.observation_frame, (None, getattr(llm.tokenizer, "eos_token", None)))  # without / with EOS
    frame = max(len(ctx.ids(head)) + len(ctx.ids(tail)) for head, tail in frames)
    if cfg.max_obs_tokens <= frame:  # else every episode would end at its first tool result, as max_tokens
        raise ValueError(f"agent.max_obs_tokens={cfg.max_obs_tokens} leaves no room for a tool result: its "
                         f"framing ({ctx.protocol} protocol) takes {frame} tokens; use more than {frame}")
    return ctx


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
