"""AEPO's entropy control by REINFORCE on temperature-adjusted samples (training.algos.aepo)."""

import math

import pytest
import torch

from training.algos import aepo as E


def test_defaults_follow_the_reference_code():
    o = E.aepo_options()
    assert (o.entropy_target, o.temperature_high, o.temperature_low, o.advantage_threshold,
            o.reinforce_samples, o.resample_fraction) == (0.5, 1.2, 0.8, 0.05, 60, 0.25)


@pytest.mark.parametrize("values, match", [
    ({"entropy_target": 0.0}, "entropy_target"),
    ({"entropy_target": -1.0}, "entropy_target"),
    ({"temperature_high": 0.9}, "temperature_high=0.9"),
    ({"temperature_low": 1.1}, "temperature_low=1.1"),
    ({"temperature_low": 0.0}, "temperature_low=0.0"),
    ({"temperature_low": 1.0, "temperature_high": 1.0}, "low < high"),
    ({"reinforce_samples": -1}, "reinforce_samples"),
    ({"resample_fraction": 0.0}, "resample_fraction"),
    ({"resample_fraction": 1.5}, "resample_fraction"),
    ({"entropy": 0.4}, "did you mean 'entropy_target'"),
])
def test_bad_options_are_rejected(values, match):
    with pytest.raises(ValueError, match=match):
        E.aepo_options(values)


def test_entropy_target_must_lie_strictly_inside_zero_log_v():
    V = 100
    E.check_entropy_target(1e-6, V)
    E.check_entropy_target(math.log(V) - 1e-6, V)
    with pytest.raises(ValueError, match=r"V=100"):
        E.check_entropy_target(math.log(V), V)  # the uniform policy: unreachable as a held target
    with pytest.raises(ValueError):
        E.check_entropy_target(5.0, V)  # log 100 = 4.605
    with pytest.raises(ValueError):
        E.check_entropy_target(0.0, V)
    with pytest.raises(ValueError, match="vocab_size=1"):
        E.check_entropy_target(0.5, 1)
    with pytest.raises(ValueError):
        E.aepo_options({"entropy_target": 5.0}, vocab_size=V)
    assert E.aepo_options({"entropy_target": 4.6}, vocab_size=V).entropy_target == 4.6


def test_temperature_switches_at_the_target():
    o = E.aepo_options({"entropy_target": 0.75})
    assert E.aepo_temperature(0.5, o) == 1.2
    assert E.aepo_temperature(0.75, o) == 1.2  # at the target: raise it (the reference code's <=)
    assert E.aepo_temperature(0.7501, o) == 0.8
    with pytest.raises(ValueError, match="NaN"):
        E.aepo_temperature(float("nan"), o)


def test_select_keeps_positive_advantages_up_to_the_budget_halved_above_target():
    o = E.aepo_options({"reinforce_samples": 3, "entropy_target": 0.5})
    adv = torch.tensor([0.9, 0.05, -1.0, 0.2, 0.06, 1.0])  # 0.05 is not above the threshold
    assert E.aepo_select(adv, 0.4, o).tolist() == [0, 3, 4]  # below target: the budget of 3
    assert E.aepo_select(adv, 0.6, o).tolist() == [0]  # above: 3 // 2
    assert E.aepo_select(torch.tensor([0.1, 0.1]), 0.4, o).tolist() == [0, 1]  # fewer than the budget
    assert E.aepo_select(torch.tensor([-0.1]), 0.4, o).tolist() == []


def test_reinforce_pg_value_and_gradient():
    logits = torch.tensor([[0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    lp = torch.log_softmax(logits, -1)  # two rows, two tokens each, p = 1/2
    old = lp.detach()
    pg = E.reinforce_pg(lp, old, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(pg, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))
    pg.sum().backward()
    # on policy the gradient is REINFORCE's, -R * grad log pi: compare with autograd of -sum(log pi) for row 0
    ref_logits = torch.zeros(1, 2, requires_grad=True)
    (-torch.log_softmax(ref_logits, -1).sum()).backward()
    torch.testing.assert_close(logits.grad[0], ref_logits.grad[0])
    torch.testing.assert_close(logits.grad[1], torch.zeros(2))


def test_reinforce_pg_off_policy_ratio():
    lp = torch.log(torch.tensor([[0.5]]))
    old = torch.log(torch.tensor([[0.25]]))
    torch.testing.assert_close(E.reinforce_pg(lp, old, torch.tensor([1.0])), torch.tensor([[-2.0]]))


def test_replace_rows():
    assert E.replace_rows(5, 2).tolist() == [2, 3, 4]
    assert E.replace_rows(3, 3).tolist() == []
    with pytest.raises(ValueError, match="4 REINFORCE samples into a batch of 3"):
        E.replace_rows(3, 4)
