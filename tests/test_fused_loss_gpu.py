"""GPU tests of the opt-in fused masked loss's CUDA path (training/model/fused_loss.py; skipped without CUDA).

CPU reference tests beside these: tests/test_fused_loss.py (the torch path, the spec, against autograd through
the reference). Here the CUDA row-block drivers run against float64 references, with the method and
tolerances of tests/test_kernels_gpu.py: fresh random inputs, relative error of the norm (fp32: 1e-4 forward,
1e-3 gradients; bf16: 1e-2 / 2e-2), outputs poisoned through the caching allocator, odd sizes (V not a
multiple of the chunk nor of 8, the last row block partial), all-masked batches, a side stream.
"""

from __future__ import annotations

import pytest
import torch

from training.algos.losses import LOSS_AGGS, LossConfig, masked_lm_head_logprobs, policy_loss
from training.model import fused_loss as FL
from training.model import kernels as K

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/test_fused_loss.py covers "
                                                             "the spec on CPU)"),
]

DEV = "cuda"
TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (1e-2, 2e-2)}


@pytest.fixture(scope="module", autouse=True)
def ext():
    return K.load_extension(verbose=False)  # on a GPU the build must work: a failure is a test failure


def _poison(nbytes: int) -> None:
    buf = torch.full((nbytes + 4096,), 0xFF, dtype=torch.uint8, device=DEV)
    del buf


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    out, ref = out.detach().double(), ref.detach().double()
    den = ref.norm()
    return float((out - ref).norm() / den) if den > 0 else float(out.norm())


def _inputs(N, H, V, dtype, keep, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = (torch.randn(N, H, generator=g, device=DEV) * 1.5).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g, device=DEV) / H**0.5 * 3).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g, device=DEV)
    m = torch.rand(N, generator=g, device=DEV) < keep
    a = torch.randn(N, generator=g, device=DEV)
    b = torch.randn(N, generator=g, device=DEV)
    return h, w, t, m, a, b


def _reference(h, w, t, m, a, b, chunk):
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    lp, ent = masked_lm_head_logprobs(h64, w64, t, m, chunk)
    loss = ((a.double() * lp + b.double() * ent) * m).sum()
    loss.backward()
    return loss.detach(), lp.detach(), ent.detach(), h64.grad, w64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "N,H,V,chunk,row_block,keep",
    [
        (1, 64, 1000, 256, None, 1.0),  # one row
        (1000, 96, 5003, 1024, 97, 0.6),  # V odd (scalar path), last row block partial
        (333, 128, 32000, 8192, None, 0.5),  # auto row block
        (257, 64, 4096, 8192, 64, 0.7),  # chunk larger than V
        (129, 64, 3000, 700, 1, 1.0),  # one row per block
    ],
)
def test_fused_token_loss_matches_reference(dtype, N, H, V, chunk, row_block, keep):
    h, w, t, m, a, b = _inputs(N, H, V, dtype, keep, seed=N + V)
    _poison(N * V * 4)
    loss, lp, ent = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: a[rows] * lp + b[rows] * ent,
                                        row_block=row_block, chunk_size=chunk, impl="cuda")
    (3.0 * loss).backward()
    loss_r, lp_r, ent_r, dh_r, dw_r = _reference(h, w, t, m, a, b, chunk)
    tol_f, tol_b = TOL[dtype]
    assert lp.dtype == torch.float32 and lp.shape == (N,)
    assert (lp[~m] == 0).all() and (h.grad[~m] == 0).all()
    assert _rel(loss.detach().reshape(1), loss_r.reshape(1)) < tol_f
    assert _rel(lp, lp_r) < tol_f and _rel(ent, ent_r) < tol_f
    assert _rel(h.grad, 3.0 * dh_r) < tol_b
    assert _rel(w.grad, 3.0 * dw_r) < tol_b


