"""The one batch type that joins rollout, reward and trainer (as verl's ``DataProto``, much smaller).

:func:`collate` turns trajectories into right-padded tensors; :func:`policy_logprobs` runs the policy and
returns the log-probability of every next token at loss-mask positions only (tool and prompt tokens are
compacted away before the LM head, see :func:`training.losses.masked_lm_head_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent.trajectory import Trajectory
from training.masking import loss_mask_from_roles


@dataclass
class Batch:
    """Tensors for ``N`` trajectories of at most ``T`` tokens.

    * ``input_ids``: ``[N, T]`` int64, right-padded with ``pad_id``;
    * ``attention_mask``: ``[N, T]`` int64;
    * ``roles``: ``[N, T]`` int64 (:class:`agent.trajectory.Role`, -1 at padding);
    * ``loss_mask``: ``[N, T-1]`` float32, 1.0 where the *target* token ``t+1`` is a policy token;
    * ``turn_ids``: ``[N, T]`` int64;
    * ``rewards``, ``advantages``: ``[N]`` float32; ``groups``: ``[N]`` int64;
    * ``token_advantages``, ``returns``, ``old_values``: optional ``[N, T-1]`` float32, aligned with
      ``loss_mask`` (set by the trainer: per-token advantages, PPO value targets and values);
    * ``packed``: compute strategy for :func:`policy_logprobs` (set by :meth:`select`): run the backbone on
      the rows' real tokens packed into one row instead of the padded ``[N, T]``. It changes no shape: every
      output stays ``[N, T-1]``. The value model (:mod:`training.critic`) ignores it (padded path);
    * ``temperature``: the rollout's sampling temperature (set by the trainer): :func:`policy_logprobs`
      scores ``softmax(logits / temperature)``, the distribution the tokens were drawn from, so ratios, KL
      and entropy refer to it (as verl divides the logits by the rollout temperature).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    roles: torch.Tensor
    loss_mask: torch.Tensor
    turn_ids: torch.Tensor
    rewards: torch.Tensor
    groups: torch.Tensor
    advantages: torch.Tensor | None = None
    token_advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    packed: bool = False
    temperature: float = 1.0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: slice | torch.Tensor, packed: bool | None = None) -> Batch:
        """Rows ``idx`` of every tensor (micro-batching), trimmed to the longest selected row.

        ``packed`` sets the sub-batch's compute strategy (``None`` keeps ``self.packed``)."""
        T = self.input_ids.shape[1]
        sub = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        if packed is not None:
            sub["packed"] = bool(packed)
        width = int(sub["attention_mask"].sum(-1).max().item()) if len(sub["input_ids"]) else 1
        for k, v in sub.items():
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                sub[k] = v[:, :width] if v.shape[1] == T else v[:, : max(width - 1, 0)]
        return Batch(**sub)

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` int64: real (unpadded) tokens per row."""
        return self.attention_mask.sum(-1)


def micro_batches(
    batch: Batch, max_rows: int, max_tokens: int | None = None, packed: bool = False
) -> list[torch.Tensor]:
    """Split a batch into micro-batches (row-index tensors) by a row cap and a token budget.

    Padded (``packed=False``): rows are sorted by length (longest first) and grouped greedily so that each
    micro-batch's padded size ``rows x longest row`` stays within ``max_tokens``; with :meth:`Batch.select`
    trimming every micro-batch to its own longest row, padding is nearly removed.
    Packed (``packed=True``, for :meth:`Batch.select` ``(idx, packed=True)``): the budget is the *sum* of
    the real lengths per micro-batch (no padding is computed), filled first-fit-decreasing.
    Either way a row longer than the budget goes alone, at most ``max_rows`` rows go together and each index
    tensor is sorted. ``max_tokens=None`` keeps the original order in chunks of ``max_rows``. Raises
    ``ValueError`` for a non-positive cap.
    """
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"micro-batch caps must be positive, got rows={max_rows}, tokens={max_tokens}")
    N = len(batch)
    if max_tokens is None:
        return [torch.arange(i, min(i + max_rows, N)) for i in range(0, N, max_rows)]
    lens = batch.lengths.tolist()
    order = sorted(range(N), key=lambda i: -lens[i])
    if packed:  # first-fit decreasing on the sum of real lengths
        bins: list[list[int]] = []
        used: list[int] = []
        for i in order:
            for b, cur in enumerate(bins):
                if len(cur) < max_rows and used[b] + lens[i] <= max_tokens:
                    cur.append(i)
                    used[b] += lens[i]
                    break
            else:
                bins.append([i])
                used.append(lens[i])
        return [torch.tensor(sorted(b)) for b in bins]
    out, cur, width = [], [], 0
    for i in order:
        w = max(width, lens[i])
        if cur and (len(cur) + 1 > max_rows or (len(cur) + 1) * w > max_tokens):
            out.append(torch.tensor(sorted(cur)))
            cur, w = [], lens[i]
        cur.append(i)
        width = w
    if cur:
        out.append(torch.tensor(sorted(cur)))
    return out


def collate(trajs: list[Trajectory], pad_id: int, max_len: int | None = None) -> Batch:
    """Pad trajectories into a :class:`Batch`. A trajectory longer than ``max_len`` tokens is truncated
    from the right with its roles (hence its loss mask) cut at the same place."""
    if not trajs:
        raise ValueError("cannot collate an empty list of trajectories")
    lens = [min(len(t), max_len) if max_len else len(t) for t in trajs]
    T = max(lens)
    N = len(trajs)
    input_ids = torch.full((N, T), pad_id, dtype=torch.long)
    roles = torch.full((N, T), -1, dtype=torch.long)
    turns = torch.zeros((N, T), dtype=torch.long)
    attn = torch.zeros((N, T), dtype=torch.long)
    for i, (t, n) in enumerate(zip(trajs, lens, strict=True)):
        t.check()
        input_ids[i, :n] = torch.tensor(t.token_ids[:n])
        roles[i, :n] = torch.tensor(t.roles[:n])
        turns[i, :n] = torch.tensor(t.turn_ids[:n])
        attn[i, :n] = 1
    return Batch(
        input_ids=input_ids,
        attention_mask=attn,
        roles=roles,
        loss_mask=loss_mask_from_roles(roles[:, 1:]),
        turn_ids=turns,
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        groups=torch.tensor([t.group for t in trajs], dtype=torch.long),
    )


def _tempered(hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """``hidden / temperature``: the bias-free LM head then gives ``logits / temperature`` (and its gradient)
    with no change to the fused kernel. Raises ``ValueError`` for a temperature <= 0 (greedy rollouts have no
    sampling distribution to score)."""
    if temperature == 1.0:
        return hidden
    if not temperature > 0:
        raise ValueError(f"log-probs need a sampling temperature > 0, got {temperature}")
    return hidden / temperature


def _backbone_and_head(model):
    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("policy_logprobs needs a causal LM with a bias-free linear LM head")
    return backbone, head.weight


def _unwrap(model):
    """The Hugging Face model under a peft wrapper (LoRA layers stay injected and active)."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


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


def _packed_hidden(backbone, batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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
    with block-diagonal causal attention instead of running the padded ``[N, T]`` (see :func:`_packed_hidden`);
    outputs and gradients equal the padded path's within float tolerance (``tests/test_packing.py``). It
    needs right-padded rows and a loss mask that is 0 wherever the target is padding (as :func:`collate`
    builds it); raises ``ValueError`` otherwise. Cost: with flash-attention (varlen) the attention is
    ``sum(n_i^2)`` and no padding is computed; with sdpa/eager transformers builds a dense ``[L, L]`` mask
    (``L = sum(lengths)``), so attention costs ``L^2`` -- on CPU the tiny policy ran 2-2.5x slower packed
    than padded with length-sorted micro-batches (hence ``train.packing`` defaults to False).
    """
    from training.kernels import masked_logprobs  # kernel or reference, by device and switch

    backbone, weight = _backbone_and_head(_unwrap(model))
    device = weight.device
    N, T = batch.input_ids.shape
    if packed if packed is not None else batch.packed:
        hidden, valid = _packed_hidden(backbone, batch, device)  # [P, H], [N, T-1]
        hidden = _tempered(hidden, batch.temperature)
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
    hidden = _tempered(out.last_hidden_state[:, :-1], batch.temperature)  # [N, T-1, H]
    Tm1, H = hidden.shape[1], hidden.shape[2]
    targets = batch.input_ids[:, 1:].to(device).reshape(-1)
    mask = batch.loss_mask.to(device).reshape(-1)
    lp, ent = masked_logprobs(hidden.reshape(-1, H), weight, targets, mask, with_entropy=with_entropy)
    return lp.float().reshape(N, Tm1), ent.float().reshape(N, Tm1)
