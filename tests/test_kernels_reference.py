"""CPU tests of the kernels' PyTorch references (the spec) and of the kernels' algorithms, emulated in torch.

The references (training.masking.span_mask_reference, training.algos.losses.masked_lm_head_logprobs /
policy_loss) are checked against straightforward float64 implementations, with gradcheck on small
shapes. The CUDA kernels' own algorithms -- the warp scan over the (a, b) depth monoid, the per-thread online
softmax merge, the closed-form logit gradient and the PPO per-token gradient with torch's subgradient
conventions -- are emulated here in torch and checked against the references, so a wrong formula fails on CPU.
The kernels themselves run in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from training.algos.losses import (
    LOSS_AGGS,
    LossConfig,
    aggregate,
    kl_estimate,
    masked_lm_head_logprobs,
    policy_loss,
)
from training.model import kernels as K

#: the aggregation modes the CUDA loss kernel implements (the reference implements every registered one)
KERNEL_AGGS = tuple(m for m in LOSS_AGGS if LOSS_AGGS.get(m).kernel_mode is not None)
ALL_AGGS = tuple(LOSS_AGGS)
NORM_SCALE = 7.0  # seq-mean-token-sum-norm's constant in these tests (the others ignore it)
from training.masking import span_mask_reference

OPEN, CLOSE = (7, 8), (9,)


# ---- span mask -----------------------------------------------------------------------------------------


def _span_naive(ids: list[int], n: int, p: int, opens, closes) -> tuple[list[int], list[int]]:
    """Straightforward stack-based statement of the span semantics (one row)."""
    stack: list[int] = []
    mask, turn, t_idx = [0] * len(ids), [0] * len(ids), 1
    for t in range(p, min(n, len(ids))):
        turn[t] = t_idx
        if ids[t] in opens:
            stack.append(t)
        elif ids[t] in closes:
            if stack:
                stack.pop()
                if not stack:
                    t_idx += 1
        elif not stack:
            mask[t] = 1
    return mask, turn


def _span_warp_emulation(ids: list[int], n: int, p: int, opens, closes) -> tuple[list[int], list[int]]:
    """cuda/span_mask.cu's algorithm: tiles of 32, Hillis-Steele scan over (a, b), ballot of closing events."""
    T = len(ids)
    mask, turn = [0] * T, [0] * T
    depth, turn_idx = 0, 1
    for base in range(0, T, 32):
        lanes = range(32)
        act = [base + i < T and p <= base + i < n for i in lanes]
        is_open = [act[i] and ids[base + i] in opens for i in lanes]
        is_close = [act[i] and not is_open[i] and ids[base + i] in closes for i in lanes]
        a = [1 if is_open[i] else (-1 if is_close[i] else 0) for i in lanes]
        b = [1 if is_open[i] else 0 for i in lanes]
        o = 1
        while o < 32:
            a2, b2 = a[:], b[:]
            for i in lanes:
                if i >= o:
                    b2[i] = max(b[i - o] + a[i], b[i])
                    a2[i] = a[i - o] + a[i]
            a, b, o = a2, b2, o * 2
        after = [max(depth + a[i], b[i]) for i in lanes]
        before = [depth] + after[:-1]
        event = [is_close[i] and before[i] > 0 and after[i] == 0 for i in lanes]
        for i in lanes:
            t = base + i
            if t < T:
                mask[t] = int(act[i] and not is_open[i] and not is_close[i] and before[i] == 0)
                turn[t] = turn_idx + sum(event[:i]) if act[i] else 0
        depth, turn_idx = after[31], turn_idx + sum(event)
    return mask, turn


def _rows(mask, turn, b):
    return mask[b].int().tolist(), turn[b].tolist()


