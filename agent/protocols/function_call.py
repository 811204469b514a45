"""Native function calling through the model's chat template (Qwen2.5-style ``<tool_call>`` JSON).

The policy calls the search tool as Qwen2.5 / Hermes models do::

    <tool_call>
    {"name": "search", "arguments": {"query": "capital of France"}}
    </tool_call>

and ends its turn (at ``</tool_call>`` or its end-of-turn token). The tool result is a ``tool``-role
message *rendered by the model's own chat template*; only the **delta** the template adds after the
assistant turn (close of the assistant turn if the policy did not emit it, the tool message, the next
assistant header) is tokenised and appended as tool tokens. The loop never re-renders or re-tokenises
earlier turns, so the token ids in the trajectory are exactly the ids the policy saw (the property
``tests/test_agent_exactness.py`` checks), while the decoded episode equals what the chat template renders
for the same conversation.

A turn without a tool call is the final answer (the text inside ``<answer>...</answer>`` when present, else
the whole turn; an unclosed ``<answer>``, a ``</answer>`` without one, or a turn without a closed ``<answer>``
that the token budget cut is malformed). Malformed calls (bad
or too deeply nested JSON, unknown function, missing or over-long query, two calls in one turn, an unclosed
``<tool_call>``, a ``</tool_call>`` without one) become ``invalid`` actions whose reason
is returned to the policy as the tool message, never an exception. Follows the Qwen2.5 function-calling
format (Hermes-style template).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from agent.llm import encode
from agent.protocols.base import JUDGE_INSTRUCTION, Action, ToolProtocol

STOP_STRINGS = ("</tool_call>",)
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge corpus (Wikipedia paragraphs) and return the top documents.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "the search query"}},
            "required": ["query"],
        },
    },
}
TOOLS = [SEARCH_TOOL]
SYSTEM = (
    "Answer the user's question. Call the search tool whenever you lack knowledge; you may call it as many "
    "times as you need. When you know the answer, reply with the answer only, inside <answer> and </answer>."
)

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MARK = "\u2063SLEUTH_MARK\u2063"  # invisible separator: never produced by a template itself


def messages(question: str, system: str = SYSTEM) -> list[dict[str, Any]]:
    """The opening conversation: a system message with the instruction and the user's question."""
    return [{"role": "system", "content": system}, {"role": "user", "content": question.strip()}]


