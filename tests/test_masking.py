"""The loss mask's reference (training.masking), token by token: 1 exactly at the policy's own tokens; the span
mask over tool-span markers (nesting, a stray closer, an unclosed span, the prompt and the padding, the turn
each token belongs to); its input checks."""

from __future__ import annotations

import pytest
import torch

from training.masking import POLICY_ROLE, loss_mask_from_roles, span_mask_reference

O, C = 90, 91  # the markers that open and close a tool span


def test_loss_mask_from_roles():
    roles = torch.tensor([[0, 0, 1, 1, 2, 2, 1, -1], [1, 2, 0, -1, -1, -1, -1, -1]])
    mask = loss_mask_from_roles(roles)
    assert mask.dtype == torch.float32 and POLICY_ROLE == 1
    assert mask.tolist() == [[0, 0, 1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0]]


def span(rows, prompt_lengths, lengths=None, opens=(O,), closes=(C,), T=None):
    T = T or max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    lengths = torch.tensor(lengths or [len(r) for r in rows])
    mask, turn = span_mask_reference(ids, opens, closes, lengths, torch.tensor(prompt_lengths))
    assert mask.dtype == torch.bool and turn.dtype == torch.int32 and mask.shape == turn.shape == ids.shape
    return mask.int().tolist(), turn.tolist()


def test_two_turns_with_a_tool_span_between():
    # prompt 1 2 | policy 3 4 | <O> 5 6 </C> | policy 7 8
    mask, turn = span([[1, 2, 3, 4, O, 5, 6, C, 7, 8]], [2])
    assert mask == [[0, 0, 1, 1, 0, 0, 0, 0, 1, 1]]
    assert turn == [[0, 0, 1, 1, 1, 1, 1, 1, 2, 2]]


def test_nested_spans_close_at_depth_zero_only():
    mask, turn = span([[3, O, 5, O, 6, C, 7, C, 8, O, C, 9]], [0])
    assert mask == [[1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1]]
    assert turn == [[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3]]


def test_a_stray_closer_is_masked_and_ignored_an_unclosed_span_masks_to_the_end():
    mask, turn = span([[3, C, 4, O, 5, 6], [C, C, 4]], [0, 0])
    assert mask == [[1, 0, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0]]
    assert turn == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]


def test_prompt_and_padding_are_masked_turn_zero():
    mask, turn = span([[O, 3, 4, 5, 6], [3, 4]], [2, 0], T=5)  # row 0: the marker lies in the prompt
    assert mask == [[0, 0, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert turn == [[0, 0, 1, 1, 1], [1, 1, 0, 0, 0]]
    mask, turn = span([[3, 4, 5]], [0], lengths=[2])  # the length cuts the row
    assert mask == [[1, 1, 0]] and turn == [[1, 1, 0]]
    mask, turn = span([[3, 4, 5]], [0], lengths=[7])  # a length past T is T
    assert mask == [[1, 1, 1]]
    mask, turn = span([[3, 4, 5]], [3])  # all prompt
    assert mask == [[0, 0, 0]] and turn == [[0, 0, 0]]


def test_several_markers_of_each_kind():
    mask, turn = span([[3, 80, 5, C, 4, O, 6, 81, 7]], [0], opens=(O, 80), closes=(C, 81))
    assert mask == [[1, 0, 0, 0, 1, 0, 0, 0, 1]]
    assert turn == [[1, 1, 1, 1, 2, 2, 2, 2, 3]]


def test_bad_input():
    with pytest.raises(ValueError, match=r"token_ids must be \[B, T\], got \(3,\)"):
        span_mask_reference(torch.tensor([1, 2, 3]), [O], [C], torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"token_ids must be \[B, T\], got \(1, 1, 1\)"):
        span_mask_reference(torch.ones(1, 1, 1, dtype=torch.long), [O], [C], torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"a token cannot both open and close a span: \[90\]"):
        span_mask_reference(torch.tensor([[1]]), [O], [O, C], torch.tensor([1]), torch.tensor([0]))