def test_span_mask_hand_cases():
    P = 0  # pad id
    seqs = [
        # prompt(2) | policy 1 2 | <open> doc doc </close> | policy 3 | pad pad
        ([5, 5, 1, 2, 7, 4, 4, 9, 3, P, P], 9, 2),
        # unclosed span masks to the end
        ([5, 1, 7, 4, 4, 4, 4, 4, 4, 4, 4], 11, 1),
        # nested/repeated opens (two kinds) need as many closes; stray closers first
        ([9, 9, 1, 7, 8, 4, 9, 4, 9, 2, 9], 11, 0),
        # empty row and a row shorter than its prompt
        ([P] * 11, 0, 0),
        ([5, 5, 5, P, P, P, P, P, P, P, P], 3, 5),
    ]
    ids = torch.tensor([s for s, _, _ in seqs])
    lengths = torch.tensor([n for _, n, _ in seqs])
    plen = torch.tensor([p for _, _, p in seqs])
    mask, turn = span_mask_reference(ids, OPEN, CLOSE, lengths, plen)
    assert mask.dtype == torch.bool and turn.dtype == torch.int32
    assert _rows(mask, turn, 0) == ([0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 2, 0, 0])
    assert _rows(mask, turn, 1) == ([0, 1] + [0] * 9, [0] + [1] * 10)
    # stray 9 9 ignored; 7 8 nest to depth 2; first 9 -> depth 1 (same turn), second 9 -> depth 0 (turn 2)
    assert _rows(mask, turn, 2) == ([0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2])
    assert _rows(mask, turn, 3) == ([0] * 11, [0] * 11)
    assert _rows(mask, turn, 4) == ([0] * 11, [0] * 11)


def test_span_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="both open and close"):
        span_mask_reference(
            torch.zeros(1, 3, dtype=torch.long), [1], [1], torch.tensor([3]), torch.tensor([0])
        )
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        span_mask_reference(torch.zeros(3, dtype=torch.long), [1], [2], torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="both open and close"):
        K.span_mask(torch.zeros(1, 3, dtype=torch.long), [1], [1], torch.tensor([3]), torch.tensor([0]))


@pytest.mark.parametrize("seed", range(4))
def test_span_mask_reference_and_warp_algorithm_match_naive(seed):
    rng = random.Random(seed)
    B, T = 12, 150  # several 32-token tiles, T not a multiple of 32
    vocab = [1, 2, 3, 7, 8, 9]  # markers frequent enough for deep nesting and stray closers
    ids = [[rng.choice(vocab) for _ in range(T)] for _ in range(B)]
    lengths = [rng.randint(0, T + 5) for _ in range(B)]  # some longer than T: clipped
    plen = [rng.randint(0, 40) for _ in range(B)]
    mask, turn = span_mask_reference(
        torch.tensor(ids), OPEN, CLOSE, torch.tensor(lengths), torch.tensor(plen)
    )
    for b in range(B):
        want = _span_naive(ids[b], lengths[b], plen[b], set(OPEN), set(CLOSE))
        assert _rows(mask, turn, b) == (want[0], want[1])
        assert _span_warp_emulation(ids[b], lengths[b], plen[b], set(OPEN), set(CLOSE)) == want


