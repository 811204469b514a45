"""The value model (critic) for PPO: a scalar value per token position, read at policy tokens only.

Two layouts (``train.algorithm.critic``), as in verl / OpenRLHF:

* ``separate``: a copy of the policy's backbone (initialised from the current policy, as verl initialises
  the critic from the actor) with a linear value head, trained by its own optimizer;
* ``shared``: a value head on the policy's own final hidden states, computed without gradient into the
  policy (a cheap critic: the backbone is shared, the value loss trains the head only).

Under torchrun only ``separate``: it is built from the full policy before that is sharded, then sharded on
its own (:func:`training.model.fsdp.shard_value_model`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from training.batch import Batch
from training.infra.distributed import clipped_grad_norm, world
from training.model.forward import packed_hidden


def _is_sharded(module: nn.Module) -> bool:
    """True when ``module`` holds FSDP2-sharded (DTensor) parameters."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


class ValueModel(nn.Module):
    """``forward(batch) -> values [N, T-1]`` float32: the value of the state before each *target* token
    (aligned with ``batch.loss_mask``), zero where the mask is 0."""

    def __init__(self, policy: Any, shared: bool = False):
        super().__init__()
        backbone = getattr(policy, policy.base_model_prefix)
        if _is_sharded(backbone):
            # separate: FSDP refuses deepcopy; shared: the backbone run outside its root FSDP unit meets a
            # DTensor embedding at the first value forward (after a whole rollout). Neither layout gets its
            # gradients reduced over ranks, so build the critic before sharding and shard it on its own.
            raise ValueError("the value model cannot be built on an FSDP-sharded policy (PPO "
                             "under torchrun): build it before the policy is sharded")
        self.shared = shared
        if shared:
            object.__setattr__(self, "_backbone", backbone)  # not a submodule: not trained or saved here
        else:
            self.backbone = copy.deepcopy(backbone)
        hidden = policy.config.hidden_size
        # float32 (the hidden states are upcast), on the policy's device: forward sends the batch to the head's
        self.head = nn.Linear(hidden, 1, device=next(backbone.parameters()).device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def _body(self) -> nn.Module:
        return self._backbone if self.shared else self.backbone

    def forward(self, batch: Batch) -> torch.Tensor:
        """Values ``[N, T-1]`` float32 of ``batch``; a packed batch (``batch.packed``, ``optim.packing``) runs
        its rows' real tokens as one row, as the policy's log-probs do
        (:func:`training.model.forward.packed_hidden`), with the same values; raises ``ValueError`` for a
        batch that cannot be packed (left padding)."""
        body = self._body()
        device = self.head.weight.device
        ctx = torch.no_grad() if self.shared else torch.enable_grad()
        with ctx:
            if batch.packed:
                hidden, valid = packed_hidden(body, batch, device)  # [P, H] at the positions valid [N, T-1] marks
            else:
                out = body(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                           use_cache=False)  # a KV cache of the whole batch, never read, is [layers, 2, N, T, kv]
                hidden = out.last_hidden_state[:, :-1]
        values = self.head(hidden.float()).squeeze(-1)
        if batch.packed:
            values = values.new_zeros(valid.shape).masked_scatter(valid.to(device), values)
        return values * batch.loss_mask.to(device)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.head.parameters()) if self.shared else list(self.parameters())


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss (Schulman et al., 2017; verl ``compute_value_loss``):
    ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, token-mean over ``mask``. All ``[N, T]``.
    Returns ``(loss, {"vf_loss", "vf_clip_frac"})``."""
    mask = mask.float()
    n = mask.sum().clamp(min=1.0)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    l1 = (values - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(l1, l2) * mask).sum() / n
    return loss, {"vf_loss": float(loss.detach()), "vf_clip_frac": float(((l2 > l1).float() * mask).sum() / n)}


@torch.no_grad()
def critic_values(critic: ValueModel, batch: Batch, idx: list[torch.Tensor], micro: list[Batch]) -> torch.Tensor:
    """The critic's values ``[N, T-1]`` float32 (CPU) of every row, computed on the update's micro-batches
    ``micro`` (rows ``idx``), as the rollout's ``V_old`` for GAE and the clipped value loss."""
    values = torch.zeros_like(batch.loss_mask)
    for i, mb in zip(idx, micro, strict=True):
        v = critic(mb).detach().cpu()
        values[i, : v.shape[1]] = v
    return values


def critic_grads(critic: ValueModel, micro: list[Batch], n_real: int, cfg: Any, total_tokens: float,
                 stats: dict[str, float]) -> None:
    """Accumulate the value loss's gradients over the micro-batches (token-mean over the global policy
    tokens ``total_tokens``, times ``algorithm.vf_coef``), clip them at ``optim.grad_clip`` and add the value
    statistics to ``stats``. Under torchrun every rank runs every (padded, zero-weight) micro-batch, as FSDP2
    needs, and a NaN is caught at the gradient norm, which the reduction makes the same on every rank.
    Raises ``FloatingPointError`` for a non-finite value loss (one process) or gradient norm."""
    W = world()[1]
    vl = vf_norm = torch.zeros(())
    for j, mb in enumerate(micro if W > 1 else micro[:n_real]):
        v = critic(mb)
        vl, vs = value_loss(v, mb.old_values.to(v.device), mb.returns.to(v.device), mb.loss_mask.to(v.device),
                            cfg.algorithm.cliprange_value)
        share = float(mb.loss_mask.sum()) / max(total_tokens, 1.0) if j < n_real else 0.0
        if not torch.isfinite(vl) and W == 1:
            break
        (cfg.algorithm.vf_coef * vl * share * W).backward()
        for k, val in vs.items():
            stats[k] = stats.get(k, 0.0) + val * share
    else:
        vf_norm = clipped_grad_norm(critic.trainable_parameters(), cfg.optim.grad_clip)
    # under torchrun the norm alone decides: a rank's own loss would let the ranks decide apart
    if (W == 1 and not torch.isfinite(vl)) or not torch.isfinite(vf_norm):
        raise FloatingPointError(f"non-finite value loss ({float(vl.detach())}) or value-model gradient norm "
                                 f"({float(vf_norm)})")
