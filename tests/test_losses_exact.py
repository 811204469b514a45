"""The policy loss's parts (training.algos.losses) on hand-computed values: each loss aggregation, each KL
estimator with its bounds, PPO-clip's clipping on both sides (and dual-clip), GSPO's sequence ratio, CISPO's
clipped weight, and the composed loss's statistics. The composed loss is called in one place
(:func:`composed`), so a new ``policy_loss`` signature changes one function here."""

from __future__ import annotations

import math

import pytest
import torch

from training.algos.losses import (
    K3_MAX,
    CISPOOptions,
    LossConfig,
    aggregate,
    cispo,
    gspo,
    kl_estimate,
    policy_loss,
    ppo_clip,
    register_loss_agg,
    sequence_log_ratio,
    token_logprobs,
    token_mean,
)

LN2 = math.log(2.0)
#: GSPO's clip range in the paper (3e-4 / 4e-4; set explicitly, LossConfig's defaults are PPO's 0.2 / 0.2)
GSPO_PAPER = {"clip_low": 3e-4, "clip_high": 4e-4}


def cfg(loss: str, **kw) -> LossConfig:
    """The settings of one policy term ``loss`` (the fields of :class:`LossConfig`)."""
    return LossConfig(loss=loss, **kw)


def close(x, want) -> bool:
    torch.testing.assert_close(x.detach().float(), torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    return True
# two rows: 3 policy tokens and 1 (the rest masked, holding NaN/inf that must never leak)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
VALUES = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [float("inf"), 4.0, 5.0, 6.0]])


def test_aggregations_hand_computed():
    assert aggregate(VALUES, MASK, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(VALUES, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", scale=5.0).item() == pytest.approx((6 + 4) / (5 * 2))
    # a row without a policy token counts in no mode
    three = torch.cat([MASK, torch.zeros(1, 4)])
    vals = torch.cat([VALUES, torch.full((1, 4), 9.0)])
    assert aggregate(vals, three, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate(vals, three, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(vals, three, "seq-mean-token-sum-norm", scale=2.0).item() == pytest.approx(2.5)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate(VALUES, torch.zeros(2, 4), mode).item() == 0.0  # all masked: 0
    for scale in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="needs a positive constant normaliser"):
            aggregate(VALUES, MASK, "seq-mean-token-sum-norm", scale=scale)
    with pytest.raises(ValueError):
        aggregate(VALUES, MASK, "no-such-mode")
    with pytest.raises(ValueError, match="unit is 'tokens' or 'rows'"):
        register_loss_agg("x", "sequences")


def test_token_mean_and_sequence_log_ratio():
    assert token_mean(VALUES, MASK) == pytest.approx(2.5)
    assert token_mean(VALUES, torch.zeros(2, 4)) == 0.0
    lp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    old = torch.tensor([[-2.0, -2.0, -1.0, 5.0], [0.0, -3.0, 0.0, 0.0]])
    # row 0: (1 + 0 - 2) / 3; row 1: 2 / 1; a row without tokens: 0
    got = sequence_log_ratio(lp, old, MASK)
    assert got.tolist() == pytest.approx([-1 / 3, 2.0])
    assert sequence_log_ratio(lp[:1], old[:1], torch.zeros(1, 4)).tolist() == [0.0]


def test_kl_estimators_hand_computed():
    lp = torch.tensor([0.0, -LN2, 0.0, 0.0, -30.0])
    ref = torch.tensor([0.0, 0.0, -LN2, -25.0, 0.0])
    # d = ref - lp: 0, ln 2, -ln 2, -25 (clamped to -20), 30 (clamped to 20)
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.0, -LN2, LN2, 25.0, -30.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.0, LN2**2 / 2, LN2**2 / 2, 312.5, 450.0])
    assert kl_estimate(lp, ref, "abs").tolist() == pytest.approx([0.0, LN2, LN2, 25.0, 30.0])
    k3 = kl_estimate(lp, ref, "k3").tolist()
    assert k3 == pytest.approx([0.0, 2 - LN2 - 1, 0.5 + LN2 - 1, K3_MAX, K3_MAX], abs=1e-6)  # capped at 10
    assert K3_MAX == 10.0
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-10.5]), "k3").item() == pytest.approx(9.5 + math.exp(-10.5))
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-11.0]), "k3").item() == K3_MAX
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([2.0]), "k3").item() == pytest.approx(math.exp(2) - 3)
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([3.0]), "k3").item() == K3_MAX  # e^3 - 4 = 16.1: capped
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


