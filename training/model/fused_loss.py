"""Opt-in: the masked LM-head loss with its gradient computed in the forward (three LM-head matmuls, not four).

:func:`training.model.kernels.masked_logprobs` returns per-token log-probs and recomputes each vocabulary chunk's
logits in its backward, because the upstream gradient (the policy loss's, per token) is unknown until then:
four LM-head matmuls over the policy rows (forward logits, recomputed logits, dH, dW). When the loss is known
at forward time, as in Liger-Kernel's fused linear cross-entropy, one row block's whole ``[r, V]`` logits can
stay in a buffer: its softmax statistics give the block's log-probs and entropies, the loss's per-token
gradients follow at once, the logits are turned into ``dL/dz`` in place and ``dH`` and ``dW`` are formed
right away; the recompute disappears. The backward only scales the stored ``dH`` and ``dW`` by the upstream
gradient (a scalar).

:func:`fused_token_loss` is that path for any loss that is a sum of per-token terms
``token_loss(logprob, entropy, rows)``; :func:`fused_policy_loss` builds the term from the registered policy
loss, aggregation and KL estimator, so its loss and gradient are :func:`training.algos.losses.policy_loss`'s on
:func:`training.algos.losses.masked_lm_head_logprobs`' log-probs. Nothing calls these by default: the trainer uses
the per-token kernel; ``bench/kernels.py`` times this path as ``fused`` and ``tests/test_fused_loss*.py``
check it. The CUDA path reuses the chunk kernels of ``cuda/masked_logprobs.cu`` through two row-block
drivers of ``training/model/csrc/sleuth_kernels.cpp``; ``impl="reference"`` (and CPU tensors) run the same
algorithm in torch.

Memory: the working set is one ``[r, V]`` logits buffer in the input dtype, with ``r`` by default sized as
Liger-Kernel sizes its row chunk for the same ``N`` (:func:`auto_row_block`), so the peak is no larger than
Liger's; ``dH`` and ``dW`` exist from the forward on (as in Liger) instead of from the backward on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from training.algos import losses as L
from training.model import kernels as K

#: policy losses whose per-token term depends on that token's log-prob alone (GSPO's sequence ratio does not)
TOKEN_LOCAL_LOSSES = ("ppo_clip", "cispo")
#: ``token_loss(logprobs [r], entropy [r], rows [r]) -> [r]``: a differentiable per-token loss term
TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def auto_row_block(n_tokens: int, hidden: int, vocab: int, align: int = 32) -> int:
    """Rows per block so that the working set (the ``[r, V]`` logits plus ``r`` gathered rows and their
    ``dH``, ``r (V + 2 H)`` elements) stays within Liger-Kernel's logits chunk for ``n_tokens`` tokens:
    ``next_pow2(ceil(n_tokens / ceil(V / H)))`` rows of ``V``. Rounded down to a multiple of ``align``,
    at least ``align``. E.g. 992 at H 2048, N 65,536, V 151,936 (Liger: 1024 rows)."""
    if min(n_tokens, hidden, vocab, align) < 1:
        raise ValueError(f"n_tokens, hidden, vocab and align must be >= 1, got {n_tokens}, {hidden}, {vocab}, {align}")
    liger_rows = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(n_tokens / math.ceil(vocab / hidden))))))
    rows = liger_rows * vocab // (vocab + 2 * hidden)
    return max(align, rows // align * align)


# ---- one row block, in torch (the spec of the CUDA drivers) ---------------------------------------------
def _block_fwd_reference(h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor):
    """``(logprobs, entropy, lse, z)`` of one row block: ``z = h W^T`` ``[r, V]`` in the input dtype (the
    kernel's buffer), statistics in float32 (float64 for float64 inputs)."""
    acc = torch.promote_types(h.dtype, torch.float32)
    z = h @ w.T
    zf = z.to(acc)
    lse = torch.logsumexp(zf, -1)
    p = torch.exp(zf - lse[:, None])
    ent = lse - (p * zf).sum(-1)
    lp = zf.gather(-1, tgt[:, None]).squeeze(-1) - lse
    return lp, ent, lse, z


def _block_grad_reference(z, tgt, lse, ent, g_lp, g_ent) -> torch.Tensor:
    """``dL/dz = g_lp (onehot - p) - g_ent p (z - E_p z)``, rounded to ``z``'s dtype as the kernel writes it
    in place (``cuda/masked_logprobs.cu``'s ``logit_grad_kernel``)."""
    zf = z.to(lse.dtype)
    p = torch.exp(zf - lse[:, None])
    dz = torch.zeros_like(zf)
    if g_lp is not None:
        dz = dz - g_lp[:, None] * p
        dz[torch.arange(len(tgt), device=z.device), tgt] += g_lp
    if g_ent is not None:
        dz = dz - g_ent[:, None] * p * (zf - (lse - ent)[:, None])
    return dz.to(z.dtype)


def _token_grads(token_loss: TokenLoss, lp: torch.Tensor, ent: torch.Tensor, rows: torch.Tensor):
    """``(loss sum, d/d lp, d/d ent)`` of one block's per-token terms (either gradient ``None`` when the
    term does not depend on it). Raises ``ValueError`` for a term of another shape."""
    with torch.enable_grad():
        lpv, entv = lp.detach().requires_grad_(True), ent.detach().requires_grad_(True)
        terms = token_loss(lpv, entv, rows)
        if terms.shape != lpv.shape:
            raise ValueError(f"token_loss must return one value per row {tuple(lpv.shape)}, got {tuple(terms.shape)}")
        total = terms.sum()
        if not total.requires_grad:
            return total.detach(), None, None
        g_lp, g_ent = torch.autograd.grad(total, (lpv, entv), allow_unused=True)
    return total.detach(), g_lp, g_ent


def _f32(g: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels take contiguous float32 per-row gradients (``None``: zero)."""
    return None if g is None else g.float().contiguous()


class _FusedTokenLoss(torch.autograd.Function):
    """Forward: per row block, logits -> statistics -> the loss's per-token gradients -> dL/dz in place ->
    dH rows and dW (accumulated over blocks). Backward: the stored dH and dW times the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, keep, token_loss, row_block, chunk_size, use_kernel):
        N = hidden.shape[0]
        V = weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        idx = keep.nonzero().squeeze(-1)
        n = idx.numel()
        tgt_all = targets.index_select(0, idx).contiguous()
        need_dh, need_dw = hidden.requires_grad, weight.requires_grad
        lp_c = hidden.new_zeros(n, dtype=acc)
        ent_c = hidden.new_zeros(n, dtype=acc)
        dh = torch.zeros_like(hidden) if need_dh else None
        # the first block writes all of dW (beta = 0), so only an empty batch needs the zero fill
        dw = (torch.empty_like(weight) if n else torch.zeros_like(weight)) if need_dw else None
        total = hidden.new_zeros((), dtype=acc)
        rb = min(row_block, n) if n else 1
        ext = K.load_extension() if use_kernel else None
        buf = hidden.new_empty(rb * V) if use_kernel and n else None
        stream = K.stream_handle(hidden) if use_kernel else 0
        for r0 in range(0, n, rb):
            rows = idx[r0 : r0 + rb]
            tgt = tgt_all[r0 : r0 + rb]
            if use_kernel:
                lp, ent, lse, h = ext.fused_block_fwd(hidden, rows, weight, tgt, buf, chunk_size, stream)
            else:
                h = hidden.index_select(0, rows)
                lp, ent, lse, z = _block_fwd_reference(h, weight, tgt)
            loss_b, g_lp, g_ent = _token_grads(token_loss, lp, ent, rows)
            total = total + loss_b.to(acc)
            lp_c[r0 : r0 + rb] = lp
            ent_c[r0 : r0 + rb] = ent
            if not (need_dh or need_dw):
                continue
            if use_kernel:
                ext.fused_block_bwd(buf, h, rows, weight, tgt, lse, ent, _f32(g_lp), _f32(g_ent), dh, dw, r0 == 0,
                                    stream)
                continue
            dz = _block_grad_reference(z, tgt, lse, ent, g_lp, g_ent)
            if need_dh:
                dh.index_copy_(0, rows, dz @ weight)
            if need_dw:
                dw.copy_(dz.T @ h) if r0 == 0 else dw.add_(dz.T @ h)
        lp_full = hidden.new_zeros(N, dtype=acc).index_copy_(0, idx, lp_c)
        ent_full = hidden.new_zeros(N, dtype=acc).index_copy_(0, idx, ent_c)
        ctx.grads = (dh, dw)
        ctx.mark_non_differentiable(lp_full, ent_full)
        return total, lp_full, ent_full

    @staticmethod
    def backward(ctx, g, _g_lp, _g_ent):
        dh, dw = ctx.grads
        ctx.grads = (None, None)  # scaled in place: one backward per forward
        if dh is not None:
            dh = dh.mul_(g.to(dh.dtype))
        if dw is not None:
            dw = dw.mul_(g.to(dw.dtype))
        return dh, dw, None, None, None, None, None, None


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    token_loss: TokenLoss,
    *,
    row_block: int | None = None,
    chunk_size: int = 8192,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sum`` over the policy tokens of ``token_loss(logprob, entropy, rows)``, with the LM-head gradient
    computed in the forward (see the module docstring).

    Args:
        hidden: ``[..., H]`` final hidden states (float32/bfloat16/float16; float64 takes the torch path).
        weight: ``[V, H]`` LM-head weight (no bias); mixed dtypes compute in the lower precision of the two,
            as :func:`training.model.kernels.masked_logprobs`.
        targets: ``[...]`` int64 next-token ids in ``[0, V)`` at the policy positions.
        mask: ``[...]`` bool or 0/1; only nonzero positions are computed.
        token_loss: called once per row block with that block's log-probs and entropies (``[r]`` float32
            leaves that require grad) and ``rows`` (``[r]`` int64, their positions in the flattened
            ``targets``); returns ``[r]`` per-token terms, differentiable w.r.t. the first two. It must not
            depend on other blocks' values (a token-local loss with constant weights).
        row_block: policy rows per block (default :func:`auto_row_block` of the number of tokens ``N``).
        chunk_size: vocabulary columns per matmul of a block's forward (the statistics are read right after
            each, while the chunk is in L2); the block's logits buffer is ``[row_block, V]`` regardless.
        impl: ``"auto"``/``"cuda"``/``"reference"`` as :func:`training.model.kernels.masked_logprobs`
            (``$SLEUTH_KERNELS``).

    Returns ``(loss, logprobs, entropy)``: the scalar loss (float32; float64 for float64 inputs),
    differentiable w.r.t. ``hidden`` and ``weight`` (backward once per forward), and the per-token values
    shaped like ``targets``, zero where masked, without gradient. Raises ``ValueError`` on shape
    mismatches, targets out of range or non-positive block sizes, ``RuntimeError`` when ``impl="cuda"``
    cannot run.
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    lead = targets.shape
    if hidden.shape[:-1] != lead or mask.shape != lead:
        raise ValueError(f"hidden {tuple(hidden.shape)}, targets {tuple(lead)} and mask {tuple(mask.shape)} disagree")
    H, V = weight.shape[1], weight.shape[0]
    h2 = hidden.reshape(-1, H)
    tgt = targets.reshape(-1).long()
    keep = mask.reshape(-1).bool()
    rb = row_block if row_block is not None else auto_row_block(max(1, h2.shape[0]), H, V)
    if rb <= 0 or chunk_size <= 0:
        raise ValueError(f"row_block and chunk_size must be positive, got {rb}, {chunk_size}")
    if keep.any():
        sel = tgt[keep]
        lo, hi = int(sel.min()), int(sel.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"targets at policy positions must lie in [0, {V}), got [{lo}, {hi}]")
    low = hidden.dtype if hidden.element_size() <= weight.element_size() else weight.dtype
    h2, w = h2.to(low), weight.to(low)
    use_kernel = low in K.KERNEL_DTYPES and K.wants_kernel(impl, h2, w, tgt, keep)
    if low not in K.KERNEL_DTYPES and K.resolve_impl(impl) == "cuda":
        raise ValueError(f"the kernel takes {K.KERNEL_DTYPES}, got {hidden.dtype} and {weight.dtype}")
    loss, lp, ent = _FusedTokenLoss.apply(h2.contiguous(), w.contiguous(), tgt, keep, token_loss, int(rb),
                                          int(chunk_size), use_kernel)
    return loss, lp.reshape(lead), ent.reshape(lead)


