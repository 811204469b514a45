"""Token records of agents that talk to the policy through an OpenAI-compatible API
(:mod:`agent.external.proxy`).

An external agent (a LangGraph graph, a ``ChatOpenAI`` model with tools) sends whole conversations; the
policy sees token ids. For each call the proxy keeps the exact prompt ids it sent the backend and the ids
the backend sampled, with their log-probabilities (:class:`Call`), and :class:`EpisodeLog` stitches the
calls of one episode into :class:`~agent.trajectory.Trajectory` records, the same structure the built-in
loop (:mod:`agent.loop`) writes: the first prompt as prompt tokens (turn 0), each call's sampled ids as policy
tokens of turn ``k`` (the only trained tokens), and the tokens between one call's output and the next call's
prompt end (tool results, the template's turn frames) as tool tokens of turn ``k``.

History is never re-tokenised. A chat call whose rendered conversation continues, *in text*, the previous
call's rendered prompt plus its sampled output gets the previous ids plus the ids of the new text only
(:func:`render_prompt`), so the earlier sampled ids are kept even where the tokenizer would split their
text otherwise. A call whose prompt does not extend the previous call's ids (a chat template that rewrites
history: Qwen3 drops earlier ``<think>`` blocks; an agent that edits or trims its messages) starts a new
training sequence whose prompt is that whole rendering, masked; ``EpisodeLog.splits`` counts those
(the trainer reports them), so no token is ever trained that the backend did not sample at that place.

Tool calls in a sampled turn are read in the Hermes / Qwen2.5 format (``<tool_call>{"name", "arguments"}
</tool_call>``) or as Llama 3.1's bare JSON object (``{"name", "parameters"}``) (:func:`parse_tool_calls`);
this follows vLLM's ``hermes`` and ``llama3_json`` tool parsers.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from agent.llm import decode, encode
from agent.trajectory import Role, Trajectory, Turn

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class Call:
    """One completion of an episode: ``prompt_ids`` (what the backend was asked to continue), ``output_ids``
    and ``logprobs`` (what it sampled, one natural-log probability per id, ``None`` when the backend gives
    none), the rendered prompt ``text`` (chat calls; ``None`` for token prompts), ``finish_reason`` and the
    parsed turn (``action`` ``"tool"``, ``"search"``, ``"answer"`` or ``"invalid"``, ``query``, ``error``)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None
    output_text: str
    finish_reason: str = "stop"
    text: str | None = None
    n_messages: int = 0
    action: str = "answer"
    query: str | None = None
    error: str | None = None


@dataclass
class EpisodeLog:
    """The calls of one episode, in order; ``splits`` counts the calls whose prompt did not extend the previous
    call's prompt and output (each starts a new training sequence)."""

    id: str
    calls: list[Call] = field(default_factory=list)
    splits: int = 0
    starts: list[int] = field(default_factory=list)  # index of the call that starts each sequence

    @property
    def context_ids(self) -> list[int]:
        """The ids the next call must start with to continue the sequence: the last prompt and its output."""
        if not self.calls:
            return []
        last = self.calls[-1]
        return last.prompt_ids + last.output_ids

    def add(self, call: Call) -> bool:
        """Append ``call``; returns whether it continues the current sequence (its prompt starts with
        :attr:`context_ids`). A call that does not starts a new sequence and counts in ``splits``."""
        ctx = self.context_ids
        extends = bool(self.calls) and call.prompt_ids[: len(ctx)] == ctx
        if not extends:
            if self.calls:
                self.splits += 1
            self.starts.append(len(self.calls))
        self.calls.append(call)
        return extends

    def trajectories(self, question_id: str, question: str, golden_answers: list[str] | None = None,
                     group: int = 0, answer: str | None = None) -> list[Trajectory]:
        """The episode as training sequences (one, or one per split), each a :class:`Trajectory` with the
        token roles of the built-in loop; every one gets ``answer``, ``group`` and ``metadata`` ``episode``,
        ``segment`` (0-based) and ``segments``. Rewards are the caller's (one judgement per episode)."""
        out = []
        bounds = self.starts + [len(self.calls)]
        for s, (a, b) in enumerate(itertools.pairwise(bounds)):
            t = Trajectory(question_id=question_id, question=question, golden_answers=list(golden_answers or []),
                           group=group, answer=answer,
                           metadata={"episode": self.id, "segment": s, "segments": len(bounds) - 1})
            for k in range(a, b):
                call, turn = self.calls[k], k + 1
                if k == a:
                    t.append(call.prompt_ids, Role.PROMPT, 0)
                else:
                    t.turns[-1].n_tool_tokens = len(call.prompt_ids) - len(t)
                    t.append(call.prompt_ids[len(t):], Role.TOOL, turn - 1)
                lps = call.logprobs if call.logprobs is not None and len(call.logprobs) == len(call.output_ids) \
                    else None
                t.append(call.output_ids, Role.POLICY, turn, lps)
                t.turns.append(Turn(index=turn, text=call.output_text, action=call.action, query=call.query,
                                    answer=call.output_text if call.action == "answer" else None, error=call.error,
                                    n_policy_tokens=len(call.output_ids)))
            out.append(t)
        return out


