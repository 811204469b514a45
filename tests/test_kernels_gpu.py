"""GPU tests: the CUDA kernels against their PyTorch references (skipped without CUDA).

CPU reference tests beside these: tests/test_kernels_reference.py. Method:
fresh random inputs per check (never zeros), error as ||out - ref|| / ||ref|| against the reference in float64
(fp32 kernels: 1e-4 forward / 1e-3 gradients; bf16: 1e-2 forward / 2e-2 gradients, the chunk logits and
logit gradients being rounded to bf16 as a bf16 LM head's are), NaN never passes, outputs poisoned through
the caching allocator before each run, odd sizes (N not a multiple of the block, V not a multiple of the
chunk), all-masked and no-masked batches, and a non-default stream.
"""

from __future__ import annotations

import pytest
import torch

from training.algos.losses import LOSS_AGGS, LossConfig, masked_lm_head_logprobs, policy_loss
from training.model import kernels as K

KERNEL_AGGS = tuple(m for m in LOSS_AGGS if LOSS_AGGS.get(m).kernel_mode is not None)
from training.masking import span_mask_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (CPU reference tests cover the spec)"
    ),
]

DEV = "cuda"
OPEN, CLOSE = (151657, 151658), (151659,)


@pytest.fixture(scope="module", autouse=True)
def ext():
    # on a GPU the build must work: a failure here is a test failure, not a skip
    return K.load_extension(verbose=False)


def _poison(nbytes: int) -> None:
    """Fill a freed block of the caching allocator with 0xFF so an unwritten output shows up."""
    buf = torch.full((nbytes + 4096,), 0xFF, dtype=torch.uint8, device=DEV)
    del buf


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    out, ref = out.detach().double(), ref.detach().double()
    den = ref.norm()
    return float((out - ref).norm() / den) if den > 0 else float(out.norm())


