"""The actor's scoring and update: the behaviour and reference log-probs of a rollout batch, and the masked
policy loss over micro-batches, one optimizer step per epoch.

* :func:`score_logprobs` fills ``batch.old_logprobs`` (the behaviour policy, recomputed as verl does) and
  ``batch.ref_logprobs`` (the KL reference) with the update's own micro-batch split and autocast, so the
  first epoch's ratio is exactly 1;
* :func:`update_policy` runs ``train.algorithm.ppo_epochs`` epochs of the registered policy loss
  (:func:`training.model.kernels.policy_loss`, its settings one :class:`training.algos.losses.LossConfig`),
  with PPO's critic stepping beside it (:mod:`training.model.critic`).

The forward itself (masked log-probs and entropies through the fused kernels) is
:mod:`training.model.forward`'s.
"""
from __future__ import annotations

from typing import Any

import torch

from training.algos.losses import LOSS_AGGS, LossConfig
from training.batch import Batch, micro_batches
from training.infra.distributed import all_reduce_sum, clipped_grad_norm, pad_micro_batches, world
from training.model.critic import critic_grads
from training.model.forward import LogprobModule, autocast
from training.model.kernels import policy_loss


def split_micro_batches(batch: Batch, cfg: Any) -> tuple[list[torch.Tensor], list[Batch], int]:
    """The micro-batches :func:`update_policy` runs, in its order: ``(row-index tensors, micro-batches,
    number of real ones)``. Rows are split by ``optim.micro_batch`` rows and ``optim.micro_batch_tokens``
    tokens (a packed budget with ``optim.packing``, :func:`training.batch.micro_batches`); under torchrun the
    list is padded to the same count on every rank (:func:`training.infra.distributed.pad_micro_batches`; the
    padding repeats the last one and must get zero weight). ``cfg`` is a :class:`training.config.TrainConfig`."""
    opt = cfg.optim
    idx = micro_batches(batch, opt.micro_batch, opt.micro_batch_tokens, packed=opt.packing)
    idx, n_real = pad_micro_batches(idx)
    return idx, [batch.select(i, packed=opt.packing) for i in idx], n_real


@torch.no_grad()
def score_logprobs(module: Any, ref_model: Any | None, batch: Batch, cfg: Any) -> None:
    """Set ``batch.old_logprobs`` (the policy before the update) and, with ``ref_model``, ``batch.ref_logprobs``
    (the reference), both ``[N, T-1]`` float32 on the CPU, zero off the loss mask. They are computed on
    :func:`update_policy`'s own micro-batches under its autocast (bf16 on GPU with ``optim.bf16``), so each
    micro-batch of the update reads back exactly the values it would compute: the first epoch's ratio is 1."""
    fwd = module if isinstance(module, LogprobModule) else LogprobModule(module)
    device = next(fwd.parameters()).device
    idx, micro, _ = split_micro_batches(batch, cfg)
    batch.old_logprobs = torch.zeros_like(batch.loss_mask)
    if ref_model is not None:
        batch.ref_logprobs = torch.zeros_like(batch.loss_mask)
        ref = LogprobModule(ref_model)
    for i, mb in zip(idx, micro, strict=True):
        with autocast(device, cfg.optim.bf16):
            old = fwd(mb, False)[0].detach()
        batch.old_logprobs[i, : old.shape[1]] = old.to(batch.old_logprobs.device)
        if ref_model is not None:
            with autocast(device, cfg.optim.bf16):
                batch.ref_logprobs[i, : old.shape[1]] = ref(mb, False)[0].to(batch.ref_logprobs.device)


def micro_batch_share(mb: Batch, unit: str, totals: dict[str, float]) -> float:
    """A micro-batch's weight in the step's loss: its share of the global policy tokens (``unit ==
    "tokens"``) or of the global rows that hold policy tokens (``"rows"``), so that micro-batches and ranks
    sum to one full-batch step (FSDP averages gradients over ranks, hence the caller's factor ``W``)."""
    mask = mb.loss_mask
    if unit == "tokens":
        return float(mask.sum()) / max(totals["tokens"], 1.0)
    return float((mask.sum(-1) > 0).sum()) / max(totals["rows"], 1.0)