# -- chat rendering -----------------------------------------------------------------------------------
def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages in the shape Hugging Face chat templates render: content parts joined into one
    string (text parts only), ``None`` content as ``""``, tool-call ``arguments`` given as a JSON string parsed
    into an object (as vLLM does before rendering; a string that is not JSON is kept)."""
    out = []
    for m in messages:
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):
            m["content"] = "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
        elif c is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                tc = dict(tc)
                fn = dict(tc.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                tc["function"] = fn
                calls.append(tc)
            m["tool_calls"] = calls
        out.append(m)
    return out


def encode_delta(tokenizer: Any, delta: str, contents: list[str]) -> list[int]:
    """Token ids of ``delta`` (template text with the new messages' ``contents`` in it, in order), each content
    found in it tokenised on its own and the template text around it on its own, as the built-in loop
    tokenises a tool result apart from its framing (so a tool's text never merges with a template token)."""
    ids: list[int] = []
    pos = 0
    for c in contents:
        j = delta.find(c, pos) if c else -1
        if j < 0:
            continue
        if j > pos:
            ids += encode(tokenizer, delta[pos:j])
        ids += encode(tokenizer, c)
        pos = j + len(c)
    if pos < len(delta):
        ids += encode(tokenizer, delta[pos:])
    return ids


def render_prompt(tokenizer: Any, log: EpisodeLog | None, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, chat_template: str | None = None) -> tuple[list[int], str]:
    """The prompt ids and rendered text of a chat call (``add_generation_prompt=True``). When ``log``'s last
    call was a chat call whose prompt text and sampled text the new rendering starts with, the ids are that
    call's prompt and output ids plus the new text's ids (:func:`encode_delta`); otherwise the whole rendering
    is tokenised (a first call, or a template that rewrote history). ``chat_template`` replaces the
    tokenizer's. Raises what the chat template raises (``jinja2`` errors, ``ValueError`` without a template)."""
    rendered = tokenizer.apply_chat_template(chat_messages(messages), tools=tools or None, chat_template=chat_template,
                                             add_generation_prompt=True, tokenize=False)
    if log is not None and log.calls and log.calls[-1].text is not None:
        last = log.calls[-1]
        prev = last.text + decode(tokenizer, last.output_ids)
        if rendered.startswith(prev):
            new = [m for m in messages[last.n_messages:] if m.get("role") != "assistant"]
            contents = [c for c in (chat_messages([m])[0]["content"] for m in new) if isinstance(c, str)]
            return log.context_ids + encode_delta(tokenizer, rendered[len(prev):], contents), rendered
    return encode(tokenizer, rendered), rendered


# -- tool calls ---------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_obj(obj: Any) -> dict[str, Any] | None:
    """``{"name", "arguments": <JSON string>}`` of a decoded call object, or ``None`` if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]], str | None]:
    """Split a sampled turn into ``(content, tool_calls, error)``.

    Hermes / Qwen2.5 blocks ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one or more): the
    content is the text before the first block, stripped; a turn that is one bare JSON object with ``name``
    and ``parameters`` (or ``arguments``) is a Llama 3.1 call with empty content. Each call is
    ``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``. A malformed call (not
    JSON, not an object with a name and object arguments, an unclosed ``<tool_call>``) leaves the whole text
    as content, no calls, and says why in ``error`` (vLLM answers such a turn as plain text too). Errors:
    none raised."""
    def wrap(c: dict[str, Any]) -> dict[str, Any]:
        return {"id": new_call_id(), "type": "function", "function": c}

    if "<tool_call>" in text:
        blocks = _CALL_RE.findall(text)
        if text.count("<tool_call>") > len(blocks):
            return text, [], "unclosed <tool_call>"
        calls = []
        for b in blocks:
            try:
                c = _call_obj(json.loads(b))
            except (ValueError, RecursionError):
                c = None
            if c is None:
                return text, [], "a tool call is not a JSON object with a name and object arguments"
            calls.append(wrap(c))
        return text[: text.index("<tool_call>")].strip(), calls, None
    s = text.strip()
    if s.startswith("{") and s.endswith("}"):
        try:
            c = _call_obj(json.loads(s))
        except (ValueError, RecursionError):
            c = None
        if c is not None:
            return "", [wrap(c)], None
    return text, [], None


def turn_action(content: str, calls: list[dict[str, Any]], error: str | None,
                search_tool: str = "search") -> tuple[str, str | None]:
    """The :class:`~agent.trajectory.Turn` ``(action, query)`` of a parsed turn: ``search`` (one call of the
    tool named ``search_tool``, ``query`` its ``query`` argument), ``tool`` (other calls), ``invalid`` (a
    malformed call), else ``answer``."""
    if error:
        return "invalid", None
    if not calls:
        return "answer", None
    if len(calls) == 1 and calls[0]["function"]["name"] == search_tool:
        q = json.loads(calls[0]["function"]["arguments"]).get("query")
        return "search", q if isinstance(q, str) else None
    return "tool", None
