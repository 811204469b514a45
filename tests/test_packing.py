"""Sequence packing in the log-prob forward (training.batch): packed == padded, no cross-sequence leakage.

Packing concatenates a micro-batch's real tokens into one row with position ids restarting per sequence;
transformers' masking_utils turns that into a block-diagonal causal mask. These tests pin log-probs,
entropy and gradients of the packed path to the padded path on a tiny Qwen2 policy, for sdpa and eager.
"""

from __future__ import annotations

import pytest
import torch

from agent.trajectory import Role, Trajectory
from training.algos.advantages import to_token_advantages
from training.batch import Batch, collate, micro_batches
from training.model.forward import policy_logprobs

LENGTHS = [23, 9, 1, 2, 16, 5]


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    """A 2-layer tiny Qwen2 (fixture tokenizer) in float32, deterministic."""
    from transformers import AutoTokenizer

    from sleuth.config import TinyPolicyConfig
    from training.model.tiny import build_tiny_policy

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(tiny_policy_dir))
    cfg = TinyPolicyConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    return build_tiny_policy(tok, cfg, seed=1).float().eval(), tok


def trajectory(n: int, seed: int, vocab: int) -> Trajectory:
    """``n`` random tokens: a prompt, then alternating policy/tool spans (so the loss mask has holes)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n,), generator=g).tolist()
    t = Trajectory(f"q{seed}", "q")
    p = min(3, n)
    t.append(ids[:p], Role.PROMPT, 0)
    pos, k = p, 0
    while pos < n:
        span = ids[pos : pos + 4]
        t.append(span, Role.POLICY if k % 2 == 0 else Role.TOOL, 1 + k // 2)
        pos, k = pos + len(span), k + 1
    return t


def make_batch(tok, lengths=LENGTHS, max_len=None) -> Batch:
    return collate([trajectory(n, i, len(tok)) for i, n in enumerate(lengths)], tok.pad_token_id, max_len)


def grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_padded_logprobs_entropy_and_grads(policy, attn):
    model, tok = policy
    model.set_attn_implementation(attn)
    try:
        b = make_batch(tok)
        assert b.loss_mask.sum() > 10
        w = torch.randn(b.loss_mask.shape, generator=torch.Generator().manual_seed(0))
        out = {}
        for packed in (False, True):
            model.zero_grad(set_to_none=True)
            lp, ent = policy_logprobs(model, b, packed=packed)
            ((lp * w).sum() + (ent * w.flip(-1)).sum()).backward()
            out[packed] = (lp.detach(), ent.detach(), grads(model))
        (lp0, e0, g0), (lp1, e1, g1) = out[False], out[True]
        assert lp1.shape == e1.shape == b.loss_mask.shape and lp1.dtype == torch.float32
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-5)
        assert torch.all(lp1[b.loss_mask == 0] == 0) and torch.all(lp1[b.loss_mask == 1] < 0)
        assert g0.keys() == g1.keys() and len(g0) > 5
        for k in g0:
            assert g0[k].abs().sum() > 0, k
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6)
    finally:
        model.set_attn_implementation("sdpa")


def test_block_diagonal_mask_is_what_makes_packing_exact(policy, monkeypatch):
    """Without transformers' packed-sequence detection, later sequences would attend to earlier ones."""
    import transformers.masking_utils as mu

    model, tok = policy
    b = make_batch(tok)
    with torch.no_grad():
        ref, _ = policy_logprobs(model, b)
        monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)
        leaky, _ = policy_logprobs(model, b, packed=True)
    # the first row sees nothing before it either way; every later row with policy targets is corrupted
    torch.testing.assert_close(leaky[0], ref[0], rtol=1e-5, atol=1e-5)
    assert (leaky[1:] - ref[1:]).abs().max() > 1e-3


def test_packing_refuses_a_transformers_without_packed_sequence_detection(policy, monkeypatch):
    """transformers 4.51-4.52 (which pyproject allows) have no masking_utils: the packed row would get one plain
    causal mask and every episode would attend to the ones packed before it. That must be an error, not a
    silently wrong loss."""
    import sys

    model, tok = policy
    b = make_batch(tok)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)  # import fails, as on 4.52
    with pytest.raises(ValueError, match="train.optim.packing"):
        policy_logprobs(model, b, packed=True)
    policy_logprobs(model, b)  # the padded path does not need it


