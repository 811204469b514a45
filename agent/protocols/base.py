"""The tool protocol's interface: how the policy calls the search tool and how its answer is written back.

One :class:`ToolProtocol` object is chosen per run from ``agent.protocol``
(:func:`agent.protocols.build.make_protocol`) and the agent loop asks it for everything protocol-specific:
the task prompt, the parse of a policy turn into an :class:`Action`, the text framing a tool observation, the
hint after an invalid action and the stop strings. Two protocols ship:

* ``search_r1`` (:class:`agent.protocols.search_r1.SearchR1`): ``<search>``/``<answer>`` tags and
  ``<information>`` observations, as Search-R1 (Jin et al., 2025);
* ``function_call`` (:class:`agent.protocols.function_call.FunctionCalling`): native ``<tool_call>`` JSON
  through the model's chat template, the tool result a ``tool`` message rendered by that template.

What both share lives here, and nothing here knows either of them: the parsed :class:`Action`, ReSeek's
self-judge tag (:func:`split_judgement`), the rendering of retrieved documents (:func:`format_docs`) and the
plain-or-chat-template user prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agent.llm import encode
from retrieval.base import Hit


@dataclass(frozen=True)
class Action:
    """A parsed policy turn.

    ``kind`` is ``"search"``, ``"answer"`` or ``"invalid"``; ``content`` is the query or answer (stripped);
    ``error`` explains an invalid action; ``trailing`` is ignored text after the closing tag (a format fault
    that does not invalidate the action).
    """

    kind: str
    content: str = ""
    error: str | None = None
    trailing: str = ""

    @property
    def well_formed(self) -> bool:
        return self.kind != "invalid" and not self.trailing.strip()


class ToolProtocol:
    """The interface the agent loop talks to (one instance per run, bound to the policy's tokenizer and the
    :class:`agent.config.AgentConfig`). Subclasses set ``name`` and ``stop_strings`` and implement the
    four methods; none of them raises on a malformed turn (that is an ``invalid`` :class:`Action`)."""

    name: str = ""
    stop_strings: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any, agent_cfg: Any):
        self.tokenizer, self.cfg = tokenizer, agent_cfg

    def prompt_ids(self, question: str) -> list[int]:
        """Token ids of the task prompt for ``question``, ready for the policy's first turn."""
        raise NotImplementedError

    def parse(self, text: str, finish_reason: str = "stop") -> Action:
        """The action of one policy turn (``finish_reason``: the backend's, ``"stop"`` or ``"length"``)."""
        raise NotImplementedError

    def observation_frame(self, eos_text: str | None) -> tuple[str, str]:
        """The text written before and after a tool result. ``eos_text`` is the text of the end-of-turn token
        the policy's turn ended with (``None`` if it ended otherwise)."""
        raise NotImplementedError

    def invalid_hint(self, reason: str) -> str:
        """The tool observation after an invalid action (the reason, and how to call the tool)."""
        raise NotImplementedError


# -- the user prompt ----------------------------------------------------------------------------------
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


# -- ReSeek's self-judge (both protocols) ----------------------------------------------------------------
_JUDGE_RE = re.compile(r"<judge>(.*?)</judge>", re.DOTALL)
JUDGEMENTS = ("useful", "not useful")
JUDGE_INSTRUCTION = (
    "After you get new information, first rate it inside <judge> and </judge> as useful or not useful for "
    "the question; if it is not useful, plan a different search. "
)


def split_judgement(text: str) -> tuple[str | None, str | None, str]:
    """ReSeek's JUDGE action: pull ``<judge>useful|not useful</judge>`` out of a turn.

    Returns ``(judgement, error, rest)``: ``judgement`` is ``"useful"``, ``"not useful"`` or ``None`` (no
    judge tag); ``error`` explains a malformed judgement (two judge tags, another verdict, an unclosed
    tag); ``rest`` is the turn without the judge tag, to be parsed for the action.
    """
    found = _JUDGE_RE.findall(text)
    if not found:
        return None, ("unclosed <judge> tag" if "<judge>" in text else None), text
    if len(found) > 1:
        return None, "two <judge> tags in one turn", text
    verdict = " ".join(found[0].lower().split())
    rest = _JUDGE_RE.sub("", text, count=1)
    if verdict not in JUDGEMENTS:
        return None, f"<judge> must be 'useful' or 'not useful', got {found[0].strip()[:40]!r}", rest
    return verdict, None, rest


# -- retrieved documents --------------------------------------------------------------------------------
def format_docs(hits: list[Hit], max_doc_chars: int | None = None) -> str:
    """Render hits as Search-R1 does: ``Doc i(Title: <title>) <text>`` one per line (the body of an
    observation under either protocol)."""
    lines = []
    for i, h in enumerate(hits, start=1):
        text = h.text if max_doc_chars is None else h.text[:max_doc_chars]
        lines.append(f"Doc {i}(Title: {h.title}) {text}")
    return "\n".join(lines)


_DOC_LABEL_RE = re.compile(r"^Doc \d+\(Title: ", re.MULTILINE)


def docs_content(block: str) -> str:
    """The text of a :func:`format_docs` block without its ``Doc i(Title: `` labels (titles and passage
    texts kept): what the documents say, e.g. to look for a golden answer in it."""
    return _DOC_LABEL_RE.sub("", block)
