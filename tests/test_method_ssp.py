"""Search self-play's proposer filter, RAG verification and rewards (training.algos.ssp)."""

import random

import pytest
import torch

from training.algos import ssp as P

Q = "In which country is the town where the author of the lighthouse novel was born located?"  # 16 words
DOCS = ["Doc 1(Title: Rutevo) Rutevo lies in Sofade.", "<information>Doc 1(Title: Kalomi) Kalomi was born in Rutevo.</information>"]


def close(x, y):
    torch.testing.assert_close(x.float(), torch.tensor(y, dtype=torch.float32), atol=1e-6, rtol=0)


def test_options():
    o = P.ssp_options()
    assert (o.reward_type, o.format_penalty, o.min_question_words, o.min_searches, o.noisy_materials) == (
        "1-acc", -1.0, 10, 2, 0)
    for bad, match in [({"reward_type": "acc"}, "reward_type"), ({"left": 1.0}, "left < right"),
                       ({"format_penalty": 0.1}, "format_penalty"), ({"min_searches": -1}, "min_searches"),
                       ({"max_question_chars": 5}, "below min_question_chars"),
                       ({"min_search": 1}, "did you mean 'min_searches'")]:
        with pytest.raises(ValueError, match=match):
            P.ssp_options(bad)


def test_prompts():
    assert "Answer: Sofade\n" in P.proposer_prompt("Sofade") and "<answer>" in P.proposer_prompt("Sofade")
    assert P.proposer_prompt(" Sofade ", short=True) == "Answer: Sofade\n"
    r = P.rag_prompt("Where  is it?", "Doc 1 x\n")
    assert r.endswith("Documents:\nDoc 1 x\nQuestion: Where is it?\n") and "without searching" in r


def test_extract_question():
    assert P.extract_question("  Where is\n it? ") == "Where is it?"
    assert P.extract_question("Where is it? </answer") == "Where is it?"
    assert P.extract_question("<answer></answer>") is None
    assert P.extract_question(None) is None


def test_a_good_proposal_passes():
    assert P.proposal_rejection(Q, "Sofade", ["Kalomi", "Rutevo"], DOCS, P.ssp_options()) is None


@pytest.mark.parametrize("question, gold, queries, docs, opts, reason", [
    (None, "Sofade", ["a", "b"], DOCS, {}, "no question"),
    ("Short?", "Sofade", ["a", "b"], DOCS, {}, "6 characters"),
    ("x" * 1001, "Sofade", ["a", "b"], DOCS, {}, "1001 characters"),
    ("Where was the author of the novel born?", "Sofade", ["a", "b"], DOCS, {}, "8 words"),
    (Q + " (not sofade)", "Sofade", ["a", "b"], DOCS, {}, "the answer is in the question"),
    (Q, "Sofade", ["a", "b"], [None, ""], {}, "no retrieved material"),
    (Q, "Sofade", ["a"], DOCS, {}, "1 searches"),
    (Q, "Sofade", ["a", " a "], DOCS, {}, "a repeated query"),
    (Q, "Sofade", ["a", "Sofade currency"], DOCS, {"forbid_answer_in_queries": True}, "in a query"),
])
def test_rejections(question, gold, queries, docs, opts, reason):
    assert reason in P.proposal_rejection(question, gold, queries, docs, P.ssp_options(opts))


def test_length_bounds_both_sides():
    o = P.ssp_options({"min_question_words": 4, "min_question_chars": 10})
    assert P.proposal_rejection("Where is it now?", "X", ["a", "b"], DOCS, o) is None  # 4 words, 16 chars
    assert "3 words" in P.proposal_rejection("Where is it?", "X", ["a", "b"], DOCS, o)
    assert P.proposal_rejection(Q, "Sofade", ["a", "b"], DOCS, P.ssp_options({"forbid_answer_in_queries": True})) is None


def test_rag_materials_strip_frames_and_skip_empty():
    assert P.rag_materials(DOCS + [None, "  "]) == (
        "Doc 1(Title: Rutevo) Rutevo lies in Sofade.\n\nDoc 1(Title: Kalomi) Kalomi was born in Rutevo.")


def test_noisy_materials():
    assert P.mix_noisy_materials("M", ["a", "b"], 0, random.Random(0)) == "M"
    mixed = P.mix_noisy_materials("M", ["a", "b", "c"], 2, random.Random(0)).split("\n\n")
    assert len(mixed) == 3 and "M" in mixed and set(mixed) - {"M"} <= {"a", "b", "c"}
    assert sorted(P.mix_noisy_materials("M", ["a"], 5, random.Random(0)).split("\n\n")) == ["M", "a"]


def test_rag_verified_is_em():
    assert P.rag_verified("the Sofade", ["Sofade"]) and P.rag_verified("sofade.", "Sofade")
    assert not P.rag_verified("Sofade country", "Sofade") and not P.rag_verified(None, "Sofade")


def test_success_rates_and_proposer_rewards():
    s = P.success_rates(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.1]), 3)
    close(s, [2 / 3, 0.0, 1.0])
    with pytest.raises(ValueError, match="not 2 attempts"):
        P.success_rates(torch.ones(3), 2)
    valid = torch.tensor([True, True, True, False])
    s4 = torch.tensor([0.25, 0.0, 1.0, 0.5])
    close(P.proposer_rewards(valid, s4, P.ssp_options()), [0.75, 1.0, 0.0, -1.0])
    mid = P.ssp_options({"reward_type": "intermediate_difficulty"})
    close(P.proposer_rewards(valid, s4, mid), [4 * 0.25 * 0.75, 0.0, 0.0, -1.0])
    close(P.proposer_rewards(torch.tensor([True]), torch.tensor([0.5]), mid), [1.0])  # the peak at s = 1/2
