"""GSPO and CISPO (training.algos.losses) against their papers' objectives: values on hand-computed cases, and
gradients against autograd of the objective written as in the paper."""

import math

import pytest
import torch

from training.algos.losses import POLICY_LOSSES, CISPOOptions, LossConfig, policy_loss
from training.config import TrainConfig
from training.model.kernels import policy_loss as dispatched_loss

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.7, 0.0, 0.0]], dtype=torch.float64)
# row 0: token log-ratios [.1, .2, .3] -> sequence mean .2; row 1: [-.3, -.1] -> -.2 (the pad column differs
# from the old log-prob on purpose: masked tokens must not count)
NEW = OLD + torch.tensor([[0.1, 0.2, 0.3, 5.0], [-0.3, -0.1, 7.0, 0.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0]], dtype=torch.float64)


def test_registered():
    assert {"ppo_clip", "gspo", "cispo"} <= set(POLICY_LOSSES)
    assert not POLICY_LOSSES.get("gspo").kernel and not POLICY_LOSSES.get("cispo").kernel
    TrainConfig(algorithm={"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"})


def gspo_paper(new, old, adv_seq, mask, lo, hi):
    """GSPO's objective (Zheng et al. 2025, Eq. 5-7), -J: the mean over sequences of
    -min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t log(pi/pi_old))."""
    s = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))
    return -torch.minimum(s * adv_seq, s.clamp(1 - lo, 1 + hi) * adv_seq).mean()


@pytest.mark.parametrize("lo,hi", [(0.3, 0.3), (0.1, 0.1)])  # inside the clip range / both rows clipped
def test_gspo_matches_the_paper_objective(lo, hi):
    new = NEW.clone().requires_grad_(True)
    loss, stats = policy_loss(new, OLD, ADV, MASK.double(),
                              LossConfig(loss="gspo", clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-mean"))
    (g,) = torch.autograd.grad(loss, new)
    ref_new = NEW.clone().requires_grad_(True)
    ref = gspo_paper(ref_new, OLD, ADV[:, 0], MASK.double(), lo, hi)
    (g_ref,) = torch.autograd.grad(ref, ref_new)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)
    s0, s1 = math.exp(0.2), math.exp(-0.2)
    if lo == 0.3:  # hand values: -(1 * e^.2 + (-2) * e^-.2) / 2, and d/dlogp_t = -A s / (|y| B)
        assert float(loss.detach()) == pytest.approx(-(s0 - 2 * s1) / 2, abs=1e-9)
        assert float(g[0, 0]) == pytest.approx(-s0 / 6, abs=1e-9)
        assert float(g[1, 1]) == pytest.approx(2 * s1 / 4, abs=1e-9)
        assert stats["clip_frac"] == 0.0
    else:  # e^.2 > 1.1 with A > 0 and e^-.2 < 0.9 with A < 0: both sequences clipped whole, no gradient
        assert float(loss.detach()) == pytest.approx(-(1.1 - 2 * 0.9) / 2, abs=1e-9)
        assert float(g.abs().max()) == 0.0
        assert stats["clip_frac"] == 1.0
    assert float(g[0, 3]) == 0.0 and float(g[1, 2]) == 0.0  # masked tokens


def test_gspo_on_policy_equals_the_policy_gradient():
    # ratio 1 (one update on fresh rollouts): the gradient is A / |y_i| / B on each token, as GRPO's with
    # seq-mean-token-mean
    new = OLD.clone().requires_grad_(True)
    loss, _ = policy_loss(new, OLD, ADV, MASK.double(), LossConfig(loss="gspo", loss_agg="seq-mean-token-mean"))
    (g,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(g, torch.tensor([[-1 / 6, -1 / 6, -1 / 6, 0], [2 / 4, 2 / 4, 0, 0]], dtype=torch.float64))


def cispo_paper(new, old, adv, mask, hi, lo=None):
    """CISPO's objective (MiniMax-M1, Eq. 4-5), -J: -1/sum|o_i| sum_{i,t} sg(r_hat_{i,t}) A_{i,t} log pi."""
    r = torch.exp(new - old).detach()
    r_hat = r.clamp(max=1 + hi) if lo is None else r.clamp(1 - lo, 1 + hi)
    return -(r_hat * adv * new * mask).sum() / mask.sum()


@pytest.mark.parametrize("lo", [None, 0.05])
def test_cispo_matches_the_paper_gradient(lo):
    hi = 0.15  # row 0: ratios e^.1, e^.2, e^.3 -> the last two clipped to 1.15; row 1: e^-.3, e^-.1
    new = NEW.clone().requires_grad_(True)
    opts = None if lo is None else CISPOOptions(clip_low=lo)
    loss, stats = policy_loss(new, OLD, ADV, MASK.double(),
                              LossConfig(loss="cispo", clip_high=hi, clip_low=0.9, loss_agg="token-mean", options=opts))
    (g,) = torch.autograd.grad(loss, new)
    ref_new = NEW.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(cispo_paper(ref_new, OLD, ADV, MASK.double(), hi, lo), ref_new)
    torch.testing.assert_close(g, g_ref)
    # every policy token has gradient, the clipped ones too (PPO-clip's would be 0 there)
    assert bool((g[MASK.bool()] != 0).all())
    low = (lambda r: r) if lo is None else (lambda r: max(r, 0.95))  # e^-.3 and e^-.1 both below 0.95
    w = [math.exp(0.1), 1.15, 1.15, low(math.exp(-0.3)), low(math.exp(-0.1))]
    assert float(g[0, 2]) == pytest.approx(-1.15 / 5, abs=1e-9)
    # value: -A * r_hat, token mean
    expect = -(w[0] + w[1] + w[2] - 2 * w[3] - 2 * w[4]) / 5
    assert float(loss.detach()) == pytest.approx(expect, abs=1e-9)
    assert stats["clip_frac"] == pytest.approx((2 if lo is None else 4) / 5)


def test_ppo_clip_drops_the_gradient_cispo_keeps():
    new = NEW.clone().requires_grad_(True)
    loss, _ = policy_loss(new, OLD, ADV, MASK.double(), LossConfig(loss="ppo_clip", clip_low=0.15, clip_high=0.15))
    (g,) = torch.autograd.grad(loss, new)
    assert float(g[0, 2]) == 0.0  # ratio e^.3 > 1.15 with A > 0: clipped away


@pytest.mark.parametrize("name,agg", [("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")])
def test_the_dispatcher_runs_the_reference_for_them(name, agg):
    cfg = LossConfig(loss=name, loss_agg=agg, clip_low=0.2, clip_high=0.28)
    a, sa = dispatched_loss(NEW.float(), OLD.float(), ADV.float(), MASK, cfg)
    b, sb = policy_loss(NEW.float(), OLD.float(), ADV.float(), MASK, cfg)
    torch.testing.assert_close(a, b)
    assert sa == sb