def test_fused_token_loss_all_masked_and_only_one_gradient():
    h, w, t, m, a, b = _inputs(64, 64, 3000, torch.bfloat16, 0.0, seed=1)
    _poison(3000 * 64 * 2)
    loss, lp, _ = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp, impl="cuda")
    loss.backward()
    assert float(loss.detach()) == 0.0 and (lp == 0).all() and (w.grad == 0).all() and (h.grad == 0).all()
    h, w, t, m, a, b = _inputs(300, 64, 2500, torch.float32, 0.5, seed=2)
    w = w.detach()
    loss, _, _ = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: a[rows] * lp, row_block=50, impl="cuda")
    loss.backward()
    _, _, _, dh_r, _ = _reference(h, w, t, m, a, torch.zeros_like(b), 8192)
    assert w.grad is None and _rel(h.grad, dh_r) < 1e-3


def test_fused_token_loss_matches_the_per_token_kernel_and_is_repeatable():
    # the same bf16 arithmetic as training.model.kernels.masked_logprobs (chunk logits rounded to bf16)
    h, w, t, m, _, _ = _inputs(1000, 256, 30000, torch.bfloat16, 0.6, seed=13)
    runs = [FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp, impl="cuda") for _ in range(2)]
    assert torch.equal(runs[0][1], runs[1][1]), "a moving result is a race"
    lp_k, ent_k = K.masked_logprobs(h, w, t, m, 8192, impl="cuda")
    assert _rel(runs[0][1], lp_k) < 1e-5 and _rel(runs[0][2], ent_k) < 1e-5


def test_fused_token_loss_on_side_stream():
    h, w, t, m, _, _ = _inputs(700, 128, 9000, torch.bfloat16, 0.6, seed=9)
    want = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp, chunk_size=2048, impl="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = FL.fused_token_loss(h, w, t, m, lambda lp, ent, rows: -lp, chunk_size=2048, impl="cuda")
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("agg", tuple(LOSS_AGGS))
@pytest.mark.parametrize("clip_c", [None, 1.5])
def test_fused_policy_loss_matches_reference(agg, clip_c):
    B, T, H, V = 6, 200, 128, 7001
    g = torch.Generator(device=DEV).manual_seed(21)
    h = torch.randn(B, T, H, generator=g, device=DEV, requires_grad=True)
    w = (torch.randn(V, H, generator=g, device=DEV) / H**0.5 * 3).requires_grad_(True)
    t = torch.randint(0, V, (B, T), generator=g, device=DEV)
    mask = (torch.rand(B, T, generator=g, device=DEV) < 0.6).float()
    mask[0] = 0
    with torch.no_grad():
        lp0, _ = K.masked_logprobs(h, w, t, mask, impl="cuda")
    old = lp0 + torch.randn(B, T, generator=g, device=DEV) * 0.4
    ref = lp0 + torch.randn(B, T, generator=g, device=DEV) * 0.3
    adv = torch.randn(B, T, generator=g, device=DEV)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=clip_c, loss_agg=agg, kl_coef=0.05, kl_type="k3",
                     entropy_coef=0.01, loss_scale=50.0)
    loss, stats, _, _ = FL.fused_policy_loss(h, w, t, mask, old, adv, cfg, ref_logprobs=ref, row_block=100, impl="cuda")
    loss.backward()
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    lp_r, ent_r = masked_lm_head_logprobs(h64.reshape(-1, H), w64, t.reshape(-1), mask.reshape(-1))
    loss_r, stats_r = policy_loss(lp_r.reshape(B, T), old.double(), adv.double(), mask.double(), cfg,
                                  ref_logprobs=ref.double(), entropy=ent_r.reshape(B, T))
    loss_r.backward()
    assert abs(loss.item() - loss_r.item()) <= 1e-4 * max(1.0, abs(loss_r.item()))
    for k in stats_r:
        assert stats[k] == pytest.approx(stats_r[k], rel=1e-3, abs=1e-5), k
    assert _rel(h.grad, h64.grad) < 1e-3 and _rel(w.grad, w64.grad) < 1e-3