# ---- span mask -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("B,T", [(1, 1), (3, 31), (5, 33), (37, 1000), (8, 4097)])
def test_span_mask_matches_reference(B, T):
    g = torch.Generator().manual_seed(B * 10007 + T)
    vocab = torch.tensor([11, 12, 13, 14, *OPEN, *CLOSE])
    ids = vocab[torch.randint(0, len(vocab), (B, T), generator=g)]
    lengths = torch.randint(0, T + 3, (B,), generator=g)
    plen = torch.randint(0, max(T // 3, 1), (B,), generator=g)
    want_mask, want_turn = span_mask_reference(ids, OPEN, CLOSE, lengths, plen)
    _poison(B * T * 8)
    mask, turn = K.span_mask(ids.to(DEV), OPEN, CLOSE, lengths.to(DEV), plen.to(DEV), impl="cuda")
    assert mask.dtype == torch.bool and turn.dtype == torch.int32 and mask.is_cuda
    assert int(mask.view(torch.uint8).max()) <= 1, "unwritten (poisoned) mask bytes"
    assert torch.equal(mask.cpu(), want_mask)
    assert torch.equal(turn.cpu(), want_turn)


def test_span_mask_realistic_trajectories():
    # policy text, then <information> doc </information> blocks; one unclosed at the end
    row = [1] * 20 + [OPEN[0]] + [5] * 300 + [CLOSE[0]] + [2] * 40 + [OPEN[0]] + [6] * 100
    ids = torch.tensor([row, row[::-1]])
    lengths, plen = torch.tensor([len(row), len(row) - 7]), torch.tensor([10, 0])
    want = span_mask_reference(ids, OPEN, CLOSE, lengths, plen)
    got = K.span_mask(ids.to(DEV), OPEN, CLOSE, lengths.to(DEV), plen.to(DEV), impl="cuda")
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


# ---- masked LM-head log-probs --------------------------------------------------------------------------

TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (1e-2, 2e-2)}


def _lm_inputs(N, H, V, dtype, frac_keep, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = (torch.randn(N, H, generator=g, device=DEV) * 1.5).to(dtype)
    w = (torch.randn(V, H, generator=g, device=DEV) / H**0.5 * 3).to(dtype)
    t = torch.randint(0, V, (N,), generator=g, device=DEV)
    m = torch.rand(N, generator=g, device=DEV) < frac_keep
    return h, w, t, m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "N,H,V,chunk,keep",
    [
        (1, 64, 1000, 256, 1.0),  # single row; V not a multiple of the chunk
        (1000, 96, 5003, 1024, 0.6),  # odd N and V
        (333, 128, 32000, 8192, 0.5),
        (257, 64, 4096, 8192, 0.7),  # chunk larger than V
        (64, 64, 3000, 512, 0.0),  # all masked
        (129, 64, 3000, 700, 1.0),  # nothing masked
    ],
)
def test_masked_logprobs_matches_reference(dtype, N, H, V, chunk, keep):
    h, w, t, m = _lm_inputs(N, H, V, dtype, keep, seed=N + V)
    h.requires_grad_(True)
    w.requires_grad_(True)
    g = torch.Generator(device=DEV).manual_seed(7)
    g_lp, g_ent = torch.randn(N, generator=g, device=DEV), torch.randn(N, generator=g, device=DEV)

    _poison(N * 4 * 8)
    lp, ent = K.masked_logprobs(h, w, t, m, chunk, impl="cuda")
    (lp * g_lp + ent * g_ent).sum().backward()
    dh, dw = h.grad.clone(), w.grad.clone()

    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    lp_r, ent_r = masked_lm_head_logprobs(h64, w64, t, m, chunk)
    (lp_r * g_lp.double() + ent_r * g_ent.double()).sum().backward()

    tol_f, tol_b = TOL[dtype]
    assert lp.dtype == torch.float32 and lp.shape == (N,)
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all() and (dh[~m] == 0).all()
    if keep == 0.0:
        assert (dw == 0).all() and (lp == 0).all()
        return
    assert _rel(lp, lp_r) < tol_f
    assert _rel(ent, ent_r) < tol_f
    assert _rel(dh, h64.grad) < tol_b
    assert _rel(dw, w64.grad) < tol_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_block", [1, 97, 256])
def test_masked_logprobs_row_blocks(dtype, row_block):
    # several row blocks (the last one partial): dW accumulates over blocks, dh rows land at their positions
    N, H, V, chunk = 1000, 96, 5003, 1024
    h, w, t, m = _lm_inputs(N, H, V, dtype, 0.6, seed=row_block)
    h.requires_grad_(True)
    w.requires_grad_(True)
    g = torch.Generator(device=DEV).manual_seed(11)
    g_lp, g_ent = torch.randn(N, generator=g, device=DEV), torch.randn(N, generator=g, device=DEV)
    _poison(N * V * 2)
    lp, ent = K.masked_logprobs(h, w, t, m, chunk, row_block=row_block, impl="cuda")
    (lp * g_lp + ent * g_ent).sum().backward()
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    lp_r, ent_r = masked_lm_head_logprobs(h64, w64, t, m, chunk)
    (lp_r * g_lp.double() + ent_r * g_ent.double()).sum().backward()
    tol_f, tol_b = TOL[dtype]
    assert (h.grad[~m] == 0).all() and (lp[~m] == 0).all()
    assert _rel(lp, lp_r) < tol_f and _rel(ent, ent_r) < tol_f
    assert _rel(h.grad, h64.grad) < tol_b
    assert _rel(w.grad, w64.grad) < tol_b


def test_masked_logprobs_bf16_matches_same_dtype_reference():
    # same bf16 rounding of the chunk logits as the reference's bf16 matmul: tighter agreement
    h, w, t, m = _lm_inputs(500, 256, 20000, torch.bfloat16, 0.6, seed=3)
    lp, ent = K.masked_logprobs(h, w, t, m, 4096, impl="cuda")
    lp_r, ent_r = masked_lm_head_logprobs(h, w, t, m, 4096)
    assert _rel(lp, lp_r) < 5e-3 and _rel(ent, ent_r) < 5e-3


def test_masked_logprobs_only_hidden_or_weight_grad_and_no_entropy_grad():
    h, w, t, m = _lm_inputs(300, 64, 2500, torch.float32, 0.5, seed=5)
    h.requires_grad_(True)
    lp, _ = K.masked_logprobs(h, w, t, m, 1000, impl="cuda")  # entropy unused: g_ent is None
    (lp.sum()).backward()
    h64 = h.detach().double().requires_grad_(True)
    lp_r, _ = masked_lm_head_logprobs(h64, w.double(), t, m, 1000)
    lp_r.sum().backward()
    assert w.grad is None
    assert _rel(h.grad, h64.grad) < 1e-3


def test_masked_logprobs_on_side_stream_and_auto_dispatch(monkeypatch):
    h, w, t, m = _lm_inputs(700, 128, 9000, torch.bfloat16, 0.6, seed=9)
    want = K.masked_logprobs(h, w, t, m, 2048, impl="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = K.masked_logprobs(h, w, t, m, 2048, impl="cuda")
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def boom(*a, **k):
        raise AssertionError("auto on CUDA tensors must use the kernel")

    monkeypatch.setattr(K, "masked_lm_head_logprobs", boom)
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    auto = K.masked_logprobs(h, w, t, m, 2048)
    assert torch.equal(auto[0], want[0])


def test_masked_logprobs_repeatable():
    h, w, t, m = _lm_inputs(1000, 256, 30000, torch.bfloat16, 0.6, seed=13)
    a = K.masked_logprobs(h, w, t, m, 8192, impl="cuda")
    b = K.masked_logprobs(h, w, t, m, 8192, impl="cuda")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "a moving result is a race"


# ---- PPO-clip loss -------------------------------------------------------------------------------------


def _ppo_inputs(B, T, seed, keep=0.7):
    g = torch.Generator(device=DEV).manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, device=DEV) * 3
    old = lp + torch.randn(B, T, generator=g, device=DEV) * 0.4
    adv = torch.randn(B, T, generator=g, device=DEV)
    ref = lp + torch.randn(B, T, generator=g, device=DEV) * 0.3
    ent = torch.rand(B, T, generator=g, device=DEV) * 2
    mask = (torch.rand(B, T, generator=g, device=DEV) < keep).float()
    if B > 1:
        mask[0] = 0  # one all-masked row
    return lp, old, adv, mask, ref, ent


@pytest.mark.parametrize("B,T", [(1, 1), (7, 1000), (300, 33)])
@pytest.mark.parametrize("agg", KERNEL_AGGS)
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
@pytest.mark.parametrize("keep", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("clip_c", [None, 1.5])
def test_policy_loss_matches_reference(B, T, agg, kl_type, keep, clip_c):
    lp, old, adv, mask, ref, ent = _ppo_inputs(B, T, seed=B * T, keep=keep)
    if keep == 1.0:
        mask.fill_(1.0)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg=agg, kl_coef=0.05, kl_type=kl_type, entropy_coef=0.01,
                     clip_ratio_c=clip_c)
    lp_k, ent_k = lp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    _poison(B * T * 4 * 4)
    loss, stats = K.policy_loss(lp_k, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent_k, impl="cuda")
    loss.backward()
    lp_r, ent_r = lp.double().requires_grad_(True), ent.double().requires_grad_(True)
    loss_r, stats_r = policy_loss(lp_r, old.double(), adv.double(), mask.double(), cfg, ref_logprobs=ref.double(),
                                  entropy=ent_r)
    loss_r.backward()
    assert set(stats) == set(stats_r)
    assert abs(loss.item() - loss_r.item()) <= 1e-5 * max(1.0, abs(loss_r.item()))
    for k in stats:
        assert abs(stats[k] - stats_r[k]) <= 1e-5 * max(1.0, abs(stats_r[k])), k
    if clip_c is not None and keep > 0 and B * T > 1000:
        assert stats["clip_frac_lower"] > 0.01  # the dual-clip branch is exercised
    if keep == 0.0:
        assert float(loss) == 0.0 and (lp_k.grad == 0).all() and (ent_k.grad == 0).all()
    else:
        assert _rel(lp_k.grad, lp_r.grad) < 1e-5
        assert _rel(ent_k.grad, ent_r.grad) < 1e-5


@pytest.mark.parametrize("agg", KERNEL_AGGS)
@pytest.mark.parametrize("clip_c", [None, 1.5])
def test_policy_loss_with_importance_weights_matches_reference(agg, clip_c):
    """The rollout correction's per-token weights reach the kernel folded into the advantages; loss, stats
    and gradient equal the reference's weighted policy term (CPU side: tests/test_offpolicy.py)."""
    lp, old, adv, mask, ref, ent = _ppo_inputs(64, 50, seed=5)
    w = (torch.rand(64, 50, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)) * 3).clamp(max=2.0)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg=agg, kl_coef=0.05, kl_type="k3", entropy_coef=0.01,
                     clip_ratio_c=clip_c)
    lp_k = lp.clone().requires_grad_(True)
    loss, stats = K.policy_loss(lp_k, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent, impl="cuda", is_weights=w)
    loss.backward()
    lp_r = lp.double().requires_grad_(True)
    loss_r, stats_r = policy_loss(lp_r, old.double(), adv.double(), mask.double(), cfg, ref_logprobs=ref.double(),
                                  entropy=ent.double(), is_weights=w.double())
    loss_r.backward()
    assert abs(loss.item() - loss_r.item()) <= 1e-5 * max(1.0, abs(loss_r.item()))
    assert abs(stats["pg_loss"] - stats_r["pg_loss"]) <= 1e-5 * max(1.0, abs(stats_r["pg_loss"]))
    assert _rel(lp_k.grad, lp_r.grad) < 1e-5


