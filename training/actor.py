"""The actor: the policy's forward (log-prob and entropy of every target token at loss-mask positions,
through the fused kernels) and its update (the masked policy loss over micro-batches, one optimizer step).

* :func:`policy_logprobs` runs a causal LM on a :class:`training.batch.Batch` and returns ``[N, T-1]``
  log-probs and entropies, tool and prompt tokens compacted away before the LM head
  (:func:`training.kernels.masked_logprobs`); :class:`LogprobModule` wraps it as the unit FSDP2 shards;
* :func:`score_logprobs` fills ``batch.old_logprobs`` (the behaviour policy, recomputed as verl does) and
  ``batch.ref_logprobs`` (the KL reference) with the update's own micro-batch split and autocast, so the
  first epoch's ratio is exactly 1;
* :func:`update_policy` runs ``train.ppo_epochs`` epochs of the registered policy loss
  (:func:`training.kernels.policy_loss`), with PPO's critic stepping beside it (:mod:`training.critic`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training.algos.advantages import to_token_advantages
from training.algos.losses import LOSS_AGGS
from training.batch import Batch, micro_batches
from training.infra.distributed import all_reduce_sum, pad_micro_batches, world
from training.lora import base_model


# -- the forward --------------------------------------------------------------------------------------
def tempered(hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """``hidden / temperature``: the bias-free LM head then gives ``logits / temperature`` (and its gradient)
    with no change to the fused kernel. Raises ``ValueError`` for a temperature <= 0 (greedy rollouts have no
    sampling distribution to score)."""
    if temperature == 1.0:
        return hidden
    if not temperature > 0:
        raise ValueError(f"log-probs need a sampling temperature > 0, got {temperature}")
    return hidden / temperature


def backbone_and_head(model):
    """``(backbone, LM-head weight [V, H])`` of a Hugging Face causal LM; ``ValueError`` unless its head is a
    bias-free linear layer (the fused log-prob kernel multiplies by the weight alone)."""
    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("policy_logprobs needs a causal LM with a bias-free linear LM head")
    return backbone, head.weight


def check_packed_masks() -> None:
    """Raise ``ValueError`` unless the installed transformers turns restarting position ids into a
    block-diagonal mask (``masking_utils.find_packed_sequence_indices``). Older releases
    (4.51-4.52, which the dependency range allows) build one plain causal mask over the packed row, so every
    sequence would attend to the sequences packed before it: wrong log-probs and a loss across episodes."""
    import importlib

    try:
        found = hasattr(importlib.import_module("transformers.masking_utils"), "find_packed_sequence_indices")
    except ImportError:
        found = False
    if not found:
        import transformers

        raise ValueError(f"train.packing needs a transformers that detects packed sequences (masking_utils."
                         f"find_packed_sequence_indices: 4.55 has it, 4.51-4.52 do not), installed "
                         f"{transformers.__version__}: without it packed episodes attend to each other; upgrade "
                         "transformers or set train.packing=false")


def packed_hidden(backbone, batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``backbone`` on the rows' real tokens packed into one row; return the final hidden states at the
    prediction positions, ``[P, H]`` in row-major order of ``valid = attention_mask[:, 1:]`` (``P`` =
    ``sum(lengths - 1)``), and ``valid`` ``[N, T-1]`` bool.

    Position ids restart at 0 for every sequence and no attention mask is passed: transformers (>= 4.56,
    ``masking_utils.find_packed_sequence_indices``) then detects the packed sequences from the position ids
    and builds a block-diagonal causal mask (sdpa/eager/flex; flash-attention uses varlen ``cu_seqlens``
    from the same position ids). ``use_cache=False`` is needed: with a cache the detection is skipped. The
    hidden state of a sequence's last token is never gathered, so no target crosses into the next sequence.
    Raises ``ValueError`` for a transformers without that detection (:func:`check_packed_masks`) and for rows
    that are not right-padded.
    """
    check_packed_masks()
    attn = batch.attention_mask.bool()
    N, T = attn.shape
    lengths = attn.sum(-1)
    pos = torch.arange(T).expand(N, T)
    if not torch.equal(attn.cpu(), pos < lengths.cpu().unsqueeze(-1)):
        raise ValueError("packed policy_logprobs needs right-padded rows (attention_mask 1...1 0...0)")
    ids = batch.input_ids[attn].to(device).unsqueeze(0)  # [1, L]
    position_ids = pos.to(attn.device)[attn].to(device).unsqueeze(0)  # [1, L], 0.. per sequence
    out = backbone(input_ids=ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    hidden = out.last_hidden_state[0]  # [L, H]
    starts = torch.cumsum(lengths, 0) - lengths  # [N] offset of each sequence in the packed row
    valid = attn[:, 1:]  # [N, T-1]: position t predicts token t+1 of the same sequence
    flat = (starts.unsqueeze(-1) + torch.arange(T - 1, device=attn.device))[valid]  # [P]
    return hidden.index_select(0, flat.to(device)), valid


def policy_logprobs(
    model, batch: Batch, with_entropy: bool = True, packed: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and next-token entropy, at loss-mask positions only.

    ``model``: a Hugging Face causal LM (possibly peft-wrapped) with a bias-free linear LM head. Returns
    ``(logprobs, entropy)``, both ``[N, T-1]`` float32 on the model's device, of ``softmax(logits /
    batch.temperature)``, zero where ``batch.loss_mask`` is 0; ``entropy`` is all zeros when
    ``with_entropy=False`` (the reference skips that work; the CUDA kernel computes it in the same pass
    anyway, see :func:`training.kernels.masked_logprobs`). Uses the
    fused CUDA kernel on GPU when built (:mod:`training.kernels`), else the PyTorch reference.

    ``packed`` (``None``: ``batch.packed``) packs the rows' real tokens into one ``[1, sum(lengths)]`` row
    with block-diagonal causal attention instead of running the padded ``[N, T]`` (see :func:`packed_hidden`);
    outputs and gradients equal the padded path's within float tolerance (``tests/test_packing.py``). It
    needs right-padded rows and a loss mask that is 0 wherever the target is padding (as :func:`collate`
    builds it); raises ``ValueError`` otherwise. Cost: with flash-attention (varlen) the attention is
    ``sum(n_i^2)`` and no padding is computed; with sdpa/eager transformers builds a dense ``[L, L]`` mask
    (``L = sum(lengths)``), so attention costs ``L^2`` -- on CPU the tiny policy ran 2-2.5x slower packed
    than padded with length-sorted micro-batches (hence ``train.packing`` defaults to False).
    """
    from training.kernels import masked_logprobs  # kernel or reference, by device and switch

    backbone, weight = backbone_and_head(base_model(model))
    device = weight.device
    N, T = batch.input_ids.shape
    if packed if packed is not None else batch.packed:
        hidden, valid = packed_hidden(backbone, batch, device)  # [P, H], [N, T-1]
        hidden = tempered(hidden, batch.temperature)
        if bool((batch.loss_mask.bool() & ~valid.to(batch.loss_mask.device)).any()):
            raise ValueError("loss_mask is nonzero at a padding target; cannot pack this batch")
        valid = valid.to(device)
        targets = batch.input_ids[:, 1:].to(device)[valid]
        mask = batch.loss_mask.to(device)[valid]
        lp, ent = masked_logprobs(hidden, weight, targets, mask, with_entropy=with_entropy)
        full_lp = lp.new_zeros(N, T - 1).masked_scatter(valid, lp.float())
        full_ent = ent.new_zeros(N, T - 1).masked_scatter(valid, ent.float())
        return full_lp, full_ent
    out = backbone(
        input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), use_cache=False
    )
    hidden = tempered(out.last_hidden_state[:, :-1], batch.temperature)  # [N, T-1, H]
    Tm1, H = hidden.shape[1], hidden.shape[2]
    targets = batch.input_ids[:, 1:].to(device).reshape(-1)
    mask = batch.loss_mask.to(device).reshape(-1)
    lp, ent = masked_logprobs(hidden.reshape(-1, H), weight, targets, mask, with_entropy=with_entropy)
    return lp.float().reshape(N, Tm1), ent.float().reshape(N, Tm1)


class LogprobModule(nn.Module):
    """Wraps a causal LM so one ``forward(batch)`` computes masked log-probs and entropy
    (:func:`policy_logprobs`). FSDP2 shards it as the root unit, so the embedding and LM-head parameters are
    unsharded for exactly the duration of that forward."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def forward(
        self, batch: Any, with_entropy: bool = True, packed: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, entropy)`` ``[N, T-1]`` float32; ``packed=None`` follows ``batch.packed``."""
        return policy_logprobs(self.model, batch, with_entropy, packed)


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on a CUDA device when ``enabled`` (``train.bf16``); a no-op context on the CPU."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# -- scoring and the update ---------------------------------------------------------------------------
def split_micro_batches(batch: Batch, cfg: Any) -> tuple[list[torch.Tensor], list[Batch], int]:
    """The micro-batches :func:`update_policy` runs, in its order: ``(row-index tensors, micro-batches,
    number of real ones)``. Rows are split by ``cfg.micro_batch`` rows and ``cfg.micro_batch_tokens`` tokens
    (a packed budget with ``cfg.packing``, :func:`training.batch.micro_batches`); under torchrun the list is
    padded to the same count on every rank (:func:`training.infra.distributed.pad_micro_batches`; the padding
    repeats the last one and must get zero weight). ``cfg`` is a :class:`training.config.TrainConfig`."""
    idx = micro_batches(batch, cfg.micro_batch, cfg.micro_batch_tokens, packed=cfg.packing)
    idx, n_real = pad_micro_batches(idx)
    return idx, [batch.select(i, packed=cfg.packing) for i in idx], n_real


@torch.no_grad()
def score_logprobs(module: Any, ref_model: Any | None, batch: Batch, cfg: Any) -> None:
    """Set ``batch.old_logprobs`` (the policy before the update) and, with ``ref_model``, ``batch.ref_logprobs``
    (the reference), both ``[N, T-1]`` float32 on the CPU, zero off the loss mask. They are computed on
    :func:`update_policy`'s own micro-batches under its autocast (bf16 on GPU with ``cfg.bf16``), so each
    micro-batch of the update reads back exactly the values it would compute: the first epoch's ratio is 1."""
    fwd = module if isinstance(module, LogprobModule) else LogprobModule(module)
    device = next(fwd.parameters()).device
    idx, micro, _ = split_micro_batches(batch, cfg)
    batch.old_logprobs = torch.zeros_like(batch.loss_mask)
    if ref_model is not None:
        batch.ref_logprobs = torch.zeros_like(batch.loss_mask)
        ref = LogprobModule(ref_model)
    for i, mb in zip(idx, micro, strict=True):
        with autocast(device, cfg.bf16):
            old = fwd(mb, False)[0].detach()
        batch.old_logprobs[i, : old.shape[1]] = old.to(batch.old_logprobs.device)
        if ref_model is not None:
            with autocast(device, cfg.bf16):
                batch.ref_logprobs[i, : old.shape[1]] = ref(mb, False)[0].to(batch.ref_logprobs.device)


