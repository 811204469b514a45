"""CPU tests of the opt-in fused masked loss (training/model/fused_loss.py): its torch path, which is the spec of the
CUDA row-block drivers, against autograd through the reference log-probs and losses (float64, exact to
rounding). The CUDA path runs against the same references in tests/test_fused_loss_gpu.py."""

from __future__ import annotations

import pytest
import torch

from training.algos.losses import LOSS_AGGS, LossConfig, masked_lm_head_logprobs, policy_loss
from training.model import fused_loss as FL

ALL_AGGS = tuple(LOSS_AGGS)


def _inputs(N, H, V, keep, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g) * 1.5).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g)
    m = torch.rand(N, generator=g) < keep
    return h, w, t, m


def _weighted(a, b):
    """A token loss that uses both the log-prob and the entropy, with per-row constants (as a policy loss)."""
    return lambda lp, ent, rows: a[rows] * lp + b[rows] * ent * ent


@pytest.mark.parametrize("row_block", [1, 7, 64, None])
@pytest.mark.parametrize("keep", [0.0, 0.6, 1.0])
def test_fused_token_loss_matches_autograd_of_the_reference(row_block, keep):
    N, H, V = 50, 16, 301
    h, w, t, m = _inputs(N, H, V, keep, seed=row_block or 0)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    loss, lp, ent = FL.fused_token_loss(h, w, t, m, _weighted(a, b), row_block=row_block, chunk_size=64)
    loss.backward()
    dh, dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp_r, ent_r = masked_lm_head_logprobs(h, w, t, m, 64)
    loss_r = ((a * lp_r + b * ent_r * ent_r) * m).sum()
    loss_r.backward()
    assert loss.dtype == torch.float64 and lp.shape == ent.shape == (N,)
    assert not lp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(loss, loss_r.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp, lp_r.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_r.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, w.grad, rtol=1e-10, atol=1e-12)
    assert (dh[~m] == 0).all() and (lp[~m] == 0).all()
    if keep == 0.0:
        assert float(loss.detach()) == 0.0 and (dw == 0).all()
    else:
        assert dw.abs().sum() > 0


def test_fused_token_loss_scales_by_the_upstream_gradient_and_takes_nd_inputs():
    B, T, H, V = 3, 9, 8, 97
    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (B, T), generator=g)
    m = torch.rand(B, T, generator=g) < 0.7
    loss, lp, _ = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp, row_block=4)
    (2.5 * loss).backward()
    assert lp.shape == (B, T)
    h2 = h.detach().clone().requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    lp_r, _ = masked_lm_head_logprobs(h2.reshape(-1, H), w2, t.reshape(-1), m.reshape(-1))
    (-2.5 * lp_r.sum()).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-10, atol=1e-12)


def test_fused_token_loss_only_one_gradient_and_constant_terms():
    h, w, t, m = _inputs(20, 8, 50, 0.7, seed=4)
    w = w.detach()
    loss, _, _ = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp, row_block=6)
    loss.backward()
    assert h.grad is not None and w.grad is None
    h.grad = None
    const, _, _ = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: torch.ones_like(lp.detach()))
    assert float(const.detach()) == float(m.sum())  # a term without gradient: its value, zero gradients
    const.backward()
    assert (h.grad == 0).all()


def test_fused_token_loss_bf16_rounds_like_the_bf16_reference():
    # bf16: the block's logits and dL/dz are rounded to bf16 as the kernel's buffer is
    h, w, t, m = _inputs(40, 32, 500, 0.6, seed=5, dtype=torch.bfloat16)
    loss, lp, _ = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp, row_block=16)
    loss.backward()
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    lp_r, _ = masked_lm_head_logprobs(h64, w64, t, m)
    (-lp_r.sum()).backward()
    assert loss.dtype == torch.float32 and lp.dtype == torch.float32
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())
    assert rel(lp, lp_r.detach()) < 1e-2
    assert rel(h.grad, h64.grad) < 2e-2 and rel(w.grad, w64.grad) < 2e-2


def test_fused_token_loss_rejects_bad_input():
    h, w, t, m = _inputs(10, 8, 30, 0.5, seed=6)
    tl = lambda lp, ent, rows: -lp
    with pytest.raises(ValueError, match="disagree"):
        FL.fused_token_loss(h, w, t[:5], m, tl)
    with pytest.raises(ValueError, match="must lie in"):
        FL.fused_token_loss(h, w, torch.full_like(t, 30), torch.ones_like(m), tl)
    with pytest.raises(ValueError, match="positive"):
        FL.fused_token_loss(h, w, t, m, tl, row_block=0)
    with pytest.raises(ValueError, match="one value per row"):
        FL.fused_token_loss(h, w, t, torch.ones_like(m), lambda lp, ent, rows: lp.sum())
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        FL.fused_token_loss(h.float(), w.float(), t, m, tl, impl="cuda")