@pytest.mark.parametrize("agg", KERNEL_AGGS)
def test_policy_loss_k3_clamps_match_reference(agg):
    """k3's two clamps (log-ratio +-20, estimate <= 10, as verl's low_var_kl) in the kernel as in the
    reference: a reference model far from the policy puts many tokens past them."""
    lp, old, adv, mask, _, ent = _ppo_inputs(64, 300, seed=5)
    g = torch.Generator(device=DEV).manual_seed(6)
    ref = lp + torch.randn(lp.shape, generator=g, device=DEV) * 12
    d = ref - lp
    clamped = ((d > 20) | (d < -20) | (torch.exp(d.clamp(-20, 20)) - d.clamp(-20, 20) - 1 > 10)) & (mask > 0)
    assert 0.2 < float(clamped.sum() / mask.sum()) < 0.9  # both sides of the clamps are exercised
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg=agg, kl_coef=0.1, kl_type="k3")
    lp_k = lp.clone().requires_grad_(True)
    loss, stats = K.policy_loss(lp_k, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent, impl="cuda")
    loss.backward()
    lp_r = lp.double().requires_grad_(True)
    loss_r, stats_r = policy_loss(lp_r, old.double(), adv.double(), mask.double(), cfg, ref_logprobs=ref.double(),
                                  entropy=ent.double())
    loss_r.backward()
    assert abs(loss.item() - loss_r.item()) <= 1e-5 * max(1.0, abs(loss_r.item()))
    for k in stats:
        assert abs(stats[k] - stats_r[k]) <= 1e-5 * max(1.0, abs(stats_r[k])), k
    assert _rel(lp_k.grad, lp_r.grad) < 1e-5


