"""E-GRPO's entity-aware partial reward (training.algos.egrpo) against the paper's definitions."""

import pytest
import torch

from agent.trajectory import Trajectory, Turn
from training.algos import egrpo as G


def close(x, y):
    torch.testing.assert_close(x.float(), torch.tensor(y, dtype=torch.float32), atol=1e-6, rtol=0)


def test_alpha_range():
    assert G.egrpo_options().alpha == 0.3
    assert G.egrpo_options({"alpha": 0.0}).alpha == 0.0
    with pytest.raises(ValueError, match="alpha"):
        G.egrpo_options({"alpha": 1.0})
    with pytest.raises(ValueError, match="alpha"):
        G.egrpo_options({"alpha": -0.1})
    with pytest.raises(ValueError, match="did you mean 'alpha'"):
        G.egrpo_options({"alfa": 0.2})


def test_entity_match_rate_whole_words_after_normalisation():
    ents = ["Rutevo", "Sofade", "The Kalomi Bridge"]
    assert G.entity_match_rate("search rutevo", ents) == pytest.approx(1 / 3)
    assert G.entity_match_rate("Rutevos and sofade.", ents) == pytest.approx(1 / 3)  # Rutevos is not Rutevo
    assert G.entity_match_rate("kalomi bridge, Rutevo; SOFADE", ents) == 1.0  # articles and case normalised
    assert G.entity_match_rate("anything", []) == 0.0
    assert G.entity_match_rate("Rutevo", ["Rutevo", "rutevo"]) == 1.0  # one entity, counted once


def traj(texts, observations):
    turns = [Turn(k + 1, t, "search", observation=o) for k, (t, o) in enumerate(zip(texts, observations))]
    return Trajectory("q", "Where?", ["x"], turns=turns)


def test_reasoning_text_is_the_policys_turns_only():
    t = traj(["<search> Kalomi </search>", "<search> Rutevo </search>"], ["Kalomi was born in Rutevo.", "x"])
    assert G.reasoning_text(t) == "<search> Kalomi </search>\n<search> Rutevo </search>"
    # the bridge entity read in a document but never written by the policy does not count
    t2 = traj(["<search> Kalomi </search>"], ["Kalomi was born in Rutevo."])
    assert G.entity_match_rate(G.reasoning_text(t2), ["Rutevo"]) == 0.0


def test_gold_entities_of_a_synthetic_chain_drop_the_answer_and_the_question_entity():
    meta = {"chain": ["Kalomi", "Rutevo", "Sofade", "pimaru"], "hops": 3}
    assert G.gold_entities("Which currency is used where Kalomi was born?", meta) == ["Rutevo", "Sofade"]
    assert G.gold_entities("Where was Kalomi born?", {"chain": ["Kalomi", "Rutevo"]}) == []


def test_gold_entities_from_explicit_names_or_supporting_titles():
    assert G.gold_entities("Who?", {"entities": ["Alba", "Bram", "Alba"]}) == ["Alba", "Bram"]
    meta = {"supporting_ids": ["p2", "p3"]}
    titles = {"p2": "Eiffel Tower", "p3": "Gustave Eiffel"}
    assert G.gold_entities("Where was the designer of the Eiffel Tower born?", meta, titles) == ["Gustave Eiffel"]
    assert G.gold_entities("Who?", meta) == []


def test_normalized_match_rates_divide_by_the_groups_best():
    rates = torch.tensor([0.5, 0.25, 0.0, 0.0, 0.0, 1 / 3])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    close(G.normalized_match_rates(rates, groups), [1.0, 0.5, 0.0, 0.0, 0.0, 1.0])


def test_rewards_correct_partial_and_format_error():
    opts = G.egrpo_options({"alpha": 0.3})
    correct = torch.tensor([True, False, False, False, True])
    fmt = torch.tensor([True, True, True, False, False])
    rates = torch.tensor([1.0, 0.5, 0.25, 0.5, 1.0])  # group best: 1.0
    groups = torch.zeros(5, dtype=torch.long)
    close(G.egrpo_rewards(correct, fmt, rates, groups, opts), [1.0, 0.15, 0.075, 0.0, 0.0])


def test_wrong_answers_of_a_group_without_a_correct_one_are_ranked_by_entities():
    opts = G.egrpo_options()
    out = G.egrpo_rewards(torch.zeros(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool),
                          torch.tensor([0.5, 0.25, 0.0]), torch.zeros(3, dtype=torch.long), opts)
    close(out, [0.3, 0.15, 0.0])
