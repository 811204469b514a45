"""Rollout correction: the rollout engine's log-probs against the trainer's, and what the update does about
the gap.

The tokens of a step are sampled by the rollout side (vLLM in bf16, a copy a step behind in the async
mode, ...), but PPO's ratio is taken against the trainer's recomputed ``old_logprobs``. When the two
policies differ, the update is off-policy without knowing it; the gap grows with lower precision, other
kernels and staleness, and the importance ratio can explode (Yao et al., 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training"; Liu, Li et al., 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch"). With ``rho_t = pi_old(y_t) /
pi_rollout(y_t)`` on each policy token, from the log-probs the backend reported when it sampled
(``Batch.rollout_logprobs``):

* **drift metrics** (always, when the backend reports log-probs): mean and max ``|log pi_old - log
  pi_rollout|``, quantiles of ``rho``, the k3 estimate of KL(pi_rollout || pi_old), the share of tokens
  past the TIS cap and of episodes outside the MIS band; logged under ``offpolicy/`` each step;
* **truncated importance sampling** (TIS, ``train.algorithm.tis_cap = C``, Yao et al.): each token's policy-gradient
  term is weighted by ``min(rho_t, C)`` (a constant: no gradient flows through it), so the update estimates
  the gradient under the distribution actually sampled, with the variance bounded by ``C``;
* **per turn**: each turn records the weight version that generated it (asynchronous partial rollouts: an
  episode in flight when new weights arrive continues on them), so every token's ``rho`` is against its own
  turn's behaviour log-prob, its staleness is logged, and in the asynchronous mode a turn older than
  ``train.rollout.max_staleness`` is left out of the update (:func:`turn_staleness`,
  :func:`staleness_correction`);
* **masked importance sampling** (MIS, ``train.algorithm.mis_band = [low, high]``, the sequence-level rejection of
  Liu, Li et al. and verl's ``rollout_rs``): an episode whose sequence ratio ``prod_t rho_t`` (or its
  geometric mean with ``mis_level=geometric``) leaves the band is dropped from the update (its loss
  mask is zeroed after the advantages were computed, so it still counts in its group's baseline).

verl implements the same pair as ``algorithm.rollout_correction`` (``rollout_is=token`` with
``rollout_is_threshold``, ``rollout_rs=seq_sum_k1`` / ``seq_mean_k1``; its docs ``algo/rollout_corr.md``);
this module is written from those descriptions. TIS is on by default (``C = 2``, the value of Yao et al.):
where the rollout side runs the trainer's own weights at the same precision, ``rho`` is 1 up to float noise
and the weights change nothing, and where it does not, the uncorrected update is the documented failure.
MIS is off by default: it discards whole episodes, and the spread of a product over hundreds of tokens
depends on episode length, so its band has to be chosen for the model and backend at hand.
"""

from __future__ import annotations

from typing import Any

import torch

#: the bound on ``|log rho|`` before exponentiating (as in the losses: ``exp(20)`` ~ 5e8)
LOG_RATIO_BOUND = 20.0
#: the ratio quantiles logged each step
QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