def test_policy_loss_without_optional_terms_and_nan_at_masked_positions():
    lp, old, adv, mask, _, _ = _ppo_inputs(16, 257, seed=1)
    lp = lp.masked_fill(mask == 0, float("nan"))  # garbage where masked must not leak
    lp_k = lp.clone().requires_grad_(True)
    loss, stats = K.policy_loss(lp_k, old, adv, mask, impl="cuda")
    loss.backward()
    clean = torch.where(mask > 0, lp, -1.0).double().requires_grad_(True)
    loss_r, stats_r = policy_loss(clean, old.double(), adv.double(), mask.double())
    loss_r.backward()
    assert set(stats) == set(stats_r) == {"pg_loss", "clip_frac", "approx_kl", "ratio_mean"}
    for k in stats:
        assert abs(stats[k] - stats_r[k]) <= 1e-5 * max(1.0, abs(stats_r[k])), k
    assert abs(float(loss) - float(loss_r)) < 1e-5
    assert torch.isfinite(lp_k.grad).all()
    assert _rel(lp_k.grad, clean.grad) < 1e-5


def test_end_to_end_kernels_chain():
    # masked_logprobs -> policy_loss -> backward to hidden states and LM head, against the reference chain
    B, T, H, V = 4, 300, 128, 7001
    g = torch.Generator(device=DEV).manual_seed(21)
    h = torch.randn(B, T, H, generator=g, device=DEV, dtype=torch.float32)
    w = torch.randn(V, H, generator=g, device=DEV) / H**0.5 * 3
    t = torch.randint(0, V, (B, T), generator=g, device=DEV)
    mask = (torch.rand(B, T, generator=g, device=DEV) < 0.6).float()
    adv = torch.randn(B, 1, generator=g, device=DEV).expand(B, T).contiguous()

    def run(impl):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = K.masked_logprobs(hh, ww, t, mask.bool(), 2048, impl=impl)
        old = lp.detach() + 0.1 * torch.sin(torch.arange(B * T, device=DEV, dtype=torch.float32)).reshape(
            B, T
        )
        loss, _ = K.policy_loss(lp, old, adv, mask, LossConfig(entropy_coef=0.01), entropy=ent, impl=impl)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    lk, hk, wk = run("cuda")
    lr, hr, wr = run("reference")
    assert abs(float(lk) - float(lr)) < 1e-4
    assert _rel(hk, hr) < 1e-3 and _rel(wk, wr) < 1e-3


