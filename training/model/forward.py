"""The policy's forward: the log-prob and entropy of every target token at loss-mask positions, through the
fused kernels.

* :func:`policy_logprobs` runs a causal LM on a :class:`training.batch.Batch` and returns ``[N, T-1]``
  log-probs and entropies, tool and prompt tokens compacted away before the LM head
  (:func:`training.model.kernels.masked_logprobs`: the kernel or its reference, by device and switch);
  :class:`LogprobModule` wraps it as the unit FSDP2 shards; :func:`packed_hidden` runs the backbone on
  sequences packed into one row (also the critic's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training.batch import Batch
from training.model.kernels import masked_logprobs
from training.model.lora import base_model


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

        raise ValueError(f"train.optim.packing needs a transformers that detects packed sequences (masking_utils."
                         f"find_packed_sequence_indices: 4.55 has it, 4.51-4.52 do not), installed "
                         f"{transformers.__version__}: without it packed episodes attend to each other; upgrade "
                         "transformers or set train.optim.packing=false")


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
    anyway, see :func:`training.model.kernels.masked_logprobs`). Uses the
    fused CUDA kernel on GPU when built (:mod:`training.model.kernels`), else the PyTorch reference.

    ``packed`` (``None``: ``batch.packed``) packs the rows' real tokens into one ``[1, sum(lengths)]`` row
    with block-diagonal causal attention instead of running the padded ``[N, T]`` (see :func:`packed_hidden`);
    outputs and gradients equal the padded path's within float tolerance (``tests/test_packing.py``). It
    needs right-padded rows and a loss mask that is 0 wherever the target is padding (as :func:`collate`
    builds it); raises ``ValueError`` otherwise. Cost: with flash-attention (varlen) the attention is
    ``sum(n_i^2)`` and no padding is computed; with sdpa/eager transformers builds a dense ``[L, L]`` mask
    (``L = sum(lengths)``), so attention costs ``L^2`` -- on CPU the tiny policy ran 2-2.5x slower packed
    than padded with length-sorted micro-batches (hence ``train.optim.packing`` defaults to False).
    """
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
    """bf16 autocast on a CUDA device when ``enabled`` (``train.optim.bf16``); a no-op context on the CPU."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