def micro_batch_share(mb: Batch, unit: str, totals: dict[str, float]) -> float:
    """A micro-batch's weight in the step's loss: its share of the global policy tokens (``unit ==
    "tokens"``) or of the global rows that hold policy tokens (``"rows"``), so that micro-batches and ranks
    sum to one full-batch step (FSDP averages gradients over ranks, hence the caller's factor ``W``)."""
    mask = mb.loss_mask
    if unit == "tokens":
        return float(mask.sum()) / max(totals["tokens"], 1.0)
    return float((mask.sum(-1) > 0).sum()) / max(totals["rows"], 1.0)


def policy_grads(fwd: LogprobModule, micro: list[Batch], n_real: int, cfg: Any, totals: dict[str, float],
                 loss_scale: float | None, stats: dict[str, float]) -> None:
    """Accumulate the policy loss's gradients over the micro-batches (weighted by
    :func:`micro_batch_share`, padding micro-batches by 0) and its statistics into ``stats``. Raises
    ``FloatingPointError`` on a non-finite loss on one process (under torchrun the NaN reaches every rank
    through the gradient reduction and the caller's norm check catches it on all of them)."""
    from training.kernels import policy_loss

    device = next(fwd.parameters()).device
    W = world()[1]
    unit = LOSS_AGGS.get(cfg.loss_agg).unit
    for j, mb in enumerate(micro):
        with autocast(device, cfg.bf16):
            lp, ent = fwd(mb)
        mask = mb.loss_mask.to(lp.device)
        ref = mb.ref_logprobs.to(lp.device) if mb.ref_logprobs is not None and cfg.kl_mode == "loss" else None
        loss, step_stats = policy_loss(
            lp, mb.old_logprobs.to(lp.device), mb.token_advantages.to(lp.device), mask, loss=cfg.policy_loss,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c, loss_agg=cfg.loss_agg,
            ref_logprobs=ref, kl_coef=cfg.kl_coef, kl_type=cfg.kl_type, entropy=ent,
            entropy_coef=cfg.entropy_coef, loss_scale=loss_scale, options=cfg.options,
            is_weights=mb.is_weights.to(lp.device) if mb.is_weights is not None else None,
        )
        if not torch.isfinite(loss) and W == 1:
            raise FloatingPointError(f"non-finite policy loss ({float(loss)})")
        share = micro_batch_share(mb, unit, totals) if j < n_real else 0.0
        (loss * share * W).backward()
        for k, v in step_stats.items():
            stats[k] = stats.get(k, 0.0) + v * share