def test_ppo_clip_both_sides_of_the_trust_region():
    # ratios 1.5, 0.5, 1.1 with A = +1, -1, +1 and clip 0.2 / 0.3
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    pg, stats = ppo_clip(lp, old, adv, mask, cfg("ppo_clip", clip_low=0.2, clip_high=0.3))
    # token 0: max(-1.5, -1.3) = -1.3 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped); token 2: -1.1
    assert close(pg, [[-1.3, 0.8, -1.1]])
    assert stats == {"clip_frac": pytest.approx(2 / 3)}
    pg, _ = ppo_clip(lp, old, adv, mask, cfg("ppo_clip", clip_low=0.5, clip_high=0.5))  # nothing clipped
    assert close(pg, [[-1.5, 0.5, -1.1]])
    # exactly at the edge (ratio 1.5, clip_high 0.5): not counted as clipped
    _, stats = ppo_clip(lp[:, :1], old[:, :1], adv[:, :1], mask[:, :1], cfg("ppo_clip", clip_high=0.5))
    assert stats["clip_frac"] == 0.0


def test_dual_clip_caps_negative_advantages():
    lp = torch.log(torch.tensor([[5.0, 2.0, 5.0]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    pg, stats = ppo_clip(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), cfg("ppo_clip", clip_ratio_c=3.0))
    # token 0: max(5, 1.2) = 5 -> capped at 3; token 1: 2 < 3 stays; token 2 (A > 0): max(-5, -1.2) = -1.2
    assert close(pg, [[3.0, 2.0, -1.2]])
    assert stats["clip_frac_lower"] == pytest.approx(1 / 3) and stats["clip_frac"] == pytest.approx(1 / 3)
    # at the bound: not capped
    pg, _ = ppo_clip(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), cfg("ppo_clip", clip_ratio_c=5.0))
    assert close(pg, [[5.0, 2.0, -1.2]])
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_c > 1"):
            ppo_clip(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), cfg("ppo_clip", clip_ratio_c=c))