def _need_chat_template(tokenizer: Any) -> None:
    """Raise ``ValueError`` naming the fix when ``tokenizer`` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("agent.protocol=function_call needs a tokenizer with a chat template "
                         "(e.g. a Qwen2.5-Instruct model); use agent.protocol=search_r1 otherwise")


def prompt_text(tokenizer: Any, question: str, self_judge: bool = False) -> str:
    """The rendered prompt (``add_generation_prompt=True``) with the search tool declared; ``self_judge`` adds
    ReSeek's instruction to rate each search result with ``<judge>`` to the system message.

    Raises ``ValueError`` if the tokenizer has no chat template (function calling needs one)."""
    _need_chat_template(tokenizer)
    system = SYSTEM + (" " + JUDGE_INSTRUCTION.strip() if self_judge else "")
    return tokenizer.apply_chat_template(messages(question, system), tools=TOOLS, add_generation_prompt=True,
                                         tokenize=False)


def prompt_ids(tokenizer: Any, question: str, self_judge: bool = False) -> list[int]:
    """Token ids of :func:`prompt_text` (the template writes its own special tokens, none are added)."""
    return encode(tokenizer, prompt_text(tokenizer, question, self_judge))


def parse_action(text: str, finish_reason: str = "stop", max_query_chars: int = 2000) -> Action:
    """Parse one assistant turn into an :class:`agent.protocols.base.Action`
    (``search``/``answer``/``invalid``)."""
    calls = _CALL_RE.findall(text)
    opened = text.count("<tool_call>")
    if opened > len(calls):
        return Action("invalid", error="unclosed <tool_call>")
    if not calls and "</tool_call>" in text:
        return Action("invalid", error="</tool_call> without <tool_call>")
    if len(calls) > 1:
        return Action("invalid", error=f"two tool calls in one turn ({len(calls)})")
    if calls:
        trailing = text[text.index("</tool_call>") + len("</tool_call>"):]
        try:
            call = json.loads(calls[0])
        except json.JSONDecodeError as e:
            return Action("invalid", error=f"tool call is not valid JSON ({e.msg})")
        except RecursionError:
            return Action("invalid", error="tool call JSON is nested too deeply")
        if not isinstance(call, dict):
            return Action("invalid", error="tool call must be a JSON object")
        if call.get("name") != "search":
            return Action("invalid", error=f"unknown tool {call.get('name')!r}; the only tool is 'search'")
        args = call.get("arguments")
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
            except RecursionError:
                return Action("invalid", error="tool call arguments are nested too deeply")
        query = args.get("query") if isinstance(args, dict) else None
        if not isinstance(query, str) or not query.strip():
            return Action("invalid", error="search needs a non-empty string argument 'query'")
        query = query.strip()
        if len(query) > max_query_chars:
            return Action("invalid", error=f"query of {len(query)} characters exceeds {max_query_chars}")
        return Action("search", content=query, trailing=trailing)
    m = _ANSWER_RE.search(text)
    if m is None and finish_reason == "length":  # a closed <answer> is whole even if the turn ran on after it
        return Action("invalid", error="turn ended by the token budget without a tool call or answer")
    if m is None and "<answer>" in text:
        return Action("invalid", error="unclosed <answer>")
    if m is None and "</answer>" in text:
        return Action("invalid", error="</answer> without <answer>")
    answer = (m.group(1) if m else text).strip()
    if not answer:
        return Action("invalid", error="empty answer")
    return Action("answer", content=answer, trailing=text[m.end():] if m else "")


@dataclass(frozen=True)
class ToolTemplate:
    """The pieces of text a chat template writes around one tool result, found once per tokenizer.

    ``close`` ends an assistant turn (e.g. ``<|im_end|>\\n``); ``before``/``after`` surround the tool
    message content up to and including the next assistant header."""

    close: str
    before: str
    after: str

    @classmethod
    def of(cls, tokenizer: Any) -> ToolTemplate:
        """Render a probe conversation with markers and split it. Raises ``ValueError`` when the template
        does not render a tool message after an assistant turn as a pure continuation (append-only).

        The probe's assistant turn is tried bare, then with a reasoning block: Qwen3's template writes an
        empty ``<think>`` block into the *last* assistant message only, so a bare probe renders differently
        once a tool message follows it, while a turn that already reasons renders the same either way.
        A tokenizer without a chat template is a ``ValueError`` naming ``agent.protocol=search_r1``."""
        _need_chat_template(tokenizer)
        for content in (_MARK, "<think>\nr\n</think>\n\n" + _MARK):
            base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]
            a = tokenizer.apply_chat_template(base, tools=TOOLS, tokenize=False)
            b = tokenizer.apply_chat_template(base + [{"role": "tool", "content": _MARK + "T" + _MARK}],
                                              tools=TOOLS, add_generation_prompt=True, tokenize=False)
            if b.startswith(a) and _MARK in a:
                close = a[a.rindex(_MARK) + len(_MARK):]
                before, _, after = b[len(a):].partition(_MARK + "T" + _MARK)
                return cls(close=close, before=before, after=after)
        raise ValueError("the chat template does not render a tool message as a continuation of the "
                         "conversation; function calling cannot keep an exact token record with it")

    def head(self, eos_text: str | None, ended_with_eos: bool) -> str:
        """Text appended before the tool content: the turn close (minus the end-of-turn token when the
        policy already emitted it) and the tool message header."""
        close = self.close
        if ended_with_eos and eos_text and close.startswith(eos_text):
            close = close[len(eos_text):]
        return close + self.before


INVALID_HINT = ("Error: invalid action ({reason}). Call the search tool with a JSON object "
                '{{"name": "search", "arguments": {{"query": ...}}}} or reply with <answer>...</answer>.')


class FunctionCalling(ToolProtocol):
    """Native function calling as a :class:`agent.protocols.base.ToolProtocol`: the prompt declares the search
    tool through the chat template, a turn is parsed by :func:`parse_action`, and a tool result is framed by
    the template's own tool message (:class:`ToolTemplate`, found on first use). Raises ``ValueError`` (naming
    ``agent.protocol=search_r1``) when the tokenizer has no chat template."""

    name = "function_call"
    stop_strings = STOP_STRINGS

    def __init__(self, tokenizer: Any, agent_cfg: Any):
        super().__init__(tokenizer, agent_cfg)
        self._template: ToolTemplate | None = None

    def prompt_ids(self, question: str) -> list[int]:
        return prompt_ids(self.tokenizer, question, getattr(self.cfg, "self_judge", False))

    def parse(self, text: str, finish_reason: str = "stop") -> Action:
        return parse_action(text, finish_reason, self.cfg.max_query_chars)

    def observation_frame(self, eos_text: str | None) -> tuple[str, str]:
        if self._template is None:
            self._template = ToolTemplate.of(self.tokenizer)
        return self._template.head(eos_text, eos_text is not None), self._template.after

    def invalid_hint(self, reason: str) -> str:
        return INVALID_HINT.format(reason=reason)