def log_ratios(batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(log rho, known)``, both ``[N, T-1]``: ``log pi_old - log pi_rollout`` bounded to +-20 (0 where
    unknown) and the bool mask of policy tokens whose rollout log-prob the backend reported; ``None`` when
    the batch has no rollout log-probs, no ``old_logprobs`` or no such token."""
    if batch.rollout_logprobs is None or batch.old_logprobs is None:
        return None
    rollout = batch.rollout_logprobs.to(batch.old_logprobs.device)
    known = batch.loss_mask.bool() & torch.isfinite(rollout)
    if not bool(known.any()):
        return None
    diff = (batch.old_logprobs.float() - torch.where(known, rollout, 0.0)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(known, diff, 0.0), known


def quantiles(x: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """Quantiles of the 1-D float tensor ``x`` (``torch.quantile`` takes at most 2^24 values: a longer
    ``x`` is subsampled evenly first)."""
    limit = 1 << 24
    if x.numel() > limit:
        x = x[:: -(-x.numel() // limit)]
    return torch.quantile(x.float(), torch.tensor(qs, dtype=torch.float32)).tolist()


def drift_stats(log_rho: torch.Tensor, known: torch.Tensor, cap: float | None) -> dict[str, float]:
    """The step's drift metrics over the ``known`` tokens (``offpolicy/...``): ``lp_diff_abs_mean`` and
    ``lp_diff_abs_max`` (nats), ``ratio_p01`` ... ``ratio_p99`` and ``ratio_max`` of ``rho``, ``kl_k3`` (the
    k3 estimate of KL(pi_rollout || pi_old): ``E[rho - 1 - log rho]``), and with a cap
    ``tis_capped``, the share of tokens whose ratio exceeds it."""
    lr = log_rho[known]
    rho = lr.exp()
    out = {"offpolicy/lp_diff_abs_mean": float(lr.abs().mean()), "offpolicy/lp_diff_abs_max": float(lr.abs().max()),
           "offpolicy/ratio_max": float(rho.max()), "offpolicy/kl_k3": float((rho - 1.0 - lr).mean())}
    for q, v in zip(QUANTILES, quantiles(rho, QUANTILES), strict=True):
        out[f"offpolicy/ratio_p{round(100 * q):02d}"] = v
    if cap is not None:
        out["offpolicy/tis_capped"] = float((rho > cap).float().mean())
    return out


def sequence_keep(log_rho: torch.Tensor, known: torch.Tensor, band: tuple[float, float], level: str) -> torch.Tensor:
    """``[N]`` bool: the rows MIS keeps, those whose sequence ratio (``level="sequence"``: ``exp(sum_t log
    rho_t)``; ``"geometric"``: ``exp(mean_t log rho_t)``) lies in ``band = (low, high)``, and the rows with no
    known token (nothing to judge them by). Raises ``ValueError`` for another level."""
    n = known.sum(-1)
    total = log_rho.sum(-1)
    if level == "sequence":
        seq = total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    elif level == "geometric":
        seq = total / n.clamp(min=1)
    else:
        raise ValueError(f"train.algorithm.mis_level is 'sequence' or 'geometric', got {level!r}")
    ratio = seq.exp()
    return (n == 0) | ((ratio >= band[0]) & (ratio <= band[1]))


def turn_staleness(batch: Any, trajs: list[Any], version: int) -> torch.Tensor | None:
    """``[N, T-1]`` float32, aligned with ``loss_mask``: for each target token, ``version`` (the trainer's
    weights at this update) minus the weight version that generated its turn (``Turn.weight_version``, as the
    rollout backend reported it: with partial rollouts the turns of one episode may differ); NaN where the
    turn reports none. ``None`` when no turn of the batch reports a version."""
    turn_ids = batch.turn_ids[:, 1:]
    out = torch.full(turn_ids.shape, float("nan"))
    seen = False
    for i, traj in enumerate(trajs):
        for turn in traj.turns:
            v = turn.weight_version
            if isinstance(v, int) and not isinstance(v, bool):
                out[i][turn_ids[i] == turn.index] = float(version - v)
                seen = True
    return out if seen else None


def staleness_correction(batch: Any, log_rho: torch.Tensor, known: torch.Tensor, staleness: torch.Tensor,
                         bound: int | None) -> dict[str, float]:
    """The per-turn side of the correction: each policy token's staleness (:func:`turn_staleness`) logged
    (``offpolicy/turn_staleness_mean`` and ``_max``, and the drift ``|log rho|`` of the tokens of each
    staleness, ``offpolicy/lp_diff_abs_mean_stale<k>``), and with ``bound`` (the asynchronous mode's
    ``max_staleness``) the tokens of a turn older than it left out of the update (their ``loss_mask`` zeroed:
    ``offpolicy/stale_tokens_dropped``, a count). TIS itself already weighs every token by its own turn's
    behaviour log-prob."""
    policy = batch.loss_mask.bool().cpu()
    st = staleness.to(policy.device)
    have = policy & torch.isfinite(st)
    if not bool(have.any()):
        return {}
    vals = st[have]
    out = {"offpolicy/turn_staleness_mean": float(vals.mean()), "offpolicy/turn_staleness_max": float(vals.max())}
    kn = known.cpu()
    for k in sorted({int(v) for v in vals.tolist()}):
        sel = have & kn & (st == k)
        if bool(sel.any()):
            out[f"offpolicy/lp_diff_abs_mean_stale{k}"] = float(log_rho.cpu()[sel].abs().mean())
    if bound is not None:
        drop = have & (st > bound)
        out["offpolicy/stale_tokens_dropped"] = float(drop.sum())
        if bool(drop.any()):
            batch.loss_mask = batch.loss_mask * (~drop).to(batch.loss_mask.device, batch.loss_mask.dtype)
    return out


def rollout_correction(batch: Any, tc: Any, staleness: torch.Tensor | None = None) -> dict[str, float]:
    """Compare ``batch.rollout_logprobs`` with ``batch.old_logprobs`` (both ``[N, T-1]``; call it after
    :func:`training.model.actor.score_logprobs` and after the advantages) and apply the configured correction:
    ``batch.is_weights`` ``[N, T-1]`` = ``min(rho, tis_cap)`` on the known policy tokens and 1 elsewhere
    (``None`` with ``tis_cap=None``), and with ``mis_band`` the rows outside the band get a zero
    ``loss_mask`` (``offpolicy/mis_rejected``: the share of rows with known tokens dropped); the settings are
    ``tc.algorithm``'s (``tc``: a :class:`training.config.TrainConfig`). ``staleness`` (:func:`turn_staleness`:
    each token's turn's weight version against the trainer's) adds the per-turn side
    (:func:`staleness_correction`; tokens older than ``tc.rollout.max_staleness`` are dropped in the
    asynchronous mode). Returns the drift metrics of :func:`drift_stats` (empty, and no correction, when the
    backend reported no log-probs)."""
    got = log_ratios(batch)
    if got is None:
        return {}
    log_rho, known = got
    alg = tc.algorithm
    stats = drift_stats(log_rho, known, alg.tis_cap)
    if staleness is not None:
        bound = tc.rollout.max_staleness if tc.rollout.asynchronous else None
        stats.update(staleness_correction(batch, log_rho, known, staleness, bound))
        known = known & batch.loss_mask.bool().to(known.device)
    if alg.tis_cap is not None:
        weights = torch.where(known, log_rho.exp().clamp(max=alg.tis_cap), 1.0)
        batch.is_weights = weights.to(batch.loss_mask.dtype).to(batch.loss_mask.device)
    if alg.mis_band is not None:
        keep = sequence_keep(log_rho, known, tuple(alg.mis_band), alg.mis_level).to(batch.loss_mask.device)
        judged = known.any(-1).to(keep.device)
        stats["offpolicy/mis_rejected"] = float((~keep & judged).sum() / judged.sum().clamp(min=1))
        batch.loss_mask = batch.loss_mask * keep.unsqueeze(-1).to(batch.loss_mask.dtype)
    return stats
