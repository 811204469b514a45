"""Masked policy-gradient losses: the PyTorch reference (the spec) of the fused CUDA kernels.

Shapes: ``B`` sequences of ``T`` tokens; every per-token tensor is ``[B, T]`` and ``mask`` is 1.0 exactly
at the policy's own tokens (tool and prompt tokens get no gradient, as in Search-R1). Log-probabilities are
float32 natural logs. References: PPO (Schulman et al., 2017); the clipped surrogate with separate low/high
ranges is DAPO's clip-higher (Yu et al., 2025); KL estimators k1/k3 follow Schulman's "Approximating KL
divergence" note as used by GRPO (Shao et al., 2024) and verl's ``core_algos.kl_penalty``; the aggregation
modes are verl's ``agg_loss`` (token-mean, seq-mean-token-sum, seq-mean-token-mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of each next-token distribution.

    ``logits``: ``[..., V]`` any float dtype (upcast to float32); ``targets``: ``[...]`` int64.
    Returns ``(logprobs, entropy)``, both ``[...]`` float32. This materialises ``[..., V]`` in float32: the
    naive path that :func:`training.kernels.masked_logprobs` avoids.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def masked_lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int = 8192,
    *,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the fused masked log-prob kernel: LM head + log-softmax + gather at policy tokens only.

    ``hidden``: ``[N, H]``; ``weight``: ``[V, H]`` (the LM head, no bias); ``targets``: ``[N]`` int64;
    ``mask``: ``[N]`` (bool or 0/1). Masked-out rows are compacted away before any vocabulary work, and
    the vocabulary is processed in chunks of ``chunk_size`` with an online log-sum-exp, so at most
    ``[N_policy, chunk_size]`` float32 logits exist at once. Returns ``(logprobs [N], entropy [N])``
    float32, zero at masked positions; differentiable w.r.t. ``hidden`` and ``weight`` through autograd.
    ``with_entropy=False`` skips the entropy accumulator (one ``[n, chunk]`` product-sum per chunk) and
    returns an all-zero entropy (constant, no gradient), keeping the return type.
    """
    N = hidden.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for gradcheck
    keep = mask.bool().reshape(-1)
    idx = keep.nonzero().squeeze(-1)
    out_lp = hidden.new_zeros(N, dtype=acc)
    out_ent = hidden.new_zeros(N, dtype=acc)
    if idx.numel() == 0:
        # keep the graph connected so backward yields zero gradients rather than None
        zero = (hidden.sum() * 0.0 + weight.sum() * 0.0).to(acc)
        return out_lp + zero, out_ent + zero
    h = hidden.index_select(0, idx)
    tgt = targets.reshape(-1).index_select(0, idx)
    V = weight.shape[0]
    m = torch.full((h.shape[0],), float("-inf"), device=h.device, dtype=acc)
    s = torch.zeros(h.shape[0], device=h.device, dtype=acc)  # sum exp(z - m)
    sz = torch.zeros(h.shape[0], device=h.device, dtype=acc) if with_entropy else None  # sum exp(z - m) * z
    tgt_logit = torch.zeros(h.shape[0], device=h.device, dtype=acc)
    for start in range(0, V, chunk_size):
        z = (h @ weight[start : start + chunk_size].T).to(acc)  # [n, c]
        m_new = torch.maximum(m, z.max(-1).values)
        scale = torch.exp(m - m_new)
        e = torch.exp(z - m_new.unsqueeze(-1))
        s = s * scale + e.sum(-1)
        if with_entropy:
            sz = sz * scale + (e * z).sum(-1)
        m = m_new
        in_chunk = (tgt >= start) & (tgt < start + z.shape[1])
        local = (tgt - start).clamp(0, z.shape[1] - 1)
        tgt_logit = tgt_logit + torch.where(in_chunk, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    lse = m + torch.log(s)
    lp = tgt_logit - lse
    if not with_entropy:
        return out_lp.index_put((idx,), lp), out_ent
    ent = lse - sz / s  # H = lse - E_p[z]
    return out_lp.index_put((idx,), lp), out_ent.index_put((idx,), ent)


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` with masked positions 0 even where ``values`` is NaN/inf (NaN * 0 is NaN)."""
    return torch.where(mask != 0, values * mask, 0.0)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss over the masked tokens.

    * ``token-mean``: sum over all policy tokens / number of policy tokens (DAPO);
    * ``seq-mean-token-sum``: mean over sequences of the per-sequence token sum (Dr. GRPO);
    * ``seq-mean-token-mean``: mean over sequences with at least one policy token of the per-sequence token
      mean (the original GRPO).
    An all-masked batch gives 0 (with gradient 0). Masked positions are selected away, so NaN/inf there
    never reach the result (as in the CUDA kernel). Raises ``ValueError`` for an unknown mode.
    """
    mask = mask.to(values.dtype)
    kept = _masked(values, mask)
    if mode == "token-mean":
        return kept.sum() / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return kept.sum(-1).mean()
    if mode == "seq-mean-token-mean":
        n = mask.sum(-1)
        per_seq = kept.sum(-1) / n.clamp(min=1.0)
        has = (n > 0).to(values.dtype)
        return (per_seq * has).sum() / has.sum().clamp(min=1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGG_MODES}")


#: the bound of the k3 estimate per token (verl's ``low_var_kl`` clamps it to [-10, 10]; k3 is never negative)
K3_MAX = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled tokens.

    ``k1 = log pi - log pi_ref``; ``k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1`` (unbiased,
    non-negative; GRPO's choice), as verl's ``low_var_kl``: the log-ratio clamped to +-20 before the exp and
    the estimate to at most 10 (a token the policy made >13x less likely than the reference adds at most 10,
    and no gradient). Raises ``ValueError`` for an unknown kind.
    """
    d = ref_logprobs - logprobs
    if kind == "k1":
        return -d
    if kind == "k3":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1.0).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1' or 'k3'")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The masked PPO-clip policy loss with DAPO clip-higher, optional dual-clip, KL-to-reference loss and
    entropy bonus.

    Per token: ``r = exp(logp - old_logp)``; ``pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``;
    with ``clip_ratio_c`` (> 1; dual-clip PPO, Ye et al. 2020, verl's ``clip_ratio_c``) a token with ``A < 0``
    has ``pg = min(pg, -A c)``, so a large ratio on a negative advantage cannot grow the loss without bound;
    plus ``kl_coef * KL`` when ``ref_logprobs`` is given and minus ``entropy_coef * H`` when ``entropy`` is
    given; reduced by :func:`aggregate`. All inputs ``[B, T]`` float. Returns ``(loss, stats)`` with
    ``stats`` = pg_loss, clip_frac, approx_kl (vs. old policy), kl (vs. reference), entropy, ratio_mean, and
    with dual-clip clip_frac_lower (the share of tokens the bound caps). Raises ``ValueError`` for
    ``clip_ratio_c <= 1``.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    lower = None
    if clip_ratio_c is not None:
        if not clip_ratio_c > 1.0:
            raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
        pg3 = -advantages * clip_ratio_c
        lower = (advantages < 0) & (pg3 < pg)
        pg = torch.where(lower, pg3, pg)
    pg_loss = aggregate(pg, mask, loss_agg)
    loss = pg_loss
    n = mask.sum().clamp(min=1.0)
    stats: dict[str, float] = {
        "pg_loss": float(pg_loss.detach()),
        "clip_frac": float(((pg2 > pg1).to(mask.dtype) * mask).sum() / n),
        "approx_kl": float(_masked(-log_ratio, mask).sum().detach() / n),
        "ratio_mean": float(_masked(ratio.detach(), mask).sum() / n),
    }
    if lower is not None:
        stats["clip_frac_lower"] = float((lower.to(mask.dtype) * mask).sum() / n)
    if ref_logprobs is not None and kl_coef > 0:
        kl = aggregate(kl_estimate(logprobs, ref_logprobs, kl_type), mask, loss_agg)
        loss = loss + kl_coef * kl
        stats["kl"] = float(kl.detach())
    if entropy is not None:
        ent = aggregate(entropy, mask, loss_agg)
        stats["entropy"] = float(ent.detach())
        if entropy_coef != 0:
            loss = loss - entropy_coef * ent
    return loss, stats