def test_auto_row_block_stays_within_ligers_logits_chunk():
    V = 151_936
    assert FL.auto_row_block(65_536, 2048, V) == 992  # Liger: 1024 rows of V
    assert FL.auto_row_block(16_384, 2048, V) == 224  # Liger: 256
    assert FL.auto_row_block(16_384, 896, V) == 96  # Liger: 128
    assert FL.auto_row_block(65_536, 3584, V) == 1952  # Liger: 2048
    assert FL.auto_row_block(10, 64, 1000) == 32  # never below the alignment
    for n, hid in [(16_384, 896), (65_536, 896), (16_384, 3584), (65_536, 3584), (65_536, 2048)]:
        r = FL.auto_row_block(n, hid, V)
        liger = 1 << (-(-n // -(-V // hid)) - 1).bit_length()
        assert r * (V + 2 * hid) <= liger * V < (r + 32) * (V + 2 * hid)
    with pytest.raises(ValueError):
        FL.auto_row_block(0, 8, 8)


@pytest.mark.parametrize("agg", ALL_AGGS)
def test_aggregation_weights_reproduce_every_aggregation(agg):
    g = torch.Generator().manual_seed(7)
    mask = (torch.rand(5, 8, generator=g) < 0.6).double()
    mask[1] = 0
    v = torch.randn(5, 8, generator=g, dtype=torch.float64)
    c = FL.aggregation_weights(mask, agg, 7.0)
    from training.algos.losses import aggregate

    torch.testing.assert_close((c * v).sum(), aggregate(v, mask, agg, 7.0), rtol=1e-12, atol=1e-12)
    assert (c[mask == 0] == 0).all()


def _policy_case(seed, B=4, T=12, H=8, V=120):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * 3).requires_grad_(True)
    t = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    mask[0] = 0
    with torch.no_grad():
        lp0, _ = masked_lm_head_logprobs(h.reshape(-1, H), w, t.reshape(-1), mask.reshape(-1))
    lp0 = lp0.reshape(B, T)
    old = lp0 + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    ref = lp0 + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    isw = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return h, w, t, mask, old, ref, adv, isw


@pytest.mark.parametrize("agg", ALL_AGGS)
@pytest.mark.parametrize("loss,kl_type,clip_c,weighted", [("ppo_clip", "k3", None, False),
                                                          ("ppo_clip", "k1", 1.5, True),
                                                          ("cispo", "k2", None, True)])
def test_fused_policy_loss_matches_the_reference_chain(agg, loss, kl_type, clip_c, weighted):
    h, w, t, mask, old, ref, adv, isw = _policy_case(seed=len(agg) + len(loss))
    cfg = LossConfig(loss=loss, clip_low=0.2, clip_high=0.28, clip_ratio_c=clip_c, loss_agg=agg, kl_coef=0.05,
                     kl_type=kl_type, entropy_coef=0.01, loss_scale=7.0)
    kw = {"ref_logprobs": ref, "is_weights": isw if weighted else None}
    got, stats, _, _ = FL.fused_policy_loss(h, w, t, mask, old, adv, cfg, row_block=5, **kw)
    got.backward()
    dh, dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    B, T, H = h.shape
    lp_r, ent_r = masked_lm_head_logprobs(h.reshape(-1, H), w, t.reshape(-1), mask.reshape(-1))
    want, stats_r = policy_loss(lp_r.reshape(B, T), old, adv, mask, cfg, entropy=ent_r.reshape(B, T), **kw)
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    assert set(stats) == set(stats_r)
    for k in stats:
        assert stats[k] == pytest.approx(stats_r[k], rel=1e-9, abs=1e-12), k
    torch.testing.assert_close(dh, h.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dw, w.grad, rtol=1e-9, atol=1e-12)
    assert dw.abs().sum() > 0


def test_fused_policy_loss_refuses_sequence_level_losses():
    h, w, t, mask, old, _, adv, _ = _policy_case(seed=1)
    with pytest.raises(ValueError, match="token-local"):
        FL.fused_policy_loss(h, w, t, mask, old, adv, LossConfig(loss="gspo"))
    with pytest.raises(ValueError, match="unknown"):
        FL.fused_policy_loss(h, w, t, mask, old, adv, LossConfig(loss="nope"))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        FL.fused_policy_loss(h.reshape(-1, h.shape[-1]), w, t.reshape(-1), mask.reshape(-1), old, adv)