def test_each_packed_row_equals_that_row_alone(policy):
    """No attention or target crosses a sequence boundary: row i of the packed result == row i run alone."""
    model, tok = policy
    b = make_batch(tok)
    b.loss_mask = b.attention_mask[:, 1:].float()  # every real target, including each sequence's last one
    with torch.no_grad():
        lp, ent = policy_logprobs(model, b.select(slice(None), packed=True))
        for i in range(len(b)):
            one = b.select(slice(i, i + 1))  # trimmed to its own length: no padding at all
            lpi, enti = policy_logprobs(model, one)
            n = int(b.lengths[i]) - 1
            torch.testing.assert_close(lp[i, :n], lpi[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent[i, :n], enti[0], rtol=1e-5, atol=1e-5)
            assert torch.all(lp[i, n:] == 0) and torch.all(ent[i, n:] == 0)


def test_packing_rejects_a_mask_on_padding_targets_and_left_padding(policy):
    model, tok = policy
    b = make_batch(tok)
    bad = b.select(slice(None))
    bad.loss_mask = bad.loss_mask.clone()
    bad.loss_mask[2, -1] = 1.0  # row 2 has 1 token: its targets are all padding
    with pytest.raises(ValueError, match="padding target"):
        policy_logprobs(model, bad, packed=True)
    left = b.select(slice(None))
    left.attention_mask = left.attention_mask.flip(-1)
    with pytest.raises(ValueError, match="right-padded"):
        policy_logprobs(model, left, packed=True)


def test_truncated_trajectory_keeps_its_mask_through_packing(policy):
    """A trajectory longer than the context budget is cut with its loss mask; packing computes the same."""
    model, tok = policy
    max_len = 12
    b = make_batch(tok, lengths=[30, 7, 12], max_len=max_len)
    full = make_batch(tok, lengths=[30, 7, 12])
    assert b.input_ids.shape[1] == max_len and b.lengths.tolist() == [12, 7, 12]
    torch.testing.assert_close(b.loss_mask[0], full.loss_mask[0, : max_len - 1])
    with torch.no_grad():
        lp_pad, _ = policy_logprobs(model, b)
        lp_pack, _ = policy_logprobs(model, b.select(slice(None), packed=True))
    torch.testing.assert_close(lp_pack, lp_pad, rtol=1e-5, atol=1e-5)
    assert torch.equal(lp_pack != 0, b.loss_mask.bool())


def test_with_entropy_false_returns_zero_entropy_and_the_same_logprobs(policy):
    from training.algos.losses import masked_lm_head_logprobs

    model, tok = policy
    b = make_batch(tok)
    for packed in (False, True):
        with torch.no_grad():
            lp, ent = policy_logprobs(model, b, with_entropy=True, packed=packed)
            lp0, ent0 = policy_logprobs(model, b, with_entropy=False, packed=packed)
        assert ent.abs().sum() > 0
        assert ent0.shape == lp0.shape == lp.shape and ent0.dtype == torch.float32 and torch.all(ent0 == 0)
        torch.testing.assert_close(lp0, lp, rtol=0, atol=1e-6)
    # the reference itself: same log-probs and gradients, zero (constant) entropy
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 37, (20,), generator=g)
    mask = torch.rand(20, generator=g) > 0.3
    lp, _ = masked_lm_head_logprobs(h, W, tgt, mask, chunk_size=10)
    dh, dW = torch.autograd.grad(lp.sum(), (h, W))
    lp0, ent0 = masked_lm_head_logprobs(h, W, tgt, mask, chunk_size=10, with_entropy=False)
    dh0, dW0 = torch.autograd.grad(lp0.sum(), (h, W))
    assert torch.all(ent0 == 0) and not ent0.requires_grad
    torch.testing.assert_close(lp0, lp)
    torch.testing.assert_close(dh0, dh)
    torch.testing.assert_close(dW0, dW)


def test_micro_batches_packed_budget_is_the_sum_of_real_lengths(policy):
    _, tok = policy
    lengths = [40, 3, 3, 3, 3, 35, 5, 2, 20, 50, 1]
    b = make_batch(tok, lengths=lengths)
    budget = 48
    parts = micro_batches(b, 4, budget, packed=True)
    assert sorted(torch.cat(parts).tolist()) == list(range(len(lengths)))
    for p in parts:
        assert p.tolist() == sorted(p.tolist()) and len(p) <= 4
        s = sum(lengths[i] for i in p.tolist())
        assert s <= budget or len(p) == 1  # the 50-token row goes alone
    padded = micro_batches(b, 4, budget)
    for p in padded:
        assert len(p) * max(lengths[i] for i in p.tolist()) <= budget or len(p) == 1
    assert len(parts) < len(padded)  # packing fits more rows in the same compute budget
    assert sum(len(p) for p in micro_batches(b, 4, budget, packed=True)) == len(lengths)
    # no budget: original order in chunks of max_rows, both modes
    assert [p.tolist() for p in micro_batches(b, 4, None, packed=True)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10],
    ]
    with pytest.raises(ValueError):
        micro_batches(b, 4, 0, packed=True)


