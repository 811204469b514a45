"""Masked policy-gradient losses: the PyTorch reference (the spec) of the fused CUDA kernels, and the
registries of the loss's parts.

Shapes: ``B`` sequences of ``T`` tokens; every per-token tensor is ``[B, T]`` and ``mask`` is 1.0 exactly
at the policy's own tokens (tool and prompt tokens get no gradient, as in Search-R1). Log-probabilities are
float32 natural logs. Three registries (:mod:`training.registry`), each filled below and open to plugins:

* :data:`POLICY_LOSSES` (``train.algorithm.policy_loss``): the per-token policy-gradient term. ``ppo_clip``: PPO
  (Schulman et al., 2017) with DAPO's clip-higher (Yu et al., 2025) and optional dual-clip (Ye et al., 2020);
  ``gspo``: GSPO's sequence-level ratio and clipping (Zheng et al., 2025); ``cispo``: CISPO's clipped,
  stop-gradient importance weights (MiniMax-M1, 2025);
* :data:`KL_ESTIMATORS` (``train.algorithm.kl_type``): per-token KL(pi || pi_ref) from sampled tokens, after
  Schulman's "Approximating KL divergence" note and verl's ``core_algos.kl_penalty`` (k1, k2, k3, abs);
* :data:`LOSS_AGGS` (``train.algorithm.loss_agg_mode``): how a ``[B, T]`` loss becomes a scalar, verl's ``agg_loss`` modes
  (token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm).

:func:`policy_loss` composes them (policy term + KL-to-reference loss - entropy bonus) with the settings of
one :class:`LossConfig` (built once from the config's ``train.algorithm`` section, :meth:`LossConfig.of`);
:func:`training.model.kernels.policy_loss` takes the same arguments, runs the fused kernel for the
combinations it implements and this reference otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from training.algos.options import check_range
from training.registry import Options, Registry, decorator, options_class


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of each next-token distribution.

    ``logits``: ``[..., V]`` any float dtype (upcast to float32); ``targets``: ``[...]`` int64.
    Returns ``(logprobs, entropy)``, both ``[...]`` float32. This materialises ``[..., V]`` in float32: the
    naive path that :func:`training.model.kernels.masked_logprobs` avoids.
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


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` over the masked tokens (a statistic: a Python float; 0 for an empty mask)."""
    return float(_masked(values.detach(), mask).sum() / mask.sum().clamp(min=1.0))


# -- loss aggregation ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossAgg:
    """A loss aggregation mode. ``fn(kept, mask, scale)`` reduces the masked ``[B, T]`` loss ``kept`` (zero
    off-mask) to a scalar. ``unit`` is what its global normaliser counts, ``"tokens"`` (policy tokens) or
    ``"rows"`` (rows with at least one policy token): the trainer weights micro-batches and ranks by it so
    that a step equals one full-batch step. ``kernel_mode`` is the CUDA kernel's mode id, ``None`` where
    only the reference implements it."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]
    unit: str
    kernel_mode: int | None = None


LOSS_AGGS: Registry[LossAgg] = Registry("loss aggregation", "train.algorithm.loss_agg_mode")


def register_loss_agg(name: str, unit: str, kernel_mode: int | None = None, replace: bool = False):
    """Register ``fn(kept [B, T], mask [B, T], scale) -> scalar`` as loss aggregation ``name`` (see
    :class:`LossAgg`). Raises ``ValueError`` for a unit other than ``tokens``/``rows``."""
    if unit not in ("tokens", "rows"):
        raise ValueError(f"a loss aggregation's unit is 'tokens' or 'rows', got {unit!r}")
    return decorator(LOSS_AGGS, name, lambda fn: LossAgg(name, fn, unit, kernel_mode), replace)


def _rows_with_tokens(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(-1) > 0).to(mask.dtype)


@register_loss_agg("token-mean", "tokens", kernel_mode=0)
def _token_mean(kept: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Sum over all policy tokens / number of policy tokens (DAPO)."""
    return kept.sum() / mask.sum().clamp(min=1.0)