def clipped_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` of ``params``, as a plain tensor also for FSDP2's DTensor norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


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
    loss_scale: float | None = None,
) -> dict[str, float]:
    """The policy-loss update(s) on one rollout batch; returns averaged loss statistics (``lr``: the learning
    rate the optimizer steps used, before the scheduler advanced it).

    ``module`` is the policy (a Hugging Face causal LM) or its :class:`LogprobModule` (possibly
    FSDP2-sharded); ``batch.token_advantages`` ``[N, T-1]`` must be set (else ``batch.advantages`` ``[N]`` is
    broadcast). ``batch.old_logprobs`` (and ``batch.ref_logprobs`` for a KL loss) are those of
    :func:`score_logprobs`, computed here when missing (``ref_model`` for the reference). ``cfg`` is a
    :class:`training.config.TrainConfig`; ``loss_scale`` the constant of ``seq-mean-token-sum-norm``. With
    ``ppo_epochs == 1`` the ratio is 1 and the update is the on-policy policy gradient. Micro-batches follow
    ``cfg.micro_batch`` rows and ``cfg.micro_batch_tokens``; each is weighted so that the step equals one
    full-batch step, also across ranks (global token and row counts). A non-finite loss raises
    ``FloatingPointError`` before any parameter moves in its epoch (with ``cfg.ppo_epochs > 1`` the earlier
    epochs' steps stand; a non-finite value loss of PPO's critic too: neither model steps). ``critic`` (PPO,
    with ``batch.returns`` and ``batch.old_values``) is a :class:`training.critic.ValueModel` whose
    gradients :func:`training.critic.critic_grads` adds before either model steps.
    """
    fwd = module if isinstance(module, LogprobModule) else LogprobModule(module)
    if batch.token_advantages is None:
        if batch.advantages is None:
            raise ValueError("update_policy needs batch.token_advantages or batch.advantages")
        batch.token_advantages = to_token_advantages(batch.advantages, batch.loss_mask)
    use_ref = ref_model is not None and cfg.kl_coef > 0 and cfg.kl_mode == "loss"
    if batch.old_logprobs is None or (use_ref and batch.ref_logprobs is None):
        score_logprobs(fwd, ref_model if use_ref else None, batch, cfg)
    _, micro, n_real = split_micro_batches(batch, cfg)
    totals = {"tokens": all_reduce_sum(float(batch.loss_mask.sum())),
              "rows": all_reduce_sum(float((batch.loss_mask.sum(-1) > 0).sum()))}
    use_critic = critic is not None and batch.returns is not None
    stats: dict[str, float] = {}
    for _ in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        try:
            policy_grads(fwd, micro, n_real, cfg, totals, loss_scale, stats)
            grad_norm = clipped_grad_norm([p for p in fwd.parameters() if p.requires_grad], cfg.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise FloatingPointError("non-finite gradient norm")
            if use_critic:  # the value loss's gradients (and its finiteness check) before either model steps
                from training.critic import critic_grads

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
    return {k: v / cfg.ppo_epochs for k, v in stats.items()}