def test_span_mask_dispatch_on_cpu_is_reference():
    ids = torch.randint(0, 12, (3, 40))
    args = (ids, OPEN, CLOSE, torch.tensor([40, 20, 0]), torch.tensor([3, 0, 0]))
    got = K.span_mask(*args)
    want = span_mask_reference(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_span_mask_with_more_markers_than_the_kernel_takes_falls_back_under_auto(monkeypatch):
    """Under ``auto`` (the default) on CUDA tensors, more than 16 open or close ids go to the reference
    instead of raising; only a forced kernel (``impl="cuda"``) refuses them. The CUDA side is faked: the
    extension must not even be asked for."""
    monkeypatch.setattr(K, "_use_cuda", lambda impl, *t: True)
    monkeypatch.setattr(K, "load_extension", lambda: pytest.fail("the kernel was called with 17 open ids"))
    opens, closes = list(range(100, 117)), [7]
    ids = torch.tensor([[1, 100, 5, 7, 116, 6, 7, 3]])
    args = (ids, opens, closes, torch.tensor([8]), torch.tensor([1]))
    got, want = K.span_mask(*args), span_mask_reference(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].any()
    with pytest.raises(ValueError, match="at most 16"):
        K.span_mask(*args, impl="cuda")


# ---- masked LM-head log-probs --------------------------------------------------------------------------


def _lm_naive(h, w, t, m):
    """Float64, full [N, V] log-softmax: the straightforward statement."""
    logp = torch.log_softmax(h.double() @ w.double().T, -1)
    lp = logp.gather(-1, t[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    keep = m.bool()
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64])  # 1 and 7 don't divide V=50; 64 > V
def test_masked_lm_head_logprobs_matches_naive(chunk):
    g = torch.Generator().manual_seed(chunk)
    N, H, V = 13, 8, 50
    h, w = torch.randn(N, H, generator=g) * 2, torch.randn(V, H, generator=g)
    t, m = torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g) > 0.4
    lp, ent = masked_lm_head_logprobs(h, w, t, m, chunk)
    lp_n, ent_n = _lm_naive(h, w, t, m)
    assert lp.dtype == torch.float32 and lp.shape == (N,)
    torch.testing.assert_close(lp.double(), lp_n, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_n, rtol=1e-5, atol=1e-5)
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
    assert (ent[m] > 0).all() and (lp[m] < 0).all()


@pytest.mark.parametrize("keep", ["some", "none", "all"])
def test_masked_lm_head_logprobs_gradcheck(keep):
    g = torch.Generator().manual_seed(1)
    N, H, V = 5, 3, 11
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,), generator=g)
    m = {"some": torch.tensor([1, 0, 1, 1, 0]), "none": torch.zeros(N), "all": torch.ones(N)}[keep].bool()
    cw = torch.randn(N, dtype=torch.float64, generator=g)

    def f(h, w):
        lp, ent = masked_lm_head_logprobs(h, w, t, m, chunk_size=4)
        return (lp * cw).sum() + (ent * cw.flip(0)).sum()

    assert torch.autograd.gradcheck(f, (h, w))
    gh, gw = torch.autograd.grad(f(h, w), (h, w))
    assert (gh[~m] == 0).all()
    if keep == "none":
        assert (gw == 0).all()