@register_loss_agg("seq-mean-token-sum", "rows", kernel_mode=1)
def _seq_mean_token_sum(kept: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Mean over the rows that hold policy tokens of each row's token sum (Dr. GRPO's sum without the
    constant). Rows without a policy token are not counted, as in verl's ``agg_loss`` since late 2025 and
    as ``seq-mean-token-mean`` here (earlier Sleuth divided by every row)."""
    return kept.sum(-1).sum() / _rows_with_tokens(mask).sum().clamp(min=1.0)


@register_loss_agg("seq-mean-token-mean", "rows", kernel_mode=2)
def _seq_mean_token_mean(kept: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Mean over the rows that hold policy tokens of each row's token mean (the original GRPO)."""
    n = mask.sum(-1)
    per_seq = kept.sum(-1) / n.clamp(min=1.0)
    has = (n > 0).to(kept.dtype)
    return (per_seq * has).sum() / has.sum().clamp(min=1.0)


@register_loss_agg("seq-mean-token-sum-norm", "rows")
def _seq_mean_token_sum_norm(kept: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): each row's token sum divided by a
    constant ``scale`` (the generation budget: the trainer passes ``train.algorithm.loss_scale_factor``, else
    ``agent.max_total_tokens``), averaged over the rows that hold policy tokens, so neither a response's
    length nor the batch's longest row changes a token's weight. verl's mode of the same name sums the rows
    instead of averaging them (its per-row scale then comes from the global batch size): the two differ by
    the constant number of rows. Raises ``ValueError`` without a positive ``scale``."""
    if scale is None or not scale > 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a positive constant normaliser, got {scale}")
    return kept.sum(-1).sum() / (scale * _rows_with_tokens(mask).sum().clamp(min=1.0))


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              scale: float | None = None) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss over the masked tokens with the registered mode ``mode`` (see
    :data:`LOSS_AGGS`; ``scale`` is the constant of ``seq-mean-token-sum-norm``). An all-masked batch gives
    0 (with gradient 0). Masked positions are selected away, so NaN/inf there never reach the result (as in
    the CUDA kernel). Raises ``ValueError`` for an unknown mode."""
    mask = mask.to(values.dtype)
    return LOSS_AGGS.get(mode).fn(_masked(values, mask), mask, scale)


# -- KL estimators ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KLEstimator:
    """A per-token KL(pi || pi_ref) estimator ``fn(logprobs, ref_logprobs) -> [...]`` (same shape);
    ``kernel_id`` is the CUDA kernel's id for it (``None``: reference only)."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    kernel_id: int | None = None


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "train.algorithm.kl_type")


def register_kl(name: str, kernel_id: int | None = None, replace: bool = False):
    """Register ``fn(logprobs, ref_logprobs) -> per-token KL estimate`` as KL estimator ``name``."""
    return decorator(KL_ESTIMATORS, name, lambda fn: KLEstimator(name, fn, kernel_id), replace)


#: the bound of the k3 estimate per token (verl's ``low_var_kl`` clamps it to [-10, 10]; k3 is never negative)
K3_MAX = 10.0


@register_kl("k1", kernel_id=1)
def _k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref``: unbiased, high variance, may be negative."""
    return logprobs - ref_logprobs


