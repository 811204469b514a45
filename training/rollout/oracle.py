"""Oracle trajectories for the SFT warm start, produced by the real agent loop.

:class:`OracleLLM` implements the :class:`agent.llm.LLM` protocol with a script instead of a network: it
searches the question, then (multi-hop) the title of a supporting paragraph it has not yet seen, then
answers with the gold answer. Because the oracle runs through the same LangGraph loop, tokenizer and
observation formatting as the policy, its trajectories have exactly the token layout the policy will
produce and be trained on (roles, turns, tool spans).
"""

from __future__ import annotations

import re
from typing import Any

from agent.llm import Generation, SamplingParams, decode, encode
from agent.protocols.search_r1 import INVALID_HINT
from corpora.formats import QAExample

_Q = re.compile(r"Question:\s*")


def _shown(title: str, context: str) -> bool:
    """Whether a ``Doc i(Title: <title>) ...`` label of ``title`` is in ``context``. Matched per known title,
    since the label alone is ambiguous when a title contains ``") "`` ("Queen (band) discography")."""
    return re.search(rf"Doc \d+\(Title: {re.escape(title)}\)(?: |$)", context, re.MULTILINE) is not None


_INFO = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_HINT_START = INVALID_HINT[: INVALID_HINT.index("{")]  # "My previous action is invalid ("


def searches_made(context: str, question: re.Match) -> int:
    """Searches answered in the episode so far: the ``<information>`` blocks after the question that are not
    the invalid-action hint (the full Search-R1 instruction before the question names the tags itself, and
    the hint names ``<search>``, so counting tags would count a cut search and the hint as searches)."""
    return sum(not m.group(1).lstrip().startswith(_HINT_START) for m in _INFO.finditer(context, question.end()))