def _kernel_emulation(h, w, t, g_lp, g_ent, chunk, row_block, vec=4, threads=3):
    """masked_logprobs.cu's and sleuth_kernels.cpp's math: rows in blocks of ``row_block`` x vocabulary
    chunks; in a chunk, 'thread' k owns the vectors k, k + threads, ... of ``vec`` consecutive columns, folds
    each vector into its online-softmax state with one rescale (the vector's own max first) and the
    ``c % vec`` tail column by column; partials merge per row. Backward per tile: the closed-form
    dz = g_lp (onehot - p) - g_ent p (z - E[z]), dH of the block summed over chunks, dW summed over blocks."""
    n, V = h.shape[0], w.shape[0]
    lp, ent, lse_all = (
        torch.zeros(n, dtype=h.dtype),
        torch.zeros(n, dtype=h.dtype),
        torch.zeros(n, dtype=h.dtype),
    )

    def merge(x, y):
        m = torch.maximum(x[0], y[0])
        ex = torch.where(x[0] == float("-inf"), 0.0, torch.exp(x[0] - m))
        ey = torch.where(y[0] == float("-inf"), 0.0, torch.exp(y[0] - m))
        return m, x[1] * ex + y[1] * ey, x[2] * ex + y[2] * ey

    for r0 in range(0, n, row_block):
        hb, tb = h[r0 : r0 + row_block], t[r0 : r0 + row_block]
        r = hb.shape[0]
        run = (
            torch.full((r,), float("-inf"), dtype=h.dtype),
            torch.zeros(r, dtype=h.dtype),
            torch.zeros(r, dtype=h.dtype),
        )
        tgt = torch.zeros(r, dtype=h.dtype)
        for s in range(0, V, chunk):
            z = hb @ w[s : s + chunk].T
            c = z.shape[1]
            nvec = c // vec
            for k in range(threads):
                st = (
                    torch.full((r,), float("-inf"), dtype=h.dtype),
                    torch.zeros(r, dtype=h.dtype),
                    torch.zeros(r, dtype=h.dtype),
                )
                for i in range(k, nvec, threads):  # one vector: its max, one rescale, then its exps
                    x = z[:, i * vec : (i + 1) * vec]
                    st = merge(
                        st,
                        (
                            x.max(-1).values,
                            torch.exp(x - x.max(-1).values[:, None]).sum(-1),
                            (torch.exp(x - x.max(-1).values[:, None]) * x).sum(-1),
                        ),
                    )
                for j in range(nvec * vec + k, c, threads):  # the scalar tail
                    x = z[:, j]
                    st = merge(st, (x, torch.ones_like(x), x))
                run = merge(run, st)
            inside = (tb >= s) & (tb < s + c)
            tgt = torch.where(inside, z.gather(-1, (tb - s).clamp(0, c - 1)[:, None]).squeeze(-1), tgt)
        lse = run[0] + torch.log(run[1])
        lp[r0 : r0 + r], ent[r0 : r0 + r], lse_all[r0 : r0 + r] = tgt - lse, lse - run[2] / run[1], lse
    dh, dw = torch.zeros_like(h), torch.zeros_like(w)
    for r0 in range(0, n, row_block):
        hb, tb = h[r0 : r0 + row_block], t[r0 : r0 + row_block]
        sl = slice(r0, r0 + hb.shape[0])
        dh_b = torch.zeros_like(hb)
        for s in range(0, V, chunk):
            z = hb @ w[s : s + chunk].T
            p = torch.exp(z - lse_all[sl, None])
            dz = -g_lp[sl, None] * p - g_ent[sl, None] * p * (z - (lse_all[sl] - ent[sl])[:, None])
            inside = (tb >= s) & (tb < s + z.shape[1])
            rows = inside.nonzero().squeeze(-1)
            dz[rows, tb[rows] - s] += g_lp[sl][rows]
            dh_b += dz @ w[s : s + chunk]
            dw[s : s + chunk] += dz.T @ hb
        dh[sl] = dh_b
    return lp, ent, dh, dw


@pytest.mark.parametrize("row_block", [2, 4, 9])
def test_kernel_logprob_algorithm_matches_reference_autograd(row_block):
    g = torch.Generator().manual_seed(3)
    n, H, V = 9, 6, 37
    h = torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (n,), generator=g)
    g_lp, g_ent = (
        torch.randn(n, generator=g, dtype=torch.float64),
        torch.randn(n, generator=g, dtype=torch.float64),
    )
    lp, ent = masked_lm_head_logprobs(h, w, t, torch.ones(n, dtype=torch.bool), chunk_size=10)
    dh, dw = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))
    with torch.no_grad():  # chunks of 10 (vectors of 4 + a tail of 2) and the last chunk of 7 (4 + 3)
        lp_k, ent_k, dh_k, dw_k = _kernel_emulation(h, w, t, g_lp, g_ent, chunk=10, row_block=row_block)
    for a, b in ((lp_k, lp), (ent_k, ent), (dh_k, dh), (dw_k, dw)):
        torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-10)


def test_masked_logprobs_dispatch_cpu_and_validation():
    N, H, V = 6, 4, 10
    h, w = torch.randn(2, 3, H), torch.randn(V, H)
    t, m = torch.randint(0, V, (2, 3)), torch.ones(2, 3, dtype=torch.bool)
    lp, ent = K.masked_logprobs(h, w, t, m, 4)
    lp_r, ent_r = masked_lm_head_logprobs(h.reshape(N, H), w, t.reshape(N), m.reshape(N), 4)
    assert lp.shape == (2, 3)
    torch.testing.assert_close(lp.reshape(N), lp_r)
    torch.testing.assert_close(ent.reshape(N), ent_r)
    with pytest.raises(ValueError, match="must lie in"):
        K.masked_logprobs(h, w, torch.full((2, 3), V), m)
    with pytest.raises(ValueError, match="disagree"):
        K.masked_logprobs(h, w, t.reshape(N), m)
    with pytest.raises(ValueError, match="chunk_size"):
        K.masked_logprobs(h, w, t, m, 0)


