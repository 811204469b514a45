"""Shared fixtures for the eval tests (no tests here): tiny deterministic stand-ins for an LLM backend and a retriever.

``CharTokenizer`` maps characters to code points (exact round trip, no special tokens). ``ScriptedLLM``
implements :class:`agent.llm.LLM`: it decodes each prompt and answers by a fixed script that covers every
evaluation method (forced ``<answer>``, IRCoT ``<think>`` steps, and agent turns), honouring stop strings
and ``max_new_tokens`` like a real backend.
"""

from __future__ import annotations

import re

from agent.llm import Generation, SamplingParams
from corpora.formats import QAExample
from retrieval.base import Hit


class CharTokenizer:
    bos_token_id = None
    eos_token_id = 0
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(i) for i in ids)


_Q = re.compile(r"Question:\s*(.*?)\n")
_TITLE = re.compile(r"Doc \d+\(Title: (.*?)\)")


class ScriptedLLM:
    """Knows the answer to questions in ``known`` (direct); otherwise answers with the title of the first
    retrieved document. Records every prompt it saw (``self.prompts``) and counts calls.

    IRCoT steps: ``ircot_sentences`` "Look up hopN." sentences, then "So the answer is <last title>."; or, with
    ``ircot_text`` (one for all questions, or one per question), that fixed chain of thought continued from
    wherever the prompt's ``<think>`` stops."""

    def __init__(self, known: dict[str, str] | None = None, ircot_sentences: int = 2,
                 ircot_text: str | dict[str, str] | None = None):
        self.tokenizer = CharTokenizer()
        self.known = known or {}
        self.ircot_sentences = ircot_sentences
        self.ircot_text = ircot_text
        self.prompts: list[str] = []
        self.calls = 0

    def _respond(self, ctx: str) -> str:
        m = _Q.search(ctx)
        q = m.group(1).strip() if m else ""
        titles = _TITLE.findall(ctx)
        if ctx.endswith("<answer>"):
            return (titles[0] if titles else self.known.get(q, "unknown")) + "</answer>"
        if "<think>" in ctx and "</think>" not in ctx.rsplit("<think>", 1)[1]:  # IRCoT: one sentence per call
            if self.ircot_text is not None:
                script = self.ircot_text if isinstance(self.ircot_text, str) else self.ircot_text[q]
                so_far = ctx.rsplit("<think>", 1)[1].lstrip(" ")
                assert script.startswith(so_far), (so_far, script)
                return script[len(so_far):]
            done = ctx.rsplit("<think>", 1)[1].count(".")
            if done < self.ircot_sentences:
                return f"Look up hop{done + 1}."
            return f"So the answer is {titles[-1] if titles else 'nothing'}."
        if ctx.count("<search>") == 0:  # agent, first turn
            return f"<think>need facts</think><search> {q} </search>"
        return f"<answer> {titles[0] if titles else 'unknown'} </answer>"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.calls += 1
        outs = []
        for p in prompts:
            ctx = self.tokenizer.decode(p)
            self.prompts.append(ctx)
            text = self._respond(ctx)
            cut = min((text.find(s) + len(s) for s in params.stop if s in text), default=len(text))
            text = text[: min(cut, params.max_new_tokens)]
            outs.append(Generation(self.tokenizer.encode(text), text, "stop" if cut <= params.max_new_tokens else "length"))
        return outs


class KeywordRetriever:
    """Ranks a fixed list of passages by word overlap between the query and the passage title + text
    (ties by corpus order). Records every batch of queries (``self.batches``)."""

    def __init__(self, passages: list[tuple[str, str, str]]):
        self.passages = [Hit(id=i, title=t, contents=f"{t}\n{x}", score=0.0) for i, t, x in passages]
        self.batches: list[list[str]] = []

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        if k < 1:
            raise ValueError("k must be >= 1")
        self.batches.append(list(queries))
        out = []
        for q in queries:
            words = set(re.findall(r"\w+", q.lower()))
            scored = []
            for rank, h in enumerate(self.passages):
                overlap = len(words & set(re.findall(r"\w+", h.contents.lower())))
                scored.append((-overlap, rank, h))
            scored.sort(key=lambda x: (x[0], x[1]))
            out.append([Hit(h.id, h.title, h.contents, float(-s)) for s, _, h in scored[:k]])
        return out


PASSAGES = [
    ("p0", "Paris", "Paris is the capital of France."),
    ("p1", "Rome", "Rome is the capital of Italy. hop2"),
    ("p2", "Berlin", "Berlin is the capital of Germany. hop1"),
    ("p3", "Madrid", "Madrid is the capital of Spain."),
]


def examples(n: int = 3) -> list[QAExample]:
    qs = [
        ("q0", "What is the capital of France?", ["Paris"], ["p0"]),
        ("q1", "What is the capital of Italy?", ["Rome"], ["p1", "p2"]),
        ("q2", "What is the capital of Spain?", ["Madrid"], ["p3"]),
        ("q3", "Which city hosts the Bundestag?", ["Berlin"], ["p2"]),
    ]
    return [QAExample(id=i, question=q, golden_answers=a, metadata={"supporting_ids": s, "hops": 2})
            for i, q, a, s in qs[:n]]