@register_kl("k2")
def _k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``0.5 (log pi - log pi_ref)^2``: biased, low variance, never negative (verl's ``mse``/``k2``); its
    gradient is the one of the reverse KL in expectation (Schulman's note)."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register_kl("k3", kernel_id=3)
def _k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``exp(d) - d - 1`` with ``d = log pi_ref - log pi``: unbiased, non-negative (GRPO's choice), as verl's
    ``low_var_kl``: ``d`` clamped to +-20 before the exp and the estimate to at most :data:`K3_MAX` (a token
    the policy made >13x less likely than the reference adds at most 10, and no gradient)."""
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(max=K3_MAX)


@register_kl("abs")
def _abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``|log pi - log pi_ref|`` (verl's ``abs``): never negative, a constant-magnitude gradient."""
    return (logprobs - ref_logprobs).abs()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate of the registered estimator ``kind`` (:data:`KL_ESTIMATORS`).
    Raises ``ValueError`` for an unknown kind."""
    return KL_ESTIMATORS.get(kind).fn(logprobs, ref_logprobs)


# -- policy losses ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossConfig:
    """The actor loss's settings, built once from the config (:meth:`of`) and given to every
    :func:`policy_loss` (this reference, :func:`training.model.kernels.policy_loss` and the fused loss alike).

    ``loss``: the registered policy term (:data:`POLICY_LOSSES`); ``clip_low`` / ``clip_high``: PPO's ratio
    clip range ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher when ``clip_high > clip_low``);
    ``clip_ratio_c``: the dual-clip bound (> 1) or ``None``; ``loss_agg``: the registered aggregation
    (:data:`LOSS_AGGS`) and ``loss_scale`` its constant (``seq-mean-token-sum-norm``, tokens); ``kl_coef`` /
    ``kl_type``: the KL-to-reference loss (applied when reference log-probs are given and ``kl_coef > 0``);
    ``entropy_coef``: the entropy bonus; ``options``: the policy term's own settings (an instance of its
    registered :class:`training.registry.Options` class; ``None``: its defaults)."""

    loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    loss_agg: str = "token-mean"
    loss_scale: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    options: Options | None = field(default=None, compare=False)

    @classmethod
    def of(cls, alg: Any, loss_scale: float | None = None) -> LossConfig:
        """The settings of a ``train.algorithm`` section (:class:`training.config.AlgorithmConfig`);
        ``loss_scale``: ``seq-mean-token-sum-norm``'s constant when ``alg.loss_scale_factor`` is unset."""
        return cls(loss=alg.policy_loss, clip_low=alg.clip_ratio_low, clip_high=alg.clip_ratio_high,
                   clip_ratio_c=alg.clip_ratio_c, loss_agg=alg.loss_agg_mode,
                   loss_scale=alg.loss_scale_factor or loss_scale, kl_coef=alg.kl_coef,
                   kl_type=alg.kl_type, entropy_coef=alg.entropy_coeff, options=alg.loss_options)

    def resolved(self) -> LossConfig:
        """Itself with ``options`` set (the registered loss's defaults when ``None``). Raises ``ValueError``
        for an unknown loss, ``TypeError`` for options of another loss's model."""
        term = POLICY_LOSSES.get(self.loss)
        if self.options is None:
            return replace(self, options=term.options())
        if not isinstance(self.options, term.options):
            raise TypeError(f"policy loss {self.loss!r} takes {term.options.__name__}, got "
                             f"{type(self.options).__name__}")
        return self


#: the default settings (PPO-clip, clip range 0.2, token-mean, no KL or entropy term)
DEFAULT_LOSS = LossConfig()


@dataclass(frozen=True)
class PolicyLossFn:
    """A policy-gradient term ``fn(logprobs, old_logprobs, advantages, mask, cfg: LossConfig) -> (pg [B, T],
    stats)``: the per-token loss (aggregated by the loss aggregation, so a sequence-level loss writes its value
    on each of the sequence's tokens) and its own statistics (floats); it reads its clip range and its own
    ``cfg.options`` (an instance of ``options``, its :class:`training.registry.Options` class). ``kernel``: the
    fused CUDA loss kernel implements it (``ppo_clip`` only)."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, dict[str, float]]]
    kernel: bool = False
    options: type[Options] = Options


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "train.algorithm.policy_loss")


def register_policy_loss(name: str, kernel: bool = False, options: type[Options] = Options, replace: bool = False):
    """Register a policy-gradient term (see :class:`PolicyLossFn`) as ``name``, with its options class."""
    opts = options_class(options, f"policy loss {name!r}")
    return decorator(POLICY_LOSSES, name, lambda fn: PolicyLossFn(name, fn, kernel, opts), replace)


@register_policy_loss("ppo_clip", kernel=True)
def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip with DAPO clip-higher and optional dual-clip. Per token: ``r = exp(logp - old_logp)``;
    ``pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with ``clip_ratio_c`` (> 1; dual-clip PPO,
    Ye et al. 2020, verl's ``clip_ratio_c``) a token with ``A < 0`` has ``pg = min(pg, -A c)``, so a large
    ratio on a negative advantage cannot grow the loss without bound. Stats: ``clip_frac`` and, with
    dual-clip, ``clip_frac_lower`` (the share of tokens the bound caps). Raises ``ValueError`` for
    ``clip_ratio_c <= 1``."""
    clip_ratio_c = cfg.clip_ratio_c
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    stats = {"clip_frac": token_mean((pg2 > pg1).to(mask.dtype), mask)}
    if clip_ratio_c is not None:
        if not clip_ratio_c > 1.0:
            raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
        pg3 = -advantages * clip_ratio_c
        lower = (advantages < 0) & (pg3 < pg)
        pg = torch.where(lower, pg3, pg)
        stats["clip_frac_lower"] = token_mean(lower.to(mask.dtype), mask)
    return pg, stats


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each sequence's length-normalised log importance ratio ``(1/|y|) sum_t log(pi / pi_old)`` over
    its policy tokens (0 for a row without one); differentiable w.r.t. ``logprobs``."""
    n = mask.sum(-1).clamp(min=1.0)
    return _masked(logprobs - old_logprobs, mask).sum(-1) / n


@register_policy_loss("gspo")
def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"; verl's ``compute_policy_loss_gspo``):
    the importance ratio and its clipping are per *sequence*, not per token.

    ``s_i = exp((1/|y_i|) sum_t log(pi(y_t) / pi_old(y_t)))`` is the length-normalised (geometric-mean)
    sequence ratio (:func:`sequence_log_ratio`); ``pg = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))``.
    Implemented as the paper's GSPO-token form, ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is
    ``s_i`` on every token and its gradient is GSPO's when the advantage is one number per sequence, while
    turn-level advantages (GiGPO, IGPO) still weigh each token by its own ``A_t``. A sequence is clipped as
    a whole (every token of a far-off-policy sequence drops out), where PPO clips token by token. The loss
    writes the sequence value on each token: aggregate it ``seq-mean-token-mean`` (the paper's
    ``1/G sum_i``); ``token-mean`` would weight long sequences more. The paper's clip range is tiny
    (3e-4 / 4e-4: set ``train.algorithm.clip_ratio_low`` / ``clip_ratio_high``) because a sequence ratio moves
    far less than a token's. ``clip_ratio_c`` is not used.
    Stats: ``clip_frac`` (the share of policy tokens whose sequence was clipped)."""
    seq = sequence_log_ratio(logprobs, old_logprobs, mask).detach()  # [B]
    log_ratio = (seq.unsqueeze(-1) + logprobs - logprobs.detach()).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    return pg, {"clip_frac": token_mean((pg2 > pg1).to(mask.dtype), mask)}


@dataclass(frozen=True)
class CISPOOptions(Options):
    """CISPO's own setting (``train.algorithm.loss_options`` with ``policy_loss: cispo``): ``clip_low`` in
    ``[0, 1]`` bounds the importance weight below at ``1 - clip_low`` (``None``: no lower bound, as the
    paper)."""

    clip_low: float | None = None

    def __post_init__(self) -> None:
        if self.clip_low is not None:
            check_range("CISPO's clip_low", self.clip_low, 0.0, 1.0)


@register_policy_loss("cispo", options=CISPOOptions)
def cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    Sec. 3.1; verl's ``compute_policy_loss_cispo``): REINFORCE with a clipped, stop-gradient importance
    weight, ``J = sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi(y_t)``.

    PPO's clip drops the gradient of a token whose ratio left the trust region (in MiniMax-M1's runs, the
    rare "fork" tokens of reflective reasoning, which got no gradient after the first off-policy update);
    CISPO clips the *weight* instead, so every token keeps its gradient ``A_t * r_hat_t * grad log pi``.
    Written as ``pg = -A * sg(r_hat) * pi / sg(pi)``, whose value is ``-A * r_hat`` (comparable to PPO's
    loss) and whose gradient is the paper's. The upper bound is ``1 + clip_high``; like the paper (which
    sets eps_low large), there is no lower bound unless its option ``clip_low`` (:class:`CISPOOptions`) gives
    one (the weight is then at least ``1 - clip_low``); ``cfg.clip_low`` and ``clip_ratio_c`` are not used.
    Aggregate ``token-mean`` (the paper's ``1 / sum_i |o_i|``). Stats: ``clip_frac`` (the share of policy
    tokens whose weight was clipped)."""
    low = cfg.options.clip_low if isinstance(cfg.options, CISPOOptions) else None
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0)).detach()
    weight = ratio.clamp(max=1.0 + cfg.clip_high)
    if low is not None:
        weight = weight.clamp(min=1.0 - float(low))
    pg = -advantages * weight * torch.exp(logprobs - logprobs.detach())
    return pg, {"clip_frac": token_mean((weight != ratio).to(mask.dtype), mask)}


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig = DEFAULT_LOSS,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The masked actor loss (reference): the registered policy term ``cfg.loss`` aggregated by
    ``cfg.loss_agg``, plus ``cfg.kl_coef`` times the aggregated KL estimate ``cfg.kl_type`` when
    ``ref_logprobs`` is given and minus ``cfg.entropy_coef`` times the aggregated entropy when ``entropy`` is
    given. All inputs ``[B, T]`` float; ``is_weights`` (``[B, T]``, non-negative constants: the rollout
    correction's truncated importance weights, :mod:`training.algos.offpolicy`) multiply the policy term per
    token before aggregation, as verl's ``rollout_is_weights`` (the KL and entropy terms are not weighted).
    Returns ``(loss, stats)`` with ``stats`` = pg_loss, the term's own stats (``ppo_clip``: clip_frac),
    approx_kl (vs. the old policy), ratio_mean, kl (vs. the reference) and entropy. Raises ``ValueError`` for
    an unknown loss, aggregation or KL kind; ``TypeError`` for options of another loss's model."""
    cfg = cfg.resolved()
    mask = mask.to(logprobs.dtype)
    term = POLICY_LOSSES.get(cfg.loss)
    agg = LOSS_AGGS.get(cfg.loss_agg)
    pg, own = term.fn(logprobs, old_logprobs, advantages, mask, cfg)
    if is_weights is not None:
        pg = pg * is_weights.detach().to(pg.dtype)
    pg_loss = agg.fn(_masked(pg, mask), mask, cfg.loss_scale)
    out = pg_loss
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    stats: dict[str, float] = {"pg_loss": float(pg_loss.detach()), **own,
                               "approx_kl": token_mean(-log_ratio, mask),
                               "ratio_mean": token_mean(torch.exp(log_ratio), mask)}
    if ref_logprobs is not None and cfg.kl_coef > 0:
        kl = agg.fn(_masked(kl_estimate(logprobs, ref_logprobs, cfg.kl_type), mask), mask, cfg.loss_scale)
        out = out + cfg.kl_coef * kl
        stats["kl"] = float(kl.detach())
    if entropy is not None:
        ent = agg.fn(_masked(entropy, mask), mask, cfg.loss_scale)
        stats["entropy"] = float(ent.detach())
        if cfg.entropy_coef != 0:
            out = out - cfg.entropy_coef * ent
    return out, stats