class OracleLLM:
    """A scripted policy. ``titles_by_id`` maps corpus ids to titles (to name supporting paragraphs)."""

    def __init__(self, tokenizer: Any, examples: list[QAExample], titles_by_id: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.by_question = {" ".join(e.question.split()): e for e in examples}
        self._lengths = sorted({len(q) for q in self.by_question}, reverse=True)
        self.titles_by_id = titles_by_id or {}

    def _question(self, context: str) -> tuple[QAExample | None, re.Match | None]:
        """The example asked after ``Question:`` in ``context`` (whitespace-normalised; the longest known
        question the text starts with, ending at a non-alphanumeric character, since a chat template may
        trim the newline after it and put its end-of-turn marker there), and the ``Question:`` match."""
        m = _Q.search(context)
        if m is None or not self._lengths:
            return None, m
        rest = " ".join(context[m.end() : m.end() + 2 * self._lengths[0] + 64].split())
        for n in self._lengths:
            ex = self.by_question.get(rest[:n]) if n <= len(rest) else None
            if ex is not None and (n == len(rest) or not rest[n].isalnum()):
                return ex, m
        return None, m

    def _action(self, context: str) -> str:
        ex, m = self._question(context)
        if ex is None:
            return "<answer> unknown </answer>"
        searches = searches_made(context, m)
        if searches == 0:
            return f"<search> {ex.question} </search>"
        wanted = [self.titles_by_id[i] for i in ex.metadata.get("supporting_ids", []) if i in self.titles_by_id]
        missing = [t for t in wanted if not _shown(t, context)]
        if missing and searches < 2:
            return f"<search> {missing[0]} </search>"
        return f"<answer> {ex.golden_answers[0]} </answer>"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One scripted turn per prompt. A search longer than ``params.max_new_tokens`` drops words from the
        end of its query until ``<search> q </search>`` fits (a cut ``</search>`` is an invalid turn); what
        still does not fit is cut, with finish_reason ``"length"``."""
        outs = []
        for p in prompts:
            text = self._action(decode(self.tokenizer, p))
            ids = encode(self.tokenizer, text)
            words = text[len("<search> "):-len(" </search>")].split() if text.startswith("<search> ") else []
            while len(ids) > params.max_new_tokens and len(words) > 1:
                words.pop()
                ids = encode(self.tokenizer, f"<search> {' '.join(words)} </search>")
            reason = "stop" if len(ids) <= params.max_new_tokens else "length"
            ids = ids[: params.max_new_tokens]
            outs.append(Generation(ids, decode(self.tokenizer, ids), reason))
        return outs


class ChainOracleLLM(OracleLLM):
    """The oracle of the synthetic multi-hop task (:mod:`corpora.synthetic`): for an ``h``-hop question with
    ``metadata["chain"] = [e_0, ..., e_h]`` it searches ``e_0, ..., e_{h-1}`` in turn (each read from the
    previous observation) and answers ``e_h``: the shortest correct trajectory."""

    def _action(self, context: str) -> str:
        ex, m = self._question(context)
        if ex is None or "chain" not in ex.metadata:
            return "<answer> unknown </answer>"
        chain, hops = ex.metadata["chain"], int(ex.metadata["hops"])
        searches = searches_made(context, m)
        if searches < hops:
            return f"<search> {chain[searches]} </search>"
        return f"<answer> {chain[hops]} </answer>"


class ToolCallOracleLLM(OracleLLM):
    """The oracle of an external agent (``agent.kind: external``), played behind the training proxy while the
    agent runs unchanged: the same script as :class:`ChainOracleLLM` on the synthetic task (every example has a
    ``chain``) and as :class:`OracleLLM` otherwise (the question, then a missing supporting title, then the
    gold answer), written as the agent's chat model writes it: a call of the search tool ``tool`` (argument
    ``argument``) or ``<answer> ... </answer>``, each ended with EOS.

    The call's text is what ``chat_template`` (``None``: the tokenizer's own) renders for an assistant message
    holding that tool call, so the proxy's next prompt extends the sampled ids (no split training sequence)
    whatever the template's tool-call format. The question is the longest known one in the prompt; the
    searches made are the calls rendered after it. Raises ``ValueError`` when the template renders no
    assistant turn after its generation prompt (a tool call could not be written in its format)."""

    def __init__(self, tokenizer: Any, examples: list[QAExample], titles_by_id: dict[str, str] | None = None,
                 chat_template: str | None = None, tool: str = "search", argument: str = "query"):
        super().__init__(tokenizer, examples, titles_by_id)
        self.chat_template, self.tool, self.argument = chat_template, tool, argument
        self.chains = bool(examples) and all("chain" in e.metadata for e in examples)
        self._known = sorted(((e.question, e) for e in examples), key=lambda qe: len(qe[0]), reverse=True)
        a, b = self.call_text("a"), self.call_text("b")
        self._call_prefix = a[: next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)]

    def call_text(self, query: str) -> str:
        """The text of a turn that calls the search tool with ``query``, in the chat template's format, up to
        (without) its end-of-turn token."""
        head = [{"role": "user", "content": "?"}]
        call = {"id": "call_0", "type": "function", "function": {"name": self.tool, "arguments": {self.argument: query}}}

        def render(msgs: list[dict[str, Any]], gen: bool) -> str:
            return self.tokenizer.apply_chat_template(msgs, chat_template=self.chat_template,
                                                      add_generation_prompt=gen, tokenize=False)

        prompt = render(head, True)
        full = render([*head, {"role": "assistant", "content": "", "tool_calls": [call]}], False)
        if not full.startswith(prompt) or query not in full[len(prompt):]:
            raise ValueError("the chat template renders no assistant tool call after its generation prompt: the "
                             "oracle cannot write a tool call in its format")
        text = full[len(prompt):]
        eos = self.tokenizer.eos_token
        return text[: text.index(eos)] if eos and eos in text else text.rstrip()

    def _plan(self, context: str) -> tuple[str, str]:
        """``("search", query)`` or ``("answer", answer)`` for the conversation rendered in ``context``."""
        found = next(((q, ex) for q, ex in self._known if q in context), None)
        if found is None:
            return "answer", "unknown"
        q, ex = found
        searches = context.count(self._call_prefix, context.index(q))  # the user turn: before any call
        if self.chains:
            chain, hops = ex.metadata["chain"], int(ex.metadata["hops"])
            return ("search", chain[searches]) if searches < hops else ("answer", chain[hops])
        if searches == 0:
            return "search", ex.question
        wanted = [self.titles_by_id[i] for i in ex.metadata.get("supporting_ids", []) if i in self.titles_by_id]
        missing = [t for t in wanted if not _shown(t, context)]
        if missing and searches < 2:
            return "search", missing[0]
        return "answer", ex.golden_answers[0]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One scripted turn per prompt, its ids ending with EOS (in the ids, not the text, as a sampling
        backend returns them). A search over ``params.max_new_tokens`` drops words from the end of its
        query until it fits; what still does not fit is cut, with finish_reason ``"length"``."""
        outs = []
        for p in prompts:
            kind, value = self._plan(decode(self.tokenizer, p))
            words = value.split()
            while True:
                text = self.call_text(" ".join(words)) if kind == "search" else f"<answer> {value} </answer>"
                ids = [*encode(self.tokenizer, text), self.tokenizer.eos_token_id]
                if len(ids) <= params.max_new_tokens or kind != "search" or len(words) <= 1:
                    break
                words.pop()
            reason = "stop" if len(ids) <= params.max_new_tokens else "length"
            ids = ids[: params.max_new_tokens]
            outs.append(Generation(ids, text if reason == "stop" else decode(self.tokenizer, ids), reason,
                                   [0.0] * len(ids)))
        return outs
