"""Dispatch between Sleuth's CUDA kernels (``cuda/``) and their PyTorch references (the spec).

Public entry points, each with the signature of its reference plus ``impl``:

* :func:`span_mask` -- :func:`training.masking.span_mask_reference`;
* :func:`masked_logprobs` -- :func:`training.algos.losses.masked_lm_head_logprobs` (differentiable w.r.t.
  hidden states and the LM-head weight);
* :func:`policy_loss` -- :func:`training.algos.losses.policy_loss` (differentiable w.r.t. log-probs and
  entropy).

The switch: ``impl`` argument, else the environment variable ``SLEUTH_KERNELS``, else ``"auto"``.

* ``"auto"``: the CUDA kernel when the inputs are CUDA tensors and the extension builds (:func:`available`),
  else the reference;
* ``"cuda"``: the kernel, or a ``RuntimeError`` saying why it cannot run;
* ``"reference"``: always the PyTorch reference.

The extension is built on first use with :func:`torch.utils.cpp_extension.load` (ninja) for sm_80 and sm_90
(plus compute_90 PTX for newer GPUs), cached in ``$SLEUTH_KERNELS_BUILD_DIR`` (default
``~/.cache/sleuth/torch_extensions/<torch version>``); ninja rebuilds only what changed. The ``.cu`` sources
are read from the repository's ``cuda/``, so the kernels need a source checkout (``pip install -e .``). The ``.cu`` files
include only CUDA headers and the binding (``training/model/csrc/sleuth_kernels.cpp``) only
``torch/extension.h``; the CUDA stream is passed as an integer (``torch.cuda.current_stream().cuda_stream``).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from training.algos import losses as L
from training.algos.losses import masked_lm_head_logprobs
from training.masking import span_mask_reference

IMPLS = ("auto", "cuda", "reference")
ENV_VAR = "SLEUTH_KERNELS"
BUILD_DIR_ENV = "SLEUTH_KERNELS_BUILD_DIR"
CUDA_ARCH_FLAGS = (
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
)
MAX_MARKERS = 16  # per kind, see cuda/span_mask.cu
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = _ROOT / "cuda"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
CU_SOURCES = ("span_mask.cu", "masked_logprobs.cu", "ppo_loss.cu")

_lock = threading.Lock()
_ext: ModuleType | None = None
_ext_error: str | None = None


def _impl(impl: str | None) -> str:
    mode = (impl or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if mode not in IMPLS:
        raise ValueError(
            f"unknown kernel implementation {mode!r} (from impl= or ${ENV_VAR}); expected {IMPLS}"
        )
    return mode


def build_dir() -> Path:
    """Where the JIT-built extension is cached (``$SLEUTH_KERNELS_BUILD_DIR`` or under ``~/.cache``)."""
    env = os.environ.get(BUILD_DIR_ENV)
    if env:
        return Path(env)
    tag = torch.__version__.replace("+", "_")
    return Path.home() / ".cache" / "sleuth" / "torch_extensions" / tag


def load_extension(verbose: bool = False) -> ModuleType:
    """Build (once, cached) and import the CUDA extension. Raises ``RuntimeError`` if it cannot be built
    (no CUDA device; the ``cuda/`` sources missing, as in a non-editable install; a compiler error)."""
    global _ext, _ext_error
    with _lock:
        if _ext is not None:
            return _ext
        if _ext_error is not None:
            raise RuntimeError(_ext_error)
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device (CPU build of torch or no GPU)")
            missing = [f for f in ("common.cuh", *CU_SOURCES) if not (CUDA_DIR / f).is_file()]
            if missing:
                raise RuntimeError(
                    f"the kernel sources {missing} are not in {CUDA_DIR}: the .cu files ship with the source "
                    "tree, not with the installed package; install Sleuth from a source checkout "
                    "(pip install -e .)"
                )
            from torch.utils.cpp_extension import load

            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            _ext = load(
                name="sleuth_kernels",
                sources=[str(CSRC_DIR / "sleuth_kernels.cpp")] + [str(CUDA_DIR / f) for f in CU_SOURCES],
                extra_include_paths=[str(CUDA_DIR)],
                extra_cflags=["-O3", "-std=c++20"],
                extra_cuda_cflags=["-O3", "-std=c++20", "-lineinfo", *CUDA_ARCH_FLAGS],
                build_directory=str(out),
                verbose=verbose,
            )
        except Exception as e:
            _ext_error = f"sleuth CUDA kernels unavailable: {type(e).__name__}: {e}"
            raise RuntimeError(_ext_error) from e
        return _ext


def available() -> bool:
    """True when a CUDA device is visible and the extension builds and imports (builds it on first call)."""
    if not torch.cuda.is_available():
        return False
    try:
        load_extension()
    except RuntimeError:
        return False
    return True


def _use_cuda(impl: str | None, *tensors: torch.Tensor) -> bool:
    mode = _impl(impl)
    if mode == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if mode == "cuda":
        if not on_cuda:
            raise RuntimeError(f"{ENV_VAR}=cuda (or impl='cuda') needs CUDA tensors; got CPU tensors")
        load_extension()  # raises with the build error
        return True
    if not on_cuda:
        return False
    try:
        load_extension()
    except RuntimeError as e:
        warnings.warn(f"{e}; falling back to the PyTorch reference", RuntimeWarning, stacklevel=3)
        return False
    return True


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


# the dispatch above, for the opt-in fused loss of training/model/fused_loss.py (which dispatches as these functions do)
resolve_impl, wants_kernel, stream_handle = _impl, _use_cuda, _stream


# ---- span mask -----------------------------------------------------------------------------------------


def span_mask(
    token_ids: torch.Tensor,
    open_ids: Sequence[int],
    close_ids: Sequence[int],
    lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
    *,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask and turn index from tool-span markers; semantics of :func:`span_mask_reference`.

    ``token_ids``: ``[B, T]`` int64 (right-padded); ``lengths``/``prompt_lengths``: ``[B]`` int64. Returns
    ``(mask [B, T] bool, turn [B, T] int32)`` on the device of ``token_ids``. The kernel accepts at most 16
    open and 16 close ids: more go to the reference, or raise ``ValueError`` when the kernel is forced
    (``impl="cuda"``). Raises ``ValueError`` on bad shapes or ids that both open and close.
    """
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids must be [B, T], got {tuple(token_ids.shape)}")
    opens, closes = [int(i) for i in open_ids], [int(i) for i in close_ids]
    if set(opens) & set(closes):
        raise ValueError(f"a token cannot both open and close a span: {sorted(set(opens) & set(closes))}")
    B = token_ids.shape[0]
    if lengths.numel() != B or prompt_lengths.numel() != B:
        raise ValueError(f"lengths and prompt_lengths must be [B={B}]")
    too_many = len(set(opens)) > MAX_MARKERS or len(set(closes)) > MAX_MARKERS
    if too_many and _impl(impl) == "cuda":
        raise ValueError(f"the span-mask kernel takes at most {MAX_MARKERS} open and {MAX_MARKERS} close ids")
    if too_many or not _use_cuda(impl, token_ids):  # (auto: more markers than the kernel takes -> reference)
        mask, turn = span_mask_reference(token_ids.cpu(), opens, closes, lengths.cpu(), prompt_lengths.cpu())
        return mask.to(token_ids.device), turn.to(token_ids.device)
    dev = token_ids.device
    ext = load_extension()
    mask, turn = ext.span_mask(
        token_ids.contiguous().long(),
        lengths.to(dev, torch.long).contiguous(),
        prompt_lengths.to(dev, torch.long).contiguous(),
        sorted(set(opens)),
        sorted(set(closes)),
        _stream(token_ids),
    )
    return mask, turn