def test_select_carries_the_flag_and_logprob_module_follows_it(policy):
    from training.model.forward import LogprobModule

    model, tok = policy
    b = make_batch(tok)
    sub = b.select(torch.tensor([0, 3, 5]), packed=True)
    assert sub.packed and not b.packed and sub.select(slice(0, 2)).packed
    assert not sub.select(slice(0, 2), packed=False).packed
    assert sub.input_ids.shape[1] == max(LENGTHS[i] for i in (0, 3, 5))
    with torch.no_grad():
        lp, _ = LogprobModule(model)(sub, False)
        lp_pad, _ = LogprobModule(model)(sub, False, packed=False)
    torch.testing.assert_close(lp, lp_pad, rtol=1e-5, atol=1e-5)


def test_update_policy_with_packing_equals_padded(policy):
    """One PPO step with train.optim.packing (token-budget micro-batches, packed forward) == the padded step."""
    import copy

    from sleuth.config import TrainConfig
    from training.model.actor import update_policy

    model, tok = policy
    states = []
    for packing in (False, True):
        m = copy.deepcopy(model)
        b = make_batch(tok)
        b.token_advantages = to_token_advantages(torch.linspace(-1, 1, len(b)), b.loss_mask)
        tc = TrainConfig(optim={"micro_batch": 3, "micro_batch_tokens": 30, "packing": packing, "grad_clip": 1e9,
                                "bf16": False}, algorithm={"entropy_coeff": 0.01})
        update_policy(m, None, torch.optim.SGD(m.parameters(), lr=0.5), b, tc)
        states.append(m.state_dict())
    moved = sum(float((states[0][k] - model.state_dict()[k]).abs().sum()) for k in states[0])
    assert moved > 0
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_logprobs_are_of_the_rollout_temperature(policy, packed):
    """With ``batch.temperature`` T (the rollout's sampling temperature), log-probs and entropy are those of
    ``softmax(logits / T)``, the distribution the tokens were drawn from (verl divides the logits by the
    rollout temperature), on the padded and the packed path alike."""
    import dataclasses

    model, tok = policy
    b = dataclasses.replace(make_batch(tok), temperature=0.7)
    lp, ent = policy_logprobs(model, b, packed=packed)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float() / 0.7
    ref = torch.log_softmax(logits, -1)
    want_lp = ref.gather(-1, b.input_ids[:, 1:, None])[..., 0]
    want_ent = -(ref.exp() * ref).sum(-1)
    m = b.loss_mask.bool()
    torch.testing.assert_close(lp[m], want_lp[m], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent[m], want_ent[m], rtol=1e-4, atol=1e-5)
    assert b.select(slice(0, 2)).temperature == 0.7  # micro-batches keep it


@pytest.mark.parametrize("shared", [False, True])
def test_the_critic_follows_packing_with_the_same_values_and_grads(policy, shared, monkeypatch):
    """PPO's value model runs a packed micro-batch packed too: the same values and gradients as padded, and
    the backbone sees one [1, sum(lengths)] row, not the padded [N, T] (a packed micro-batch is budgeted on
    the sum of real lengths, so its padded form may be many times train.optim.micro_batch_tokens)."""
    from training.model.critic import ValueModel

    model, tok = policy
    critic = ValueModel(model, shared=shared)
    with torch.no_grad():
        critic.head.weight.normal_(generator=torch.Generator().manual_seed(2))
    b = make_batch(tok)
    w = torch.randn(b.loss_mask.shape, generator=torch.Generator().manual_seed(3))
    seen, out = [], {}
    body = critic._body()
    monkeypatch.setattr(body, "forward", lambda *a, _f=body.forward, **k: seen.append(k["input_ids"].shape) or _f(*a, **k))
    for packed in (False, True):
        critic.zero_grad(set_to_none=True)
        v = critic(b.select(torch.arange(len(b)), packed=packed))
        (v * w).sum().backward()
        out[packed] = (v.detach(), grads(critic))
    assert seen == [b.input_ids.shape, torch.Size([1, int(b.attention_mask.sum())])]
    (v0, g0), (v1, g1) = out[False], out[True]
    assert v1.shape == b.loss_mask.shape and torch.all(v1[b.loss_mask == 0] == 0) and v0.abs().sum() > 0
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) >= 2
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6)