def test_gspo_clips_whole_sequences():
    # row 0: log-ratios ln 2, 0 -> s = sqrt 2 (clipped to 1 + 0.1); row 1: 0, 0 -> s = 1
    lp = torch.tensor([[LN2, 0.0], [0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    pg, stats = gspo(lp, torch.zeros(2, 2), adv, torch.ones(2, 2), cfg("gspo", clip_low=0.1, clip_high=0.1))
    assert close(pg, [[-1.1, -1.1], [2.0, 2.0]])
    assert stats["clip_frac"] == pytest.approx(0.5)
    pg, _ = gspo(lp, torch.zeros(2, 2), adv, torch.ones(2, 2), cfg("gspo", clip_low=0.5, clip_high=0.5))
    assert close(pg, [[-math.sqrt(2)] * 2, [2.0, 2.0]])
    pg.sum().backward()  # the GSPO-token gradient: -A * s on each token
    assert close(lp.grad, [[-math.sqrt(2)] * 2, [2.0, 2.0]])


def test_cispo_clips_the_weight_not_the_gradient():
    lp = torch.log(torch.tensor([[2.0, 0.5, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    pg, stats = cispo(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), cfg("cispo", clip_high=0.2))
    assert close(pg, [[-1.2, -0.5, 1.0]])  # only the upper bound by default
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    pg.sum().backward()
    assert close(lp.grad, [[-1.2, -0.5, 1.0]])  # every token keeps its gradient
    both = cfg("cispo", clip_high=0.2, options=CISPOOptions(clip_low=0.25))
    pg, stats = cispo(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), both)
    assert close(pg, [[-1.2, -0.75, 1.0]]) and stats["clip_frac"] == pytest.approx(2 / 3)


def test_token_logprobs():
    logits = torch.tensor([[[0.0, 0.0], [LN2, 0.0]]])
    lp, ent = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert close(lp, [[-LN2, math.log(2 / 3)]])
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert close(ent, [[LN2, h]])


def composed(*, logprobs, old_logprobs, advantages, mask, ref_logprobs=None, entropy=None, is_weights=None,
             **settings):
    """The composed actor loss with the keyword settings of the tests below (``settings``: the fields of
    :class:`LossConfig`)."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, LossConfig(**settings), ref_logprobs=ref_logprobs,
                       entropy=entropy, is_weights=is_weights)


def test_composed_loss_and_its_statistics():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0, -LN2, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    loss, stats = composed(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, kl_coef=0.5,
                           kl_type="k1", entropy=ent, entropy_coef=0.1)
    pg = (-1.2 + 0.8 - 2.0) / 3  # PPO-clip 0.2 / 0.2 on ratios 1.5, 0.5, 1
    kl = (math.log(1.5) + math.log(0.5) + LN2) / 3
    assert stats["pg_loss"] == pytest.approx(pg, rel=1e-5) and stats["kl"] == pytest.approx(kl, rel=1e-5)
    assert stats["entropy"] == pytest.approx(2.0) and stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, rel=1e-5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0) / 3, rel=1e-5)
    assert loss.item() == pytest.approx(pg + 0.5 * kl - 0.1 * 2.0, rel=1e-5)
    # without a reference (or kl_coef 0) no KL term and no kl stat; entropy 0 coefficient: reported, not added
    loss, stats = composed(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, kl_coef=0.0,
                           entropy=ent)
    assert "kl" not in stats and stats["entropy"] == pytest.approx(2.0) and loss.item() == pytest.approx(pg, rel=1e-5)
    loss, stats = composed(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, kl_coef=0.5)
    assert "kl" not in stats and "entropy" not in stats
    # importance weights scale the policy term per token
    w = torch.tensor([[2.0, 1.0, 0.5, 7.0]])
    loss, stats = composed(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, is_weights=w)
    assert stats["pg_loss"] == pytest.approx((-2.4 + 0.8 - 1.0) / 3, rel=1e-5)
    loss, _ = composed(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, loss="cispo",
                       loss_agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-1.2 + 0.5 - 2.0, rel=1e-5)


def test_masked_lm_head_logprobs_equals_the_full_softmax_chunk_by_chunk():
    from training.algos.losses import masked_lm_head_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 3, generator=g, dtype=torch.float64)
    w = torch.randn(10, 3, generator=g, dtype=torch.float64)  # V = 10 != H = 3; chunks of 4: 4 + 4 + 2
    t = torch.tensor([0, 9, 4, 3, 7])  # targets in every chunk, on both edges of one
    m = torch.tensor([1, 1, 0, 1, 1])
    logits = h @ w.T
    want_lp = torch.log_softmax(logits, -1).gather(-1, t[:, None]).squeeze(-1) * m
    p = torch.softmax(logits, -1)
    want_ent = -(p * torch.log(p)).sum(-1) * m
    for chunk in (4, 3, 10, 16):
        lp, ent = masked_lm_head_logprobs(h, w, t, m, chunk)
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
        lp, ent = masked_lm_head_logprobs(h, w, t, m, chunk, with_entropy=False)
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
        assert ent.tolist() == [0.0] * 5
    one = torch.tensor([0, 0, 1, 0, 0])  # a single policy row
    lp, _ = masked_lm_head_logprobs(h, w, t, one, 4)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[2, 4] * one.double(), rtol=0, atol=1e-12)


def test_registered_kernel_ids():
    from training.algos.losses import KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES

    assert {n: LOSS_AGGS.get(n).kernel_mode for n in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                                      "seq-mean-token-sum-norm")} == {
        "token-mean": 0, "seq-mean-token-sum": 1, "seq-mean-token-mean": 2, "seq-mean-token-sum-norm": None}
    assert {n: LOSS_AGGS.get(n).unit for n in ("token-mean", "seq-mean-token-sum")} == {
        "token-mean": "tokens", "seq-mean-token-sum": "rows"}
    assert {n: KL_ESTIMATORS.get(n).kernel_id for n in ("k1", "k2", "k3", "abs")} == {
        "k1": 1, "k2": None, "k3": 3, "abs": None}
    assert [POLICY_LOSSES.get(n).kernel for n in ("ppo_clip", "gspo", "cispo")] == [True, False, False]


def test_k2_with_both_log_probs_nonzero_and_one_row_normalisers():
    assert kl_estimate(torch.tensor([-1.0]), torch.tensor([-2.0]), "k2").item() == pytest.approx(0.5)
    assert kl_estimate(torch.tensor([-1.0]), torch.tensor([-2.0]), "abs").item() == pytest.approx(1.0)
    # one row holding policy tokens: the row count is 1 (not clamped up to anything larger)
    vals, mask = torch.tensor([[2.0, 4.0], [7.0, 7.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert aggregate(vals, mask, "seq-mean-token-sum-norm", scale=3.0).item() == pytest.approx(2.0)
    assert aggregate(vals, mask, "seq-mean-token-sum").item() == pytest.approx(6.0)
    assert aggregate(vals, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(vals, mask, "token-mean").item() == pytest.approx(3.0)


def test_ratio_clamps_on_both_sides():
    one = torch.ones(1, 1)
    # PPO: the log-ratio is clamped to +-20 before the exp
    pg, _ = ppo_clip(torch.tensor([[25.0]]), torch.zeros(1, 1), -one, one, cfg("ppo_clip"))
    assert pg.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    pg, _ = ppo_clip(torch.tensor([[-25.0]]), torch.zeros(1, 1), one, one, cfg("ppo_clip", clip_low=1.0))
    assert pg.item() == pytest.approx(-math.exp(-20.0), rel=1e-5)
    # CISPO: the same clamp on the weight's ratio (a huge clip_high leaves it unclipped below e^20)
    pg, stats = cispo(torch.tensor([[25.0]]), torch.zeros(1, 1), -one, one, cfg("cispo", clip_high=3e8))
    assert pg.item() == pytest.approx(3e8 + 1, rel=1e-5) and stats["clip_frac"] == 1.0
    pg, stats = cispo(torch.tensor([[19.5]]), torch.zeros(1, 1), -one, one, cfg("cispo", clip_high=3e8))
    assert pg.item() == pytest.approx(math.exp(19.5), rel=1e-5) and stats["clip_frac"] == 0.0
    pg, _ = cispo(torch.tensor([[-25.0]]), torch.zeros(1, 1), -one, one, cfg("cispo"))
    assert pg.item() == pytest.approx(math.exp(-20.0), rel=1e-5)
    # GSPO: the token log-ratio is capped at 10
    pg, _ = gspo(torch.tensor([[12.0]]), torch.zeros(1, 1), -one, one, cfg("gspo", **GSPO_PAPER))
    assert pg.item() == pytest.approx(math.exp(10.0), rel=1e-5)


def test_gspo_with_the_papers_clip_range():
    one = torch.ones(1, 1)
    # s = 0.999 < 1 - 3e-4 with A = -1: max(s, 1 - 3e-4) = 0.9997; s = 1.001 > 1 + 4e-4 with A = 1: -1.0004
    pg, stats = gspo(torch.tensor([[math.log(0.999)]]), torch.zeros(1, 1), -one, one, cfg("gspo", **GSPO_PAPER))
    assert pg.item() == pytest.approx(0.9997, abs=1e-6) and stats["clip_frac"] == 1.0
    pg, _ = gspo(torch.tensor([[math.log(1.001)]]), torch.zeros(1, 1), one, one, cfg("gspo", **GSPO_PAPER))
    assert pg.item() == pytest.approx(-1.0004, abs=1e-6)
    # inside: unclipped
    pg, stats = gspo(torch.tensor([[math.log(0.9998)]]), torch.zeros(1, 1), -one, one, cfg("gspo", **GSPO_PAPER))
    assert pg.item() == pytest.approx(0.9998, abs=1e-6) and stats["clip_frac"] == 0.0


def test_all_masked_lm_head_rows_give_zeros_and_zero_gradients():
    from training.algos.losses import masked_lm_head_logprobs

    h = torch.ones(2, 3, requires_grad=True)
    w = torch.ones(4, 3, requires_grad=True)
    lp, ent = masked_lm_head_logprobs(h, w, torch.tensor([0, 1]), torch.zeros(2))
    assert lp.tolist() == [0.0, 0.0] and ent.tolist() == [0.0, 0.0]
    (lp.sum() + ent.sum()).backward()
    assert h.grad.abs().sum().item() == 0.0 and w.grad.abs().sum().item() == 0.0


def test_registering_a_taken_name_needs_replace():
    from training.algos.losses import (
        KL_ESTIMATORS,
        LOSS_AGGS,
        POLICY_LOSSES,
        register_kl,
        register_policy_loss,
    )

    with pytest.raises(ValueError):
        register_policy_loss("ppo_clip")(ppo_clip)
    with pytest.raises(ValueError):
        register_loss_agg("token-mean", "tokens")(lambda kept, mask, scale: kept.sum())
    with pytest.raises(ValueError):
        register_kl("k3")(lambda lp, ref: lp - ref)
    assert POLICY_LOSSES.get("ppo_clip").fn is ppo_clip and LOSS_AGGS.get("token-mean").kernel_mode == 0
    assert KL_ESTIMATORS.get("k3").kernel_id == 3


def test_dual_clip_accepts_any_bound_above_1_and_kl_is_off_by_default():
    lp = torch.log(torch.tensor([[5.0]]))
    pg, stats = ppo_clip(lp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), cfg("ppo_clip", clip_ratio_c=1.5))
    assert pg.item() == pytest.approx(1.5) and stats["clip_frac_lower"] == 1.0
    loss, stats = composed(logprobs=lp, old_logprobs=lp, advantages=torch.ones(1, 1), mask=torch.ones(1, 1),
                           ref_logprobs=torch.zeros(1, 1))  # a reference without kl_coef: no KL term
    assert "kl" not in stats and loss.item() == pytest.approx(-1.0)
