"""Loss masks: which tokens of a trajectory receive gradient (the policy's own) and which turn each is in.

This is the PyTorch reference (the spec) of the span-mask CUDA kernel in ``cuda/``; the dispatching entry
points that pick kernel or reference live in :mod:`training.model.kernels`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

POLICY_ROLE = 1  # agent.trajectory.Role.POLICY (training must not import agent's runtime; the value is the protocol)


def loss_mask_from_roles(roles: torch.Tensor) -> torch.Tensor:
    """``roles``: ``[B, T]`` integer role ids (0 prompt, 1 policy, 2 tool, -1 padding).

    Returns a ``[B, T]`` float32 mask, 1.0 exactly at policy tokens. As Search-R1's ``info_mask``: tool
    tokens (retrieved documents) are excluded from the loss.
    """
    return (roles == POLICY_ROLE).to(torch.float32)


def span_mask_reference(
    token_ids: torch.Tensor,
    open_ids: Sequence[int],
    close_ids: Sequence[int],
    lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask and turn index from tool-span marker tokens (e.g. ``<information>``/``</information>``).

    Args:
        token_ids: ``[B, T]`` int64, right-padded sequences.
        open_ids / close_ids: token ids that open / close a tool span.
        lengths: ``[B]`` int64, the number of real tokens of each row (the rest is padding).
        prompt_lengths: ``[B]`` int64, leading prompt tokens of each row (masked, turn 0).

    Returns ``(mask [B, T] bool, turn [B, T] int32)``. Semantics, per row, scanning left to right after
    the prompt, with a nesting ``depth`` starting at 0 and ``turn`` starting at 1:

    * an open marker increments ``depth`` (markers are tool tokens: masked);
    * a close marker is masked and decrements ``depth`` (never below 0); when it brings ``depth`` back to 0,
      the next token starts turn ``turn + 1``;
    * any other token is a policy token (mask 1) iff ``depth == 0``;
    * an unclosed span masks everything to the end of the row; a stray close marker is masked and ignored;
    * prompt and padding tokens have mask 0 and turn 0; tool tokens carry the turn they answer.
    """
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids must be [B, T], got {tuple(token_ids.shape)}")
    B, T = token_ids.shape
    opens, closes = {int(i) for i in open_ids}, {int(i) for i in close_ids}
    if opens & closes:
        raise ValueError(f"a token cannot both open and close a span: {sorted(opens & closes)}")
    mask = torch.zeros(B, T, dtype=torch.bool)
    turn = torch.zeros(B, T, dtype=torch.int32)
    ids = token_ids.tolist()
    for b in range(B):
        depth, t_idx = 0, 1
        n, p = int(lengths[b]), int(prompt_lengths[b])
        for t in range(p, min(n, T)):
            tok = ids[b][t]
            turn[b, t] = t_idx
            if tok in opens:
                depth += 1
            elif tok in closes:
                if depth > 0:
                    depth -= 1
                    if depth == 0:
                        t_idx += 1
            elif depth == 0:
                mask[b, t] = True
    return mask, turn
