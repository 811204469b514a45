"""The Search-R1 tag protocol (``agent.protocol: search_r1``): prompt, action parser and tool observations.

The policy writes ``<think>...</think>`` (optional), then exactly one action per turn:
``<search>query</search>`` or ``<answer>text</answer>``. The search tool answers with
``<information>Doc 1(Title: ...) ...</information>``, written as tool tokens. Follows Search-R1
(Jin et al., 2025, ``search_r1/llm_agent/generation.py``), with stricter, explicit handling of malformed
turns: every malformed action becomes an :class:`Action` of kind ``"invalid"`` whose ``error`` is shown to
the policy as an observation, never an exception.
"""

from __future__ import annotations

import re

from agent.protocols.base import JUDGE_INSTRUCTION, Action, ToolProtocol, user_message_ids

ACTION_TAGS = ("search", "answer")
STOP_STRINGS = ("</search>", "</answer>")
SPECIAL_TAGS = (
    "<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>",
)

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as you want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
SHORT_INSTRUCTION = "Question: {question}\n"

INVALID_HINT = (
    "My previous action is invalid ({reason}). If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer between <answer> "
    "and </answer>. Let me try again."
)

_TAG_RE = re.compile(r"<(/?)(" + "|".join(ACTION_TAGS) + r")>")


def parse_action(text: str, max_query_chars: int = 2000) -> Action:
    """Parse one policy turn.

    Rules (each pinned by a test): the first action tag opens the action and must be closed by its own
    closing tag; a second action tag in the same turn, an unclosed tag, a stray closing tag, an empty
    action, no action at all, and a query longer than ``max_query_chars`` characters are invalid; text
    after ``</answer>`` or ``</search>`` is ignored and reported in ``trailing``.
    """
    tags = list(_TAG_RE.finditer(text))
    if not tags:
        return Action("invalid", error="no <search> or <answer> action")
    first = tags[0]
    if first.group(1) == "/":
        return Action("invalid", error=f"</{first.group(2)}> without an opening tag")
    kind = first.group(2)
    if len(tags) < 2 or tags[1].group(2) != kind or tags[1].group(1) != "/":
        if len(tags) >= 2 and tags[1].group(1) == "":
            return Action("invalid", error=f"two actions in one turn (<{kind}> then <{tags[1].group(2)}>)")
        return Action("invalid", error=f"unclosed <{kind}> tag")
    content = text[first.end() : tags[1].start()].strip()
    trailing = text[tags[1].end() :]
    if any(t.group(1) == "" for t in tags[2:]):
        return Action("invalid", error="two actions in one turn")
    if not content:
        return Action("invalid", error=f"empty <{kind}>")
    if kind == "search" and len(content) > max_query_chars:
        return Action("invalid", error=f"query of {len(content)} characters exceeds {max_query_chars}")
    return Action(kind, content=content, trailing=trailing)


def build_prompt(question: str, short: bool = False, self_judge: bool = False) -> str:
    """The task prompt. ``short`` uses a one-line prompt (for the tiny from-scratch policy); ``self_judge``
    adds ReSeek's instruction to rate each retrieved block with ``<judge>``."""
    if short:
        return SHORT_INSTRUCTION.format(question=question.strip())
    instruction = INSTRUCTION.replace("Question: {question}", (JUDGE_INSTRUCTION if self_judge else "") + "Question: {question}")
    return instruction.format(question=question.strip())


class SearchR1(ToolProtocol):
    """The Search-R1 tag protocol as a :class:`agent.protocols.base.ToolProtocol`: the prompt through the
    model's chat template when it has one (``agent.chat_template`` auto/on), else the plain Search-R1
    instruction (or the one-line prompt for the tiny policy); observations framed by ``<information>``
    tags."""

    name = "search_r1"
    stop_strings = STOP_STRINGS

    def prompt_ids(self, question: str) -> list[int]:
        text = build_prompt(question, short=self.cfg.short_prompt, self_judge=getattr(self.cfg, "self_judge", False))
        return user_message_ids(self.tokenizer, text, self.cfg)

    def parse(self, text: str, finish_reason: str = "stop") -> Action:
        return parse_action(text, max_query_chars=self.cfg.max_query_chars)

    def observation_frame(self, eos_text: str | None) -> tuple[str, str]:
        return "\n\n<information>", "</information>\n\n"

    def invalid_hint(self, reason: str) -> str:
        return INVALID_HINT.format(reason=reason)

