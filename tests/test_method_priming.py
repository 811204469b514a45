"""Behaviour priming's scripted oracle, rule-based labeller and SFT-set selectors (training.algos.priming)."""

import random
import re

import pytest

from agent.trajectory import Turn
from training.algos import priming as B

QUESTION = "In which country was Kalomi born?"
CHAIN = ["Kalomi", "Rutevo", "Sofade"]
TARGETS = CHAIN[1:]
POLANI = "Doc 1(Title: Polani) Polani was born in Mivaro."
RESULTS = {  # a stand-in retriever: what each query returns
    "Polani": POLANI,
    QUESTION: "Doc 1(Title: Mivaro) Mivaro lies in Tesaka.",  # the broad search misses
    "Kalomi": POLANI + "\nDoc 2(Title: Kalomi) Kalomi was born in Rutevo.",  # the page about Kalomi comes second
    "Rutevo": "Doc 1(Title: Rutevo) Rutevo lies in Sofade.",
    "Rutevo Sofade": "Doc 1(Title: Rutevo) Rutevo lies in Sofade.",
}
ACTION = re.compile(r"<(search|answer)> (.*?) </\1>")


def run(behaviours, distractor="Polani", think=False, results=RESULTS, max_turns=8):
    """Roll the oracle out against ``results``; returns the turns."""
    turns = []
    for k in range(1, max_turns + 1):
        text = B.primed_action(QUESTION, CHAIN, turns, behaviours, distractor, think)
        kind, content = ACTION.search(text).groups()
        if kind == "answer":
            turns.append(Turn(k, text, "answer", answer=content))
            return turns
        turns.append(Turn(k, text, "search", query=content, observation=results.get(content, "")))
    return turns


def test_parse_docs():
    assert B.parse_docs(RESULTS["Kalomi"]) == [("Polani", "Polani was born in Mivaro."),
                                               ("Kalomi", "Kalomi was born in Rutevo.")]
    assert B.parse_docs("My previous action is invalid.") == [] and B.parse_docs(None) == []


def test_plain_oracle_walks_the_chain():
    turns = run([])
    assert [t.query or t.answer for t in turns] == ["Kalomi", "Rutevo", "Sofade"]


def test_all_behaviours_act_out_each_one():
    turns = run(B.BEHAVIOURS)
    assert [t.query or t.answer for t in turns] == ["Polani", QUESTION, "Kalomi", "Rutevo", "Rutevo Sofade", "Sofade"]
    assert B.exhibited_behaviours(QUESTION, turns, TARGETS, "Sofade") == frozenset(B.BEHAVIOURS)


def test_the_labeller_on_single_behaviours():
    # the stand-in retriever lists Polani's page before Kalomi's: following the right one is authority already
    assert B.exhibited_behaviours(QUESTION, run([]), TARGETS, "Sofade") == {"authority"}
    fair = {**RESULTS, "Kalomi": "Doc 1(Title: Kalomi) Kalomi was born in Rutevo."}
    assert B.exhibited_behaviours(QUESTION, run([], results=fair), TARGETS, "Sofade") == frozenset()
    assert B.exhibited_behaviours(QUESTION, run(["verification"], results=fair), TARGETS, "Sofade") == {"verification"}
    assert B.exhibited_behaviours(QUESTION, run(["adaptive_search"], results=fair), TARGETS, "Sofade") == {
        "adaptive_search"}
    assert B.exhibited_behaviours(QUESTION, run(["error_recovery"], results=fair), TARGETS, "Sofade") == {
        "error_recovery"}


def test_adaptive_search_is_not_shown_when_the_broad_search_succeeds():
    lucky = {**RESULTS, QUESTION: "Doc 1(Title: Kalomi) Kalomi was born in Rutevo.",
             "Kalomi": "Doc 1(Title: Kalomi) Kalomi was born in Rutevo."}
    turns = run(["adaptive_search"], results=lucky)
    assert [t.query or t.answer for t in turns] == [QUESTION, "Rutevo", "Sofade"]
    assert "adaptive_search" not in B.exhibited_behaviours(QUESTION, turns, TARGETS, "Sofade")


def test_a_broad_query_of_the_callers_choice():
    text = B.primed_action(QUESTION, CHAIN, [], ["adaptive_search"], broad_query="country born")
    assert text == "<search> country born </search>"


def test_an_invalid_action_followed_by_a_valid_one_is_error_recovery():
    turns = [Turn(1, "<serch> x", "invalid", error="no action", observation="My previous action is invalid."),
             Turn(2, "<search> Kalomi </search>", "search", query="Kalomi", observation="")]
    assert B.exhibited_behaviours(QUESTION, turns, TARGETS) == {"error_recovery"}
    assert B.exhibited_behaviours(QUESTION, turns[:1], TARGETS) == frozenset()


def test_a_search_that_never_brings_the_link_is_not_repeated():
    turns = run([], results={"Kalomi": "Doc 1(Title: Polani) Polani was born in Mivaro."})
    assert [t.query or t.answer for t in turns] == ["Kalomi", "Sofade"]