# ---- PPO-clip loss -------------------------------------------------------------------------------------


def _ppo_naive(
    lp, old, adv, mask, *, cl, ch, agg, ref=None, kl_coef=0.0, kl_type="k3", ent=None, ent_coef=0.0
):
    """Loop-by-loop float64 statement of the masked PPO-clip loss (PPO, DAPO clip-higher, verl agg_loss)."""
    B, T = lp.shape
    per = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            r = torch.exp((lp[b, t] - old[b, t]).clamp(-20, 20))
            v = torch.maximum(-adv[b, t] * r, -adv[b, t] * r.clamp(1 - cl, 1 + ch))
            if ref is not None and kl_coef > 0:
                if kl_type == "k1":
                    v = v + kl_coef * (lp[b, t] - ref[b, t])
                else:
                    d = (ref[b, t] - lp[b, t]).clamp(-20, 20)
                    v = v + kl_coef * min(torch.exp(d) - d - 1, 10.0)
            if ent is not None:
                v = v - ent_coef * ent[b, t]
            per[b][t] = v
    sums = [sum(per[b][t] * mask[b, t] for t in range(T)) for b in range(B)]
    counts = [float(mask[b].sum()) for b in range(B)]
    if agg == "token-mean":
        return sum(sums) / max(sum(counts), 1.0)
    if agg == "seq-mean-token-sum":  # over the rows that hold policy tokens (verl's agg_loss)
        return sum(sums) / max(sum(c > 0 for c in counts), 1)
    if agg == "seq-mean-token-sum-norm":  # Dr. GRPO: each row's sum over a constant, mean over those rows
        return sum(sums) / (NORM_SCALE * max(sum(c > 0 for c in counts), 1))
    rows = [sums[b] / max(counts[b], 1.0) for b in range(B) if counts[b] > 0]
    return sum(rows) / max(len(rows), 1)


def _ppo_inputs(B=3, T=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    old = lp + torch.randn(B, T, generator=g, dtype=dtype) * 0.4  # ratios on both sides of the clip range
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    ref = lp + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    ent = torch.rand(B, T, generator=g, dtype=dtype) * 2
    mask = (torch.rand(B, T, generator=g) > 0.3).to(dtype)
    mask[-1] = 0  # one all-masked row: seq-mean-token-mean must skip it
    return lp, old, adv, mask, ref, ent


@pytest.mark.parametrize("agg", ALL_AGGS)
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_policy_loss_matches_naive(agg, kl_type):
    lp, old, adv, mask, ref, ent = _ppo_inputs(seed=ALL_AGGS.index(agg))
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg=agg, kl_coef=0.1, loss_scale=NORM_SCALE, kl_type=kl_type,
                     entropy_coef=0.01)
    loss, stats = policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
    want = _ppo_naive(
        lp,
        old,
        adv,
        mask,
        cl=0.2,
        ch=0.28,
        agg=agg,
        ref=ref,
        kl_coef=0.1,
        kl_type=kl_type,
        ent=ent,
        ent_coef=0.01,
    )
    torch.testing.assert_close(loss, torch.as_tensor(want, dtype=loss.dtype), rtol=1e-12, atol=1e-12)
    assert set(stats) == {"pg_loss", "clip_frac", "approx_kl", "ratio_mean", "kl", "entropy"}
    assert 0.0 < stats["clip_frac"] < 1.0  # the inputs exercise both branches


@pytest.mark.parametrize("agg", ALL_AGGS)
def test_policy_loss_gradcheck(agg):
    lp, old, adv, mask, ref, ent = _ppo_inputs(seed=7)
    lp.requires_grad_(True)
    ent.requires_grad_(True)

    def f(lp, ent):
        cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg=agg, kl_coef=0.1, entropy_coef=0.01,
                         loss_scale=NORM_SCALE)
        return policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)[0]

    assert torch.autograd.gradcheck(f, (lp, ent))