# ---- the policy loss as a per-token term -----------------------------------------------------------------
def aggregation_weights(mask: torch.Tensor, loss_agg: str, loss_scale: float | None = None) -> torch.Tensor:
    """``c`` ``[B, T]`` with ``aggregate(v, mask, loss_agg, loss_scale) == (c * v).sum()`` for every ``v``:
    the registered aggregations are linear in the per-token values, with weights that depend on the mask
    alone (token-mean: ``mask / mask.sum()``; seq-mean-token-mean: ``mask / (rows * len_row)``; ...), so
    ``c`` is the gradient of the aggregation at any point. Raises ``ValueError`` for an unknown mode."""
    v = torch.zeros(mask.shape, dtype=torch.promote_types(mask.dtype, torch.float32), device=mask.device,
                    requires_grad=True)
    with torch.enable_grad():
        out = L.aggregate(v, mask.to(v.dtype), loss_agg, loss_scale)
        (c,) = torch.autograd.grad(out, v, allow_unused=True)
    return torch.zeros_like(v) if c is None else c.detach()


def policy_token_loss(old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      cfg: L.LossConfig = L.DEFAULT_LOSS, *, ref_logprobs: torch.Tensor | None = None,
                      is_weights: torch.Tensor | None = None) -> TokenLoss:
    """The per-token term of :func:`training.algos.losses.policy_loss` (same settings ``cfg``; ``[B, T]``
    tensors): ``c_t (w_t pg_t + kl_coef kl_t - entropy_coef H_t)`` with ``c`` the aggregation's weights
    (:func:`aggregation_weights`), ``pg`` the registered policy term, ``kl`` the registered estimator and
    ``w`` the rollout correction's weights. Its sum over the policy tokens is the reference loss. The policy
    term is evaluated on each block's ``[1, r]`` slice (its statistics are dropped: one host sync per block).
    Raises ``ValueError`` for a policy loss that is not token-local (:data:`TOKEN_LOCAL_LOSSES`) and for the
    registries' unknown names."""
    if cfg.loss not in TOKEN_LOCAL_LOSSES:
        L.POLICY_LOSSES.get(cfg.loss)  # an unknown name: the registry's error
        raise ValueError(f"the fused loss takes token-local policy losses {TOKEN_LOCAL_LOSSES}, not {cfg.loss!r}")
    cfg = cfg.resolved()
    term, kl = L.POLICY_LOSSES.get(cfg.loss), L.KL_ESTIMATORS.get(cfg.kl_type)
    flat = lambda t: None if t is None else t.reshape(-1)
    c = flat(aggregation_weights(mask, cfg.loss_agg, cfg.loss_scale))
    old, adv, ref, w = flat(old_logprobs), flat(advantages), flat(ref_logprobs), flat(is_weights)
    use_kl = ref is not None and cfg.kl_coef > 0

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        one = torch.ones_like(lp)[None]
        pg, _ = term.fn(lp[None], old[rows][None], adv[rows][None], one, cfg)
        val = pg[0] if w is None else pg[0] * w[rows]
        if use_kl:
            val = val + cfg.kl_coef * kl.fn(lp, ref[rows])
        if cfg.entropy_coef != 0:
            val = val - cfg.entropy_coef * ent
        return c[rows] * val

    return token_loss


