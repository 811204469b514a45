"""The Search-R1 tag protocol (agent.protocols.search_r1), rule by rule with exact actions: an action is
closed by its *own* closing tag (``<search> q </answer>`` is not a search), both sides of the query-length
bound, and the protocol object's prompt, frames and hint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent.protocols.base import Action
from agent.protocols.search_r1 import INSTRUCTION, SearchR1, build_prompt, parse_action


@pytest.mark.parametrize("text,want", [
    ("<search> capital of France </search>", Action("search", "capital of France")),
    ("<think>need it</think>\n<search>\n q \n</search>", Action("search", "q")),
    ("<answer> Paris </answer>", Action("answer", "Paris")),
    ("<answer> Paris </answer>\nmore", Action("answer", "Paris", trailing="\nmore")),
    ("<search> q </search></answer>", Action("search", "q", trailing="</answer>")),  # a stray closer after: trailing
    # the closing tag must be the action's own
    ("<search> q </answer>", Action("invalid", error="unclosed <search> tag")),
    ("<answer> Paris </search>", Action("invalid", error="unclosed <answer> tag")),
    ("<search> q", Action("invalid", error="unclosed <search> tag")),
    ("<answer> Paris", Action("invalid", error="unclosed <answer> tag")),
    ("<search> a <answer> b </answer>", Action("invalid", error="two actions in one turn (<search> then <answer>)")),
    ("<search> a <search> b </search>", Action("invalid", error="two actions in one turn (<search> then <search>)")),
    ("<search> a <answer> b", Action("invalid", error="two actions in one turn (<search> then <answer>)")),
    ("<search> a </search><answer> b </answer>", Action("invalid", error="two actions in one turn")),
    ("<answer> a </answer> <search> b", Action("invalid", error="two actions in one turn")),
    ("</answer> Paris", Action("invalid", error="</answer> without an opening tag")),
    ("</search> q <search> q </search>", Action("invalid", error="</search> without an opening tag")),
    ("<search>   </search>", Action("invalid", error="empty <search>")),
    ("<answer></answer>", Action("invalid", error="empty <answer>")),
    ("I think the answer is Paris", Action("invalid", error="no <search> or <answer> action")),
    ("", Action("invalid", error="no <search> or <answer> action")),
    ("<Search> q </Search>", Action("invalid", error="no <search> or <answer> action")),  # tags are exact
    ("<information> x </information>", Action("invalid", error="no <search> or <answer> action")),
])
def test_parse_action(text, want):
    assert parse_action(text) == want


def test_query_length_bound_both_sides():
    assert parse_action("<search> abcde </search>", max_query_chars=5) == Action("search", "abcde")
    assert parse_action("<search> abcdef </search>", max_query_chars=5) == Action(
        "invalid", error="query of 6 characters exceeds 5")
    assert parse_action("<answer> abcdef </answer>", max_query_chars=5) == Action("answer", "abcdef")  # answers: no bound
    assert parse_action("<search>" + "x" * 2000 + "</search>").kind == "search"  # the default bound, 2000
    assert parse_action("<search>" + "x" * 2001 + "</search>").error == "query of 2001 characters exceeds 2000"


def test_well_formed():
    assert parse_action("<answer> a </answer>").well_formed
    assert not parse_action("<answer> a </answer> b").well_formed
    assert parse_action("<answer> a </answer> \n").well_formed  # whitespace after the action is no fault
    assert not parse_action("<answer> a").well_formed


def test_build_prompt():
    assert build_prompt("  Who?  ", short=True) == "Question: Who?\n"
    full = build_prompt("Who?")
    assert full == INSTRUCTION.format(question="Who?") and full.endswith("Question: Who?\n")
    judged = build_prompt("Who?", self_judge=True)
    assert judged != full and judged.endswith("Question: Who?\n") and "<judge>" in judged
    assert judged.startswith(full[: full.index("Question: ")])


class CharTokenizer:
    bos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_protocol_object():
    cfg = SimpleNamespace(max_query_chars=3, short_prompt=True, chat_template="auto")
    proto = SearchR1(CharTokenizer(), cfg)
    assert proto.prompt_ids("Who?") == [ord(c) for c in "Question: Who?\n"]
    long = SearchR1(CharTokenizer(), SimpleNamespace(short_prompt=False, self_judge=True, chat_template="off"))
    assert long.prompt_ids("Who?") == [ord(c) for c in build_prompt("Who?", self_judge=True)]
    plain = SearchR1(CharTokenizer(), SimpleNamespace(short_prompt=False, chat_template="off"))  # no self_judge: off
    assert plain.prompt_ids("Who?") == [ord(c) for c in build_prompt("Who?")]
    assert proto.name == "search_r1" and proto.stop_strings == ("</search>", "</answer>")
    assert proto.parse("<search> abc </search>") == Action("search", "abc")
    assert proto.parse("<search> abcd </search>") == Action("invalid", error="query of 4 characters exceeds 3")
    assert proto.observation_frame(None) == ("\n\n<information>", "</information>\n\n")
    assert proto.observation_frame("</s>") == ("\n\n<information>", "</information>\n\n")
    assert proto.invalid_hint("empty <search>") == (
        "My previous action is invalid (empty <search>). If I want to search, I should put the query between "
        "<search> and </search>. If I want to give the final answer, I should put the answer between <answer> "
        "and </answer>. Let me try again.")