def _ppo_kernel_emulation(lp, old, adv, mask, *, cl, ch, agg, ref, kl_coef, kl_type, ent_coef, clip_c=None):
    """cuda/ppo_loss.cu's backward: row weights w_b per mode and the per-token closed-form gradient with
    torch's conventions (clamp passes gradient on its closed interval, maximum splits ties in half); a
    dual-clipped token (A < 0, -A c below the clipped loss) has none."""
    B = lp.shape[0]
    n_b = mask.sum(-1)
    if agg == "token-mean":
        w = torch.full((B,), 1.0 / max(float(n_b.sum()), 1.0), dtype=lp.dtype)
    elif agg == "seq-mean-token-sum":
        w = (n_b > 0).to(lp.dtype) / max(float((n_b > 0).sum()), 1.0)
    else:
        w = torch.where(n_b > 0, 1.0 / n_b.clamp(min=1) / max(float((n_b > 0).sum()), 1.0), 0.0)
    raw = lp - old
    dclamp = ((raw >= -20) & (raw <= 20)).to(lp.dtype)
    r = torch.exp(raw.clamp(-20, 20))
    lo, hi = 1 - cl, 1 + ch
    pg1, pg2 = -adv * r, -adv * r.clamp(lo, hi)
    d1 = -adv * r
    d2 = torch.where((r >= lo) & (r <= hi), -adv * r, 0.0)
    d = torch.where(pg1 > pg2, d1, torch.where(pg1 < pg2, d2, 0.5 * (d1 + d2))) * dclamp
    if clip_c is not None:
        d = torch.where((adv < 0) & (-adv * clip_c < torch.maximum(pg1, pg2)), 0.0, d)
    if kl_type == "k1":
        dk = torch.ones_like(lp)
    else:
        rr = ref - lp
        inside = (rr >= -20) & (rr <= 20) & (torch.exp(rr) - rr - 1 <= 10)  # k3's two clamps (verl's low_var_kl)
        dk = torch.where(inside, 1 - torch.exp(rr), 0.0)
    scale = mask * w[:, None]
    return scale * (d + kl_coef * dk), -ent_coef * scale