@pytest.mark.parametrize("packed", [False, True])
def test_policy_logprobs_kernel_under_autocast(monkeypatch, packed):
    # the trainer's path: a Hugging Face policy with an fp32 LM head run under bf16 autocast, so the kernel
    # gets bf16 hidden states and an fp32 weight; it must agree with the reference under the same autocast
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from training.batch import Batch
    from training.model.forward import policy_logprobs

    torch.manual_seed(0)
    V, N, T = 3001, 4, 96
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    model = Qwen2ForCausalLM(cfg).to(DEV)
    lengths = torch.tensor([96, 80, 50, 33])
    attn = (torch.arange(T) < lengths[:, None]).long()
    ids = torch.randint(1, V, (N, T)) * attn
    loss_mask = ((torch.rand(N, T - 1) < 0.6) & attn[:, 1:].bool()).float()
    zeros = torch.zeros(N, T, dtype=torch.long)
    batch = Batch(ids, attn, zeros, loss_mask, zeros, torch.zeros(N), torch.arange(N))
    got = {}
    for impl in ("cuda", "reference"):
        monkeypatch.setenv(K.ENV_VAR, impl)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, ent = policy_logprobs(model, batch, packed=packed)
        (lp.sum() + 0.1 * ent.sum()).backward()
        got[impl] = (
            lp.detach(),
            ent.detach(),
            model.lm_head.weight.grad.clone(),
            model.model.embed_tokens.weight.grad.clone(),
        )
    (lp_k, ent_k, gw_k, ge_k), (lp_r, ent_r, gw_r, ge_r) = got["cuda"], got["reference"]
    assert lp_k.shape == (N, T - 1) and (lp_k[loss_mask == 0] == 0).all()
    assert _rel(lp_k, lp_r) < 1e-2 and _rel(ent_k, ent_r) < 1e-2
    assert _rel(gw_k, gw_r) < 3e-2 and _rel(ge_k, ge_r) < 5e-2