# ---- fused masked log-probs ----------------------------------------------------------------------------


class _MaskedLogprobs(torch.autograd.Function):
    """Chunked LM head / online log-sum-exp over policy rows (forward) and recompute-per-chunk backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, chunk_size, row_block):
        ctx.set_materialize_grads(False)
        N = hidden.shape[0]
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        idx = mask.nonzero().squeeze(-1)  # the policy rows: only these reach the vocabulary work
        tgt = targets.index_select(0, idx).contiguous()
        ext = load_extension()
        lp_c, ent_c, lse_c = ext.masked_logprobs_fwd(
            hidden, idx, weight, tgt, chunk_size, row_block, _stream(hidden)
        )
        lp = hidden.new_zeros(N, dtype=torch.float32).index_copy_(0, idx, lp_c)
        ent = hidden.new_zeros(N, dtype=torch.float32).index_copy_(0, idx, ent_c)
        ctx.save_for_backward(hidden, weight, tgt, idx, lse_c, ent_c)
        ctx.blocks = (chunk_size, row_block)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tgt, idx, lse_c, ent_c = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return None, None, None, None, None, None
        glp = None if g_lp is None else g_lp.float().index_select(0, idx).contiguous()
        gent = None if g_ent is None else g_ent.float().index_select(0, idx).contiguous()
        chunk_size, row_block = ctx.blocks
        dh, dw = load_extension().masked_logprobs_bwd(
            hidden,
            idx,
            weight,
            tgt,
            lse_c,
            ent_c,
            glp,
            gent,
            chunk_size,
            row_block,
            need_dh,
            need_dw,
            _stream(hidden),
        )
        return (dh if need_dh else None), (dw if need_dw else None), None, None, None, None


def masked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int = 8192,
    *,
    row_block: int = 4096,
    with_entropy: bool = True,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and next-token entropy at policy tokens only, without ``[N, V]`` in float32.

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``) final hidden states, float32/bfloat16/float16.
        weight: ``[V, H]`` LM-head weight (no bias). When its dtype differs from ``hidden``'s (bf16
            activations under autocast with an fp32 head), the kernel computes in the lower precision of
            the two, as autocast computes the reference's matmul; gradients flow back through the cast.
        targets: ``[N]`` (or ``[...]``) int64 next-token ids in ``[0, V)``.
        mask: ``[N]`` (or ``[...]``) bool or 0/1; only nonzero rows are computed (compacted first).
        chunk_size: vocabulary columns per chunk. The kernel holds one ``[row_block, chunk_size]`` logits
            buffer in the input dtype (the chunk logits are rounded to the input dtype, as a bf16 LM head's).
        row_block: policy rows per block on the kernel path (the reference ignores it). The working memory
            above the outputs is about ``row_block * (chunk_size + 5 H)`` elements whatever ``N`` is;
            ``dW`` is accumulated over row blocks in the weight's dtype (as Liger-Kernel's default).
        with_entropy: ``False`` returns an all-zero entropy on both paths (constant, no gradient). The
            reference then skips the entropy work; the CUDA kernel computes it in the same pass anyway (one
            extra fused multiply-add per logit, nearly free) and it is discarded.

    Returns ``(logprobs, entropy)``, float32 (float64 for float64 inputs, which take the reference),
    shaped like ``targets``, zero at masked positions. On the CUDA
    path a ``torch.autograd.Function`` gives gradients for ``hidden`` and ``weight`` (the backward recomputes
    each chunk's logits: 4 LM-head matmuls over policy rows in all). Follows the spec
    :func:`training.algos.losses.masked_lm_head_logprobs`. Dtypes the kernel does not take (float64) use the
    reference under ``auto``. Raises ``ValueError`` on a shape mismatch, a target out of range, or a dtype
    the kernel does not take under ``impl="cuda"``.
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden [..., H] and weight [V, H] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    lead = targets.shape
    if hidden.shape[:-1] != lead or mask.shape != lead:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, targets {tuple(lead)} and mask {tuple(mask.shape)} disagree"
        )
    if chunk_size <= 0 or row_block <= 0:
        raise ValueError(f"chunk_size and row_block must be positive, got {chunk_size}, {row_block}")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    tgt = targets.reshape(-1).long()
    keep = mask.reshape(-1).bool()
    if tgt.numel() and keep.any():
        sel = tgt[keep]
        lo, hi = int(sel.min()), int(sel.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(
                f"targets at policy positions must lie in [0, {weight.shape[0]}), got [{lo}, {hi}]"
            )
    # one compute dtype for the kernel: mixed inputs (bf16 activations under autocast with an fp32 LM head)
    # run in the lower precision, as autocast runs the reference's matmul; the cast is differentiable
    low = hidden.dtype if hidden.element_size() <= weight.element_size() else weight.dtype
    if low not in KERNEL_DTYPES:
        if _impl(impl) == "cuda":
            raise ValueError(f"the kernel takes {KERNEL_DTYPES}, got {hidden.dtype} and {weight.dtype}")
        use_kernel = False  # e.g. float64: the reference
    else:
        use_kernel = _use_cuda(impl, hidden, weight, targets, mask)
    if not use_kernel:
        if h2.dtype != weight.dtype:  # as the kernel (and autocast): the lower precision, differentiably
            h2, weight = h2.to(low), weight.to(low)
        lp, ent = masked_lm_head_logprobs(h2, weight, tgt, keep, chunk_size, with_entropy=with_entropy)
        return lp.reshape(lead), ent.reshape(lead)
    h2, weight = h2.to(low), weight.to(low)
    lp, ent = _MaskedLogprobs.apply(h2, weight, tgt, keep, int(chunk_size), int(row_block))
    if not with_entropy:  # computed by the kernel in the same pass; dropped so both paths agree
        ent = torch.zeros_like(lp)
    return lp.reshape(lead), ent.reshape(lead)


# ---- masked PPO-clip loss ------------------------------------------------------------------------------

_STAT_NAMES = (
    "loss", "pg_loss", "clip_frac", "approx_kl", "ratio_mean", "kl", "entropy", "n_tokens", "clip_frac_lower"
)


class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logprobs, entropy, old, adv, mask, ref, clip_low, clip_high, clip_c, kl_coef, kl_type, ent_coef, mode
    ):
        ext = load_extension()
        out, row_w = ext.ppo_loss_fwd(
            logprobs,
            old,
            adv,
            mask,
            ref,
            entropy,
            clip_low,
            clip_high,
            clip_c,
            kl_coef,
            kl_type,
            ent_coef,
            mode,
            _stream(logprobs),
        )
        ctx.save_for_backward(logprobs, old, adv, mask, ref, row_w)
        ctx.cfg = (clip_low, clip_high, clip_c, kl_coef, kl_type, ent_coef, entropy is not None, mode)
        ctx.mark_non_differentiable(out)
        return out[0].clone(), out

    @staticmethod
    def backward(ctx, g, _g_stats):
        logprobs, old, adv, mask, ref, row_w = ctx.saved_tensors
        clip_low, clip_high, clip_c, kl_coef, kl_type, ent_coef, has_ent, mode = ctx.cfg
        need_ent = bool(ctx.needs_input_grad[1]) and has_ent
        g_lp, g_ent = load_extension().ppo_loss_bwd(
            g.reshape(1).float().contiguous(),
            logprobs,
            old,
            adv,
            mask,
            ref,
            row_w,
            clip_low,
            clip_high,
            clip_c,
            kl_coef,
            kl_type,
            ent_coef,
            has_ent,
            need_ent,
            mode,
            _stream(logprobs),
        )
        return (g_lp, g_ent if need_ent else None) + (None,) * 11


def _check_shapes(shape: torch.Size, **tensors: torch.Tensor | None) -> None:
    """``ValueError`` naming the first given tensor whose shape is not ``shape`` (the log-probs')."""
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: L.LossConfig = L.DEFAULT_LOSS,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The masked actor loss; the arguments, semantics and stats of :func:`training.algos.losses.policy_loss`
    (one :class:`training.algos.losses.LossConfig` for every setting), plus ``impl``.

    The fused kernel runs the combinations it implements: the ``ppo_clip`` term (dual-clip included) with
    an aggregation and a KL estimator that have kernel ids (token-mean, seq-mean-token-sum,
    seq-mean-token-mean; k1, k3); any other registered loss, aggregation or KL kind runs the reference
    (under ``impl="cuda"`` that is a ``ValueError`` naming the part). All per-token tensors ``[B, T]``; the
    kernel computes in float32 and differentiates w.r.t. ``logprobs`` and ``entropy`` only (old log-probs,
    advantages and reference log-probs are constants, as in training: if any of them requires grad,
    ``auto`` uses the reference and ``cuda`` raises). Returns ``(loss, stats)``. Raises ``ValueError`` for
    an unknown loss, aggregation or KL kind, mismatched shapes or ``clip_ratio_c <= 1``.

    ``is_weights`` (the rollout correction's per-token weights, ``>= 0``) reach the kernel folded into the
    advantages: ``ppo_clip`` is positively homogeneous in the advantage (``max(-wA r, -wA clip(r)) = w
    max(-A r, -A clip(r))`` for ``w >= 0``, and so is the dual-clip bound), so the loss and its gradient are
    the reference's ``w * pg`` (``tests/test_offpolicy.py`` checks the emulated kernel against it).
    """
    term, agg, kl = L.POLICY_LOSSES.get(cfg.loss), L.LOSS_AGGS.get(cfg.loss_agg), L.KL_ESTIMATORS.get(cfg.kl_type)
    shape = logprobs.shape
    _check_shapes(shape, old_logprobs=old_logprobs, advantages=advantages, mask=mask, ref_logprobs=ref_logprobs,
                  entropy=entropy, is_weights=is_weights)
    tensors = [t for t in (logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy, is_weights) if t is not None]
    const_grad = any(t is not None and t.requires_grad for t in (old_logprobs, advantages, ref_logprobs))
    use_kl = ref_logprobs is not None and cfg.kl_coef > 0
    unsupported = [f"{key}={val}" for key, val, ok in (
        ("train.algorithm.policy_loss", cfg.loss, term.kernel),
        ("train.algorithm.loss_agg_mode", cfg.loss_agg, agg.kernel_mode is not None),
        ("train.algorithm.kl_type", cfg.kl_type, kl.kernel_id is not None or not use_kl)) if not ok]
    mode = _impl(impl)
    if mode == "cuda" and const_grad:
        raise RuntimeError("the policy-loss kernel treats old_logprobs/advantages/ref_logprobs as constants")
    if mode == "cuda" and unsupported:
        raise ValueError(f"the policy-loss kernel does not implement {', '.join(unsupported)}; use "
                         "SLEUTH_KERNELS=auto (the reference runs them)")
    clip_ratio_c = cfg.clip_ratio_c
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    no_kernel = logprobs.dim() != 2 or shape[0] == 0 or const_grad or bool(unsupported)
    if no_kernel or not _use_cuda(impl, *tensors):
        if mode == "cuda" and (logprobs.dim() != 2 or shape[0] == 0):
            raise ValueError(f"the policy-loss kernel needs [B, T] inputs with B > 0, got {tuple(shape)}")
        return L.policy_loss(logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs=ref_logprobs,
                             entropy=entropy, is_weights=is_weights)

    def f32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float().contiguous()

    if is_weights is not None:  # w * ppo_clip(A) == ppo_clip(w * A) for w >= 0 (see above)
        advantages = advantages.float() * is_weights.detach().float()

    value, out = _PolicyLoss.apply(
        f32(logprobs),
        f32(entropy),
        f32(old_logprobs).detach(),
        f32(advantages).detach(),
        f32(mask).detach(),
        f32(ref_logprobs).detach() if use_kl else None,
        float(cfg.clip_low),
        float(cfg.clip_high),
        0.0 if clip_ratio_c is None else float(clip_ratio_c),
        float(cfg.kl_coef) if use_kl else 0.0,
        kl.kernel_id if use_kl else 3,
        float(cfg.entropy_coef),
        agg.kernel_mode,
    )
    vals = dict(zip(_STAT_NAMES, out.tolist(), strict=True))
    stats = {k: vals[k] for k in ("pg_loss", "clip_frac", "approx_kl", "ratio_mean")}
    if clip_ratio_c is not None:
        stats["clip_frac_lower"] = vals["clip_frac_lower"]
    if use_kl:
        stats["kl"] = vals["kl"]
    if entropy is not None:
        stats["entropy"] = vals["entropy"]
    return value.to(logprobs.dtype), stats
