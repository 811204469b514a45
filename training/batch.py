"""The one batch type that joins rollout, reward and trainer (as verl's ``DataProto``, much smaller).

:func:`collate` turns trajectories into right-padded tensors; the trainer's phases then fill in what each
computes (old and reference log-probs, the estimator's inputs: critic values, the KL penalty and whatever its
prepare steps compute, then advantages and returns) on the same :class:`Batch`, and :meth:`Batch.select`
cuts micro-batches of all of it at once. :func:`training.model.forward.policy_logprobs`
runs the policy on a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    * ``rewards``: ``[N]`` float32; ``groups``: ``[N]`` int64;
    * ``old_logprobs``, ``ref_logprobs``: optional ``[N, T-1]`` float32: the policy's log-probs before the
      update and the reference model's (:func:`training.model.actor.score_logprobs`);
    * ``rollout_logprobs``: optional ``[N, T-1]`` float32, aligned with ``loss_mask``: the behaviour policy's
      log-probs as the rollout backend reported them when it sampled (:attr:`agent.trajectory.Trajectory.
      logprobs`), NaN in the rows of trajectories without them; ``None`` when no trajectory has them;
    * ``behaviour_logprobs``: optional ``[N, T-1]`` float32: the log-probs of the distribution the batch was
      sampled from when it is not the old policy (REX-RAG's mixture of the policy and its probe policy,
      :func:`training.rollout.rexrag_rollout.rexrag_behaviour_logprobs`): the PPO ratio's denominator in
      their place (:meth:`ratio_logprobs`); ``None``: ``old_logprobs``;
    * ``is_weights``: optional ``[N, T-1]`` float32: the rollout correction's per-token importance weights on
      the policy-gradient term (:func:`training.algos.offpolicy.rollout_correction`);
    * ``token_advantages``, ``returns``, ``old_values``: optional ``[N, T-1]`` float32, aligned with
      ``loss_mask`` (set by the trainer: per-token advantages, PPO value targets and the critic's values);
    * ``kl_tokens``: optional ``[N, T-1]`` float32: the per-token KL to the reference when it is a reward
      penalty (``train.algorithm.kl_mode=reward``; :func:`training.algos.estimators.kl_reward_penalty`);
    * ``prepared``: what an advantage estimator's own prepare steps computed for the whole batch, by name
      (IGPO's ``gold_probs``; :class:`training.algos.estimators.PrepareContext`); :meth:`select` leaves it
      out of micro-batches (the update does not read it);
    * ``packed``: compute strategy for :func:`training.model.forward.policy_logprobs` (set by :meth:`select`):
      run the backbone on the rows' real tokens packed into one row instead of the padded ``[N, T]``. It
      changes no shape: every output stays ``[N, T-1]``; the value model (:mod:`training.model.critic`) packs
      alike;
    * ``temperature``: the rollout's sampling temperature (set by the trainer): the actor forward
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
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    token_advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    kl_tokens: torch.Tensor | None = None
    packed: bool = False
    temperature: float = 1.0
    prepared: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: slice | torch.Tensor, packed: bool | None = None) -> Batch:
        """Rows ``idx`` of every tensor (micro-batching), trimmed to the longest selected row.

        ``packed`` sets the sub-batch's compute strategy (``None`` keeps ``self.packed``)."""
        T = self.input_ids.shape[1]
        sub = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        sub["prepared"] = {}
        if packed is not None:
            sub["packed"] = bool(packed)
        width = int(sub["attention_mask"].sum(-1).max().item()) if len(sub["input_ids"]) else 1
        for k, v in sub.items():
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                sub[k] = v[:, :width] if v.shape[1] == T else v[:, : max(width - 1, 0)]
        return Batch(**sub)

    def ratio_logprobs(self) -> torch.Tensor:
        """``[N, T-1]``: the policy-gradient ratio's denominator, ``behaviour_logprobs`` when set, else
        ``old_logprobs``."""
        return self.behaviour_logprobs if self.behaviour_logprobs is not None else self.old_logprobs

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
    from the right with its roles (hence its loss mask) cut at the same place. The sampled tokens'
    log-probs the backend reported (``Trajectory.logprobs``) become ``rollout_logprobs``, shifted to the
    targets as the loss mask is; rows of trajectories without them are NaN."""
    if not trajs:
        raise ValueError("cannot collate an empty list of trajectories")
    lens = [min(len(t), max_len) if max_len else len(t) for t in trajs]
    T = max(lens)
    N = len(trajs)
    input_ids = torch.full((N, T), pad_id, dtype=torch.long)
    roles = torch.full((N, T), -1, dtype=torch.long)
    turns = torch.zeros((N, T), dtype=torch.long)
    attn = torch.zeros((N, T), dtype=torch.long)
    reported = any(t.logprobs is not None for t in trajs)
    rollout_lp = torch.full((N, T - 1), float("nan")) if reported else None
    for i, (t, n) in enumerate(zip(trajs, lens, strict=True)):
        t.check()
        input_ids[i, :n] = torch.tensor(t.token_ids[:n])
        roles[i, :n] = torch.tensor(t.roles[:n])
        turns[i, :n] = torch.tensor(t.turn_ids[:n])
        attn[i, :n] = 1
        if t.logprobs is not None and n > 1:  # target t+1's log-prob at position t, as the loss mask
            rollout_lp[i, : n - 1] = torch.tensor(t.logprobs[1:n], dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attn,
        roles=roles,
        loss_mask=loss_mask_from_roles(roles[:, 1:]),
        turn_ids=turns,
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        groups=torch.tensor([t.group for t in trajs], dtype=torch.long),
        rollout_logprobs=rollout_lp,
    )