def fused_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                      old_logprobs: torch.Tensor, advantages: torch.Tensor, cfg: L.LossConfig = L.DEFAULT_LOSS, *,
                      ref_logprobs: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
                      row_block: int | None = None, chunk_size: int = 8192,
                      impl: str | None = None) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, torch.Tensor]:
    """:func:`training.algos.losses.policy_loss` on the masked LM head's log-probs and entropies, in one fused pass
    (:func:`fused_token_loss` with :func:`policy_token_loss`). ``hidden`` ``[B, T, H]``; ``targets``,
    ``mask``, ``old_logprobs``, ``advantages``, ``ref_logprobs`` and ``is_weights`` ``[B, T]``; ``cfg`` the
    loss's settings. Returns ``(loss, stats, logprobs, entropy)``: the loss differentiable w.r.t. ``hidden``
    and ``weight``, the reference's statistics (computed once from the detached log-probs), and the
    ``[B, T]`` float32 values."""
    if targets.dim() != 2:
        raise ValueError(f"fused_policy_loss takes [B, T] targets, got {tuple(targets.shape)}")
    token_loss = policy_token_loss(old_logprobs, advantages, mask, cfg, ref_logprobs=ref_logprobs,
                                   is_weights=is_weights)
    loss, lp, ent = fused_token_loss(hidden, weight, targets, mask, token_loss, row_block=row_block,
                                     chunk_size=chunk_size, impl=impl)
    with torch.no_grad():
        _, stats = L.policy_loss(lp, old_logprobs.to(lp.dtype), advantages.to(lp.dtype), mask.to(lp.dtype), cfg,
                                 ref_logprobs=ref_logprobs, entropy=ent, is_weights=is_weights)
    return loss, stats, lp, ent