def policy_grads(fwd: LogprobModule, micro: list[Batch], n_real: int, cfg: Any, loss: LossConfig,
                 totals: dict[str, float], stats: dict[str, float]) -> None:
    """Accumulate the policy loss's gradients (settings ``loss``) over the micro-batches (weighted by
    :func:`micro_batch_share`, padding micro-batches by 0) and its statistics into ``stats``. Raises
    ``FloatingPointError`` on a non-finite loss on one process (under torchrun the NaN reaches every rank
    through the gradient reduction and the caller's norm check catches it on all of them)."""
    device = next(fwd.parameters()).device
    W = world()[1]
    unit = LOSS_AGGS.get(loss.loss_agg).unit
    for j, mb in enumerate(micro):
        with autocast(device, cfg.optim.bf16):
            lp, ent = fwd(mb)
        mask = mb.loss_mask.to(lp.device)
        use_ref = mb.ref_logprobs is not None and cfg.algorithm.kl_mode == "loss"
        value, step_stats = policy_loss(
            lp, mb.ratio_logprobs().to(lp.device), mb.token_advantages.to(lp.device), mask, loss,
            ref_logprobs=mb.ref_logprobs.to(lp.device) if use_ref else None, entropy=ent,
            is_weights=mb.is_weights.to(lp.device) if mb.is_weights is not None else None)
        if not torch.isfinite(value) and W == 1:
            raise FloatingPointError(f"non-finite policy loss ({float(value)})")
        share = micro_batch_share(mb, unit, totals) if j < n_real else 0.0
        (value * share * W).backward()
        for k, v in step_stats.items():
            stats[k] = stats.get(k, 0.0) + v * share


def update_policy(
    module: Any,
    ref_model: Any | None,
    optimizer: Any,
    batch: Batch,
    cfg: Any,
    *,
    scheduler: Any | None = None,
    critic: Any | None = None,
    critic_optimizer: Any | None = None,
    loss: LossConfig | None = None,
) -> dict[str, float]:
    """The policy-loss update(s) on one rollout batch; returns averaged loss statistics (``lr``: the learning
    rate the optimizer steps used, before the scheduler advanced it).

    ``module`` is the policy (a Hugging Face causal LM) or its :class:`LogprobModule` (possibly
    FSDP2-sharded); ``batch.token_advantages`` ``[N, T-1]`` must be set (``ValueError`` otherwise).
    ``batch.old_logprobs`` (and ``batch.ref_logprobs`` for a KL loss) are those of
    :func:`score_logprobs`, computed here when missing (``ref_model`` for the reference). ``cfg`` is a
    :class:`training.config.TrainConfig`; ``loss`` the loss's settings (the trainer builds them once;
    default: :meth:`training.algos.losses.LossConfig.of` ``cfg.algorithm``, without a constant for
    ``seq-mean-token-sum-norm`` unless ``loss_scale_factor`` sets it). With ``ppo_epochs == 1`` the ratio is
    1 and the update is the on-policy policy gradient. Micro-batches follow ``optim.micro_batch`` rows and
    ``optim.micro_batch_tokens``; each is weighted so that the step equals one full-batch step, also across
    ranks (global token and row counts). A non-finite loss raises
    ``FloatingPointError`` before any parameter moves in its epoch (with ``ppo_epochs > 1`` the earlier
    epochs' steps stand; a non-finite value loss of PPO's critic too: neither model steps). ``critic`` (PPO,
    with ``batch.returns`` and ``batch.old_values``) is a :class:`training.model.critic.ValueModel` whose
    gradients :func:`training.model.critic.critic_grads` adds before either model steps.
    """
    fwd = module if isinstance(module, LogprobModule) else LogprobModule(module)
    if batch.token_advantages is None:
        raise ValueError("update_policy needs batch.token_advantages (the advantage phase sets them)")
    alg = cfg.algorithm
    loss = loss if loss is not None else LossConfig.of(alg)
    use_ref = ref_model is not None and alg.kl_coef > 0 and alg.kl_mode == "loss"
    if batch.old_logprobs is None or (use_ref and batch.ref_logprobs is None):
        score_logprobs(fwd, ref_model if use_ref else None, batch, cfg)
    _, micro, n_real = split_micro_batches(batch, cfg)
    totals = {"tokens": all_reduce_sum(float(batch.loss_mask.sum())),
              "rows": all_reduce_sum(float((batch.loss_mask.sum(-1) > 0).sum()))}
    use_critic = critic is not None and batch.returns is not None
    stats: dict[str, float] = {}
    for _ in range(alg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        try:
            policy_grads(fwd, micro, n_real, cfg, loss, totals, stats)
            grad_norm = clipped_grad_norm([p for p in fwd.parameters() if p.requires_grad], cfg.optim.grad_clip)
            if not torch.isfinite(grad_norm):
                raise FloatingPointError("non-finite gradient norm")
            if use_critic:  # the value loss's gradients (and its finiteness check) before either model steps
                critic_optimizer.zero_grad(set_to_none=True)
                critic_grads(critic, micro, n_real, cfg, totals["tokens"], stats)
        except FloatingPointError:
            optimizer.zero_grad(set_to_none=True)
            if use_critic:
                critic_optimizer.zero_grad(set_to_none=True)
            raise
        stats["lr"] = stats.get("lr", 0.0) + optimizer.param_groups[0]["lr"]  # the rate this step uses
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if use_critic:
            critic_optimizer.step()
        stats["grad_norm"] = stats.get("grad_norm", 0.0) + float(grad_norm)
    return {k: v / alg.ppo_epochs for k, v in stats.items()}