def test_think_spells_out_the_behaviours():
    texts = [t.text for t in run(B.BEHAVIOURS, think=True)]
    assert texts[0] == "<search> Polani </search>"
    assert texts[1].startswith("<think> That search was off track; back to Kalomi. </think>")
    assert texts[2].startswith("<think> The search missed Rutevo; I narrow it to Kalomi. </think>")
    assert texts[3].startswith("<think> Doc 2 is the page about Kalomi; I trust it over Doc 1. </think>")
    assert texts[4].startswith("<think> Let me check that Sofade is right before answering. </think>")
    assert texts[5] == "<answer> Sofade </answer>"


def test_oracle_errors():
    with pytest.raises(ValueError, match="unknown behaviour"):
        B.primed_action(QUESTION, CHAIN, [], ["verify"])
    with pytest.raises(ValueError, match="chain needs"):
        B.primed_action(QUESTION, ["Kalomi"], [], [])


def test_pick_distractor_and_sample_behaviours():
    assert B.pick_distractor(["Kalomi", "Polani", "rutevo"], CHAIN, random.Random(0)) == "Polani"
    with pytest.raises(ValueError, match="no distractor"):
        B.pick_distractor(["Kalomi"], CHAIN, random.Random(0))
    assert B.sample_behaviours(random.Random(0), p=1.0) == frozenset(B.BEHAVIOURS)
    assert B.sample_behaviours(random.Random(0), p=0.0) == frozenset()


ALL = frozenset(B.BEHAVIOURS)
ITEMS = ["a", "b", "c", "d", "e", "f"]
LABELS = [ALL, ALL, frozenset({"verification"}), ALL, frozenset(), ALL]
CORRECT = [True, False, True, True, True, False]


def test_select_primed_by_behaviours_and_outcome():
    assert B.select_primed(ITEMS, LABELS, 2, random.Random(0), CORRECT) == ["a", "d"]
    assert B.select_primed(ITEMS, LABELS, 2, random.Random(0), CORRECT, outcome="incorrect") == ["b", "f"]
    assert sorted(B.select_primed(ITEMS, LABELS, 4, random.Random(0), outcome="any")) == ["a", "b", "d", "f"]
    assert B.select_primed(ITEMS, LABELS, 3, random.Random(0), CORRECT, required=["verification"]) == ["a", "c", "d"]
    with pytest.raises(ValueError, match="asked for 3 correct items showing .* only 2 of 6 qualify"):
        B.select_primed(ITEMS, LABELS, 3, random.Random(0), CORRECT)
    with pytest.raises(ValueError, match="needs the items' correctness"):
        B.select_primed(ITEMS, LABELS, 1, random.Random(0))
    with pytest.raises(ValueError, match="outcome"):
        B.select_primed(ITEMS, LABELS, 1, random.Random(0), CORRECT, outcome="right")
    with pytest.raises(ValueError, match="parallel"):
        B.select_primed(ITEMS, LABELS[:2], 1, random.Random(0), CORRECT)


def test_baselines_have_the_same_size():
    r = B.select_random(ITEMS, 2, random.Random(3))
    assert len(r) == 2 and set(r) <= set(ITEMS)
    c = B.select_correct(ITEMS, CORRECT, 4, random.Random(0))
    assert c == ["a", "c", "d", "e"]
    with pytest.raises(ValueError, match="asked for 7 items"):
        B.select_random(ITEMS, 7, random.Random(0))
    with pytest.raises(ValueError, match="asked for 5 correct items"):
        B.select_correct(ITEMS, CORRECT, 5, random.Random(0))


def test_behaviour_counts():
    assert B.behaviour_counts(LABELS) == {"verification": 5, "authority": 4, "adaptive_search": 4,
                                          "error_recovery": 4, "all": 4, "n": 6}


def test_oracle_and_labeller_on_a_real_bm25_index(retriever):
    """Against the fixture corpus's BM25 index, with the agent's own document format."""
    from agent.protocols.base import format_docs

    q, chain = "Where was the designer of the Eiffel Tower born?", ["Eiffel Tower", "Gustave Eiffel", "Dijon"]
    turns = []
    for k in range(1, 8):
        text = B.primed_action(q, chain, turns, B.BEHAVIOURS, distractor="Rhine")
        kind, content = ACTION.search(text).groups()
        if kind == "answer":
            turns.append(Turn(k, text, "answer", answer=content))
            break
        turns.append(Turn(k, text, "search", query=content, observation=format_docs(retriever.search([content], 1)[0])))
    # the broad question search already finds the designer's name, so no narrowing follows
    assert [t.query or t.answer for t in turns] == ["Rhine", q, "Gustave Eiffel", "Gustave Eiffel Dijon", "Dijon"]
    assert B.exhibited_behaviours(q, turns, chain[1:], "Dijon") == {"error_recovery", "verification"}