@pytest.mark.parametrize("agg", KERNEL_AGGS)
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_ppo_kernel_gradient_formula_matches_autograd(agg, kl_type, clip_c):
    lp, old, adv, mask, ref, ent = _ppo_inputs(B=4, T=6, seed=11)
    old[2, :3] = lp[2, :3] - torch.tensor([2.0, 0.5, 2.0], dtype=lp.dtype)  # ratios e^2 > c and e^0.5 < c
    adv[2, :3] = torch.tensor([-0.7, -0.7, 0.7], dtype=lp.dtype)  # dual-clipped only at A < 0 and r > c
    mask[2, :3] = 1.0
    old[0, 0] = lp[0, 0]  # ratio exactly 1: a tie of the two surrogate branches
    old[0, 1] = lp[0, 1] - 30.0  # log-ratio beyond the +-20 clamp: no gradient
    ref[1, 0] = lp[1, 0] + 25.0  # k3: log-ratio clamp
    ref[1, 1] = lp[1, 1] + 4.0  # k3: estimate clamp (e^4 - 5 > 10)
    ref[1, 2] = lp[1, 2] - 12.0  # k3: estimate clamp from below the log-ratio clamp (e^-12 + 11 > 10)
    lp.requires_grad_(True)
    ent.requires_grad_(True)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg=agg, kl_coef=0.1, kl_type=kl_type, clip_ratio_c=clip_c,
                     entropy_coef=0.01)
    loss, stats = policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
    assert stats.get("clip_frac_lower", 0.0) == (1 / mask.sum() if clip_c else 0.0)  # the one token [2, 0]
    g_lp, g_ent = torch.autograd.grad(loss, (lp, ent))
    e_lp, e_ent = _ppo_kernel_emulation(
        lp.detach(),
        old,
        adv,
        mask,
        cl=0.2,
        ch=0.28,
        agg=agg,
        ref=ref,
        kl_coef=0.1,
        kl_type=kl_type,
        ent_coef=0.01,
        clip_c=clip_c,
    )
    torch.testing.assert_close(e_lp, g_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(e_ent, g_ent, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("agg", ALL_AGGS)
def test_policy_loss_ignores_nan_and_inf_at_masked_positions(agg):
    """CPU side of the GPU test ``..._nan_at_masked_positions``: the kernel selects masked positions away
    (cuda/ppo_loss.cu), so NaN/inf there never reach the loss, stats or gradient; the reference (the spec,
    and the path on CPU) must do the same, not multiply them by 0 (NaN * 0 = NaN)."""
    lp, old, adv, mask, ref, ent = _ppo_inputs(B=4, T=6, seed=5)
    off = mask == 0
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, loss_scale=NORM_SCALE)

    def run(lp, old, ref, ent):
        lp, ent = lp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
        loss, stats = policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
        loss.backward()
        return loss.detach(), stats, lp.grad, ent.grad

    want = run(lp, old, ref, ent)
    got = run(lp.masked_fill(off, float("nan")), old.masked_fill(off, float("-inf")),
              ref.masked_fill(off, float("inf")), ent.masked_fill(off, float("nan")))
    assert math.isfinite(float(want[0])) and set(got[1]) == set(want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for k, v in want[1].items():
        assert got[1][k] == pytest.approx(v, rel=1e-12, abs=1e-12), k
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=1e-12)


def test_aggregate_all_masked_is_zero_with_zero_grad():
    v = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    for mode in ALL_AGGS:
        out = aggregate(v, torch.zeros(2, 4), mode, scale=NORM_SCALE)
        (g,) = torch.autograd.grad(out, v)
        assert float(out.detach()) == 0.0 and (g == 0).all()
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(v, torch.ones(2, 4), "sum")


def test_kl_estimates():
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -3.0])
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), lp - ref)
    k3 = kl_estimate(lp, ref, "k3")
    d = ref - lp
    torch.testing.assert_close(k3, torch.exp(d) - d - 1)
    assert (k3 >= 0).all() and k3[0] == 0
    # verl's low_var_kl bound: at most 10, no gradient beyond it; unclamped just inside it
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    ref = torch.tensor([3.0, -13.0, -30.0, 1.0])
    k3 = kl_estimate(lp, ref, "k3")
    assert k3.detach()[:3].tolist() == [10.0, 10.0, 10.0] and 0 < float(k3.detach()[3]) < 10
    (g,) = torch.autograd.grad(k3.sum(), lp)
    assert g[:3].tolist() == [0.0, 0.0, 0.0] and g[3] != 0
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_policy_loss_dispatch_on_cpu_and_switch(monkeypatch):
    lp, old, adv, mask, ref, ent = _ppo_inputs(dtype=torch.float32)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, loss_agg="seq-mean-token-mean", kl_coef=0.05, entropy_coef=0.01)
    loss, stats = K.policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
    loss_r, stats_r = policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
    assert float(loss) == float(loss_r) and stats == stats_r
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        K.policy_loss(lp, old, adv, mask, LossConfig(loss_agg="mean"))
    with pytest.raises(ValueError, match="shape"):
        K.policy_loss(lp, old[:, :2], adv, mask)
    monkeypatch.setenv(K.ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        K.policy_loss(lp, old, adv, mask)
    monkeypatch.setenv(K.ENV_VAR, "reference")
    assert float(K.policy_loss(lp, old, adv, mask, impl="reference")[0]) == float(
        policy_loss(lp, old, adv, mask)[0]
    )
    monkeypatch.setenv(K.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="unknown kernel implementation"):
        K.policy_loss(lp, old, adv, mask)


def test_dual_clip_bounds_negative_advantages():
    """Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c): a token with A < 0 and a ratio beyond c has the
    constant loss -A c (no gradient: its ratio cannot push the loss up without bound); A > 0, or a ratio
    under c, is the plain clipped loss. On CPU the dispatcher runs the reference; it refuses a bound of 1 or
    less before dispatch, as the reference does."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.tensor([[math.log(5.0), math.log(5.0), math.log(2.0), math.log(0.5)]], dtype=torch.float64,
                      requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, stats = policy_loss(lp, old, adv, mask, LossConfig(clip_ratio_c=3.0))
    plain = torch.tensor([5.0, -1.2, 2.0, 0.8], dtype=torch.float64)  # max(-A r, -A clip(r, 0.8, 1.2))
    want = torch.tensor([3.0, -1.2, 2.0, 0.8], dtype=torch.float64)  # token 0: min(5, 3)
    assert float(policy_loss(lp, old, adv, mask)[0].detach()) == pytest.approx(float(plain.mean()))
    assert float(loss.detach()) == pytest.approx(float(want.mean())) and stats["clip_frac_lower"] == 0.25
    loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 2] != 0
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        policy_loss(lp, old, adv, mask, LossConfig(clip_ratio_c=1.0))
    args = (lp.detach().float(), old.float(), adv.float(), mask.float())
    got, got_stats = K.policy_loss(*args, LossConfig(clip_ratio_c=3.0))
    assert float(got) == pytest.approx(float(want.mean())) and got_stats["clip_frac_lower"] == 0.25
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        K.policy_loss(*args, LossConfig(clip_ratio_c=0.5))


def test_available_false_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert K.available() is False


@pytest.mark.parametrize("h_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_masked_logprobs_reference_takes_mixed_dtypes_as_the_kernel_does(h_dtype, w_dtype):
    """bf16 activations with an fp32 LM head (or the reverse): the documented contract computes in the lower
    precision of the two; the reference path (CPU, or ``auto`` without the extension) must not raise."""
    torch.manual_seed(0)
    N, H, V = 5, 8, 13
    h = torch.randn(N, H).to(h_dtype).requires_grad_()
    w = torch.randn(V, H).to(w_dtype).requires_grad_()
    t, m = torch.randint(0, V, (N,)), torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)
    lp, ent = K.masked_logprobs(h, w, t, m, 4, impl="reference")
    lp_b, ent_b = masked_lm_head_logprobs(h.detach().bfloat16(), w.detach().bfloat16(), t, m, 4)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.detach(), lp_b)
    torch.testing.assert_close(ent.detach(), ent_b)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.dtype == h_dtype and w.grad.dtype == w_dtype
    assert torch.all(h.grad[~m] == 0) and h.grad[m].abs().sum() > 0


def test_a_missing_cuda_source_directory_is_named_and_auto_falls_back(monkeypatch, tmp_path):
    """A non-editable install (pip install .) has no cuda/ beside the package: the build must say which
    directory is missing and how to get it (not ninja's 'missing and no known rule'), and "auto" must still
    fall back to the PyTorch reference."""
    import types

    import torch.utils.cpp_extension as cpp

    def obscure(**kw):
        raise RuntimeError("ninja: error: 'span_mask.cu', needed by 'span_mask.cuda.o', missing and no known rule")

    monkeypatch.setattr(K, "CUDA_DIR", tmp_path / "site-packages" / "cuda")
    monkeypatch.setattr(K, "_ext", None)
    monkeypatch.setattr(K, "_ext_error", None)
    monkeypatch.setattr(K, "build_dir", lambda: tmp_path / "build")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp, "load", obscure)
    with pytest.raises(RuntimeError, match="pip install -e") as err:
        K.load_extension()
    assert str(tmp_path / "site-packages" / "cuda") in str(err.value)
    with pytest.warns(RuntimeWarning, match="falling back to the PyTorch reference"):
        assert K._use_cuda("auto", types.SimpleNamespace(is_cuda=True)) is False
