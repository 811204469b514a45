"""IKEA's knowledge-boundary reward and AdaSearch's decision stage (training.algos.knowledge_boundary)."""

import random

import pytest
import torch

from training.algos import knowledge_boundary as K


def close(x, y):
    torch.testing.assert_close(x.float(), torch.tensor(y, dtype=torch.float32), atol=1e-6, rtol=0)


def test_ikea_reward_table_of_the_reference_code():
    opts = K.ikea_options()
    correct = torch.tensor([1, 1, 1, 1, 1, 0, 0, 1, 0])
    fmt = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 0])
    searches = torch.tensor([0, 1, 2, 3, 7, 0, 2, 0, 1])
    close(K.ikea_rewards(correct, fmt, searches, opts), [1.6, 1.4, 1.2, 1.0, 1.0, 0.0, 0.05, -1.0, -1.0])


def test_ikea_constants_change_the_reward():
    opts = K.ikea_options({"r_kb_pos": 1.0, "r_kb_neg": 0.1, "rt_max": 2, "format_penalty": -0.5})
    close(K.ikea_rewards(torch.tensor([1, 1, 0, 0]), torch.tensor([1, 1, 1, 0]), torch.tensor([1, 2, 1, 0]), opts),
          [1.5, 1.0, 0.1, -0.5])


@pytest.mark.parametrize("values, match", [
    ({"r_kb_pos": -0.1}, "r_kb_pos"), ({"r_kb_neg": 1.0}, "r_kb_neg"), ({"r_kb_neg": -0.01}, "r_kb_neg"),
    ({"rt_max": 0}, "rt_max"), ({"format_penalty": 0.5}, "format_penalty"), ({"rtmax": 2}, "did you mean 'rt_max'"),
])
def test_ikea_bad_options(values, match):
    with pytest.raises(ValueError, match=match):
        K.ikea_options(values)


def test_known_questions_threshold_both_sides():
    correct = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert K.known_questions(correct).tolist() == [True, False, False, True]
    assert K.known_questions(correct, 0.25).tolist() == [True, True, False, True]
    assert K.known_questions(correct, 1.0).tolist() == [False, False, False, True]
    with pytest.raises(ValueError):
        K.known_questions(correct, 0.0)
    with pytest.raises(ValueError, match=r"\[Q, K\]"):
        K.known_questions(torch.tensor([1, 0]))


def test_boundary_mix_takes_equal_shares():
    known = [True, False, True, False, False, True]
    idx = K.boundary_mix(known, 4, random.Random(0))
    assert len(idx) == 4 == len(set(idx))
    assert sum(known[i] for i in idx) == 2
    assert sorted(K.boundary_mix(known, 6, random.Random(1))) == list(range(6))
    with pytest.raises(ValueError, match="needs more than the 3 known and 3 unknown"):
        K.boundary_mix(known, 4, random.Random(0), known_share=1.0)


def test_prompts_name_the_tags():
    p = K.parametric_prompt("Where was  Kalomi born?")
    assert p.endswith("Question: Where was Kalomi born?\n") and "<answer>" in p and "<search>" not in p
    d = K.decision_prompt("Where?")
    assert "<decision> answer </decision>" in d and "<decision> search </decision>" in d


def test_parse_decision():
    assert K.parse_decision("<think> I know it </think><decision> Answer </decision>") == "answer"
    assert K.parse_decision("<decision>search</decision>") == "search"
    assert K.parse_decision("<decision> maybe </decision>") is None
    assert K.parse_decision("<decision>search</decision><decision>answer</decision>") is None
    assert K.parse_decision("search") is None
    assert K.parse_decision("") is None


def test_decision_rewards():
    known = torch.tensor([True, True, False, False, True])
    close(K.decision_rewards(["answer", "search", "search", "answer", None], known, -0.5), [1, 0, 1, 0, -0.5])
    with pytest.raises(ValueError, match="2 decisions for 1 labels"):
        K.decision_rewards(["answer", "search"], torch.tensor([True]))
    with pytest.raises(ValueError, match="'maybe'"):
        K.decision_rewards(["maybe"], torch.tensor([True]))


def test_f1_aware():
    # answer decisions on known questions: tp = 2; answer on an unknown one: fp = 1; a known one searched: fn = 1
    decisions = ["answer", "answer", "answer", "search", None, "search"]
    known = [True, True, False, True, False, False]
    assert K.f1_aware(decisions, known) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert K.f1_aware(["search", "search"], [True, True]) == 0.0  # always searching: Search-R1's 0
    assert K.f1_aware(["search"], [False]) == 0.0
    assert K.f1_aware(["answer"], [True]) == 1.0
