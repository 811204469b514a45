"""REX-RAG's dead-end probing and its importance correction (training.algos.rexrag) on hand-computed cases."""

import math
import random

import pytest
import torch

from agent.trajectory import Role, Trajectory, Turn
from training.algos import rexrag as R


def close(x, y):
    torch.testing.assert_close(x.float(), torch.tensor(y, dtype=torch.float32), atol=1e-6, rtol=0)


def test_options():
    o = R.rexrag_options()
    assert o.probe_prob == 0.2 and len(o.hints) == len(R.DEFAULT_HINTS)
    assert R.rexrag_options({"hints": ["a hint"], "probe_prob": 1.0}).hints == ("a hint",)
    with pytest.raises(ValueError, match="probe_prob"):
        R.rexrag_options({"probe_prob": 1.2})
    with pytest.raises(ValueError, match="non-empty"):
        R.rexrag_options({"hints": []})
    with pytest.raises(ValueError, match="non-empty"):
        R.rexrag_options({"hints": ["ok", "  "]})
    with pytest.raises(ValueError, match="did you mean 'probe_prob'"):
        R.rexrag_options({"probe_probability": 0.1})


def test_dead_ends_are_wrong_answers_of_unprobed_rollouts_below_the_draw():
    answered = torch.tensor([1, 1, 1, 0, 1, 1])
    correct = torch.tensor([0, 1, 0, 0, 0, 0])
    probed = torch.tensor([0, 0, 1, 0, 0, 0])
    u = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.2, 0.19999])
    assert R.dead_ends(answered, correct, probed, u, 0.2).tolist() == [True, False, False, False, False, True]


def episode(final_action="answer"):
    """3 prompt tokens; turn 1: 2 policy + 2 tool tokens; turn 2: 2 policy tokens (the final action)."""
    t = Trajectory("q7", "Where?", ["x"])
    t.append([1, 2, 3], Role.PROMPT, 0)
    t.append([4, 5], Role.POLICY, 1)
    t.append([6, 7], Role.TOOL, 1)
    t.append([8, 9], Role.POLICY, 2)
    t.turns = [Turn(1, "<search> a </search>", "search", observation="doc"),
               Turn(2, "<answer> y </answer>" if final_action == "answer" else "<search> b </search>", final_action)]
    return t


def test_probe_cut_keeps_everything_before_the_final_answer_turn():
    assert R.probe_cut(episode()) == 7
    with pytest.raises(ValueError, match="did not end with an answer"):
        R.probe_cut(episode("search"))
    with pytest.raises(ValueError, match="no turns"):
        R.probe_cut(Trajectory("q", "q"))


def test_probe_plan_one_probe_per_dead_end_with_a_uniform_hint():
    opts = R.rexrag_options()
    trajs = [episode(), episode(), episode()]
    plans = R.probe_plan(trajs, torch.tensor([True, False, True]), opts, random.Random(0))
    ref = random.Random(0)
    k0, k2 = ref.randrange(len(opts.hints)), ref.randrange(len(opts.hints))
    assert plans == [R.ProbePlan(0, 7, k0, opts.hints[k0]), R.ProbePlan(2, 7, k2, opts.hints[k2])]


def test_probe_masks():
    prefix, hint = R.probe_masks(6, 2, 3)
    assert prefix.tolist() == [True, True, False, False, False, False]
    assert hint.tolist() == [False, False, True, True, True, False]
    with pytest.raises(ValueError, match="does not fit"):
        R.probe_masks(4, 2, 3)
    with pytest.raises(ValueError, match="does not fit"):
        R.probe_masks(4, 2, 0)


def test_hint_logprobs_follow_the_pools_prefix_tree():
    pool = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    lp = R.hint_logprobs([1, 2, 3], pool)
    assert lp == pytest.approx([math.log(3 / 4), math.log(2 / 3), math.log(1 / 2)])
    assert sum(lp) == pytest.approx(math.log(1 / 4))  # one hint of four
    assert R.hint_logprobs([6], pool) == pytest.approx([math.log(1 / 4)])
    assert R.hint_logprobs([1, 2], [[1, 2], [1, 2]]) == pytest.approx([0.0, 0.0])  # a pool of one hint, twice
    with pytest.raises(ValueError, match="not a pool hint"):
        R.hint_logprobs([1, 7], pool)


def test_mixture_weights():
    alpha, err = R.mixture_weights(torch.tensor([0, 0, 0, 1]), torch.tensor([1, 0, 0, 0]))
    assert alpha == 0.25 and err == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="probe rollouts only"):
        R.mixture_weights(torch.tensor([1]), torch.tensor([0]))


def test_behaviour_logprobs_of_an_ordinary_and_a_probe_row():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5], [0.5, 0.4, 0.2, 0.8, 0.25]]))
    # row 1: prompt, prefix policy token, prefix tool token, hint token, the policy's continuation
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 0, 1, 1]])
    is_probe = torch.tensor([False, True])
    hint_mask = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 0]])
    hint_lp = torch.log(torch.tensor([[1.0] * 5, [1.0, 1.0, 1.0, 0.5, 1.0]]))
    prefix = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    out = R.behaviour_logprobs(old, mask, is_probe, hint_mask, hint_lp, prefix, alpha=0.25, error_rate=0.5)
    ln = math.log
    close(out, [[ln(0.5), ln(0.375), ln(0.375), ln(0.375), ln(0.375)],
                # prefix: 0.75 * 0.4 + 0.25 * 0.4 / 0.5; hint: 0.75 * 0.8 + 0.25 * 0.5; after: pi_old
                [ln(0.5), ln(0.5), ln(0.2), ln(0.725), ln(0.25)]])


def test_the_prefix_division_multiplies_to_one_over_the_error_rate():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    ones = torch.ones(1, 3)
    out = R.behaviour_logprobs(old, ones, torch.tensor([True]), torch.zeros(1, 3), torch.zeros(1, 3),
                               torch.tensor([[1, 1, 0]]), alpha=0.5, error_rate=0.25)
    # mu at the two prefix tokens: 0.5 * 0.25^(-1/2) = 1.0 each (product 4 * pi_old(prefix) = pi_old / err)
    close(out, [[math.log(0.75), math.log(0.75), math.log(0.5)]])


def test_alpha_zero_is_plain_ppo_and_bad_weights_are_rejected():
    old = torch.log(torch.tensor([[0.3, 0.6]]))
    out = R.behaviour_logprobs(old, torch.ones(1, 2), torch.tensor([False]), torch.zeros(1, 2),
                               torch.zeros(1, 2), torch.zeros(1, 2), alpha=0.0, error_rate=0.5)
    close(out, old.tolist())
    with pytest.raises(ValueError, match="alpha"):
        R.behaviour_logprobs(old, torch.ones(1, 2), torch.tensor([False]), torch.zeros(1, 2), torch.zeros(1, 2),
                             torch.zeros(1, 2), alpha=1.0, error_rate=0.5)
    with pytest.raises(ValueError, match="error rate"):
        R.behaviour_logprobs(old, torch.ones(1, 2), torch.tensor([True]), torch.zeros(1, 2), torch.zeros(1, 2),
                             torch.ones(1, 2), alpha=0.5, error_rate=0.0)
