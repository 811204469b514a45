"""The loss mask excludes every tool token: zero gradient at tool positions, non-zero at policy positions."""

import torch

from agent.trajectory import Role
from training.algos.losses import LossConfig, policy_loss, token_logprobs
from training.masking import loss_mask_from_roles


def test_gradient_is_zero_exactly_at_tool_and_prompt_tokens():
    torch.manual_seed(0)
    B, T, V = 2, 12, 17
    roles = torch.tensor([[0, 0, 1, 1, 2, 2, 2, 1, 1, 2, 1, 1],
                          [0, 1, 1, 2, 2, 1, 1, 1, -1, -1, -1, -1]])
    logits = torch.randn(B, T, V, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    mask = loss_mask_from_roles(roles)
    lp, ent = token_logprobs(logits, targets)
    adv = torch.tensor([[1.0], [-0.5]]).expand(B, T) * mask
    loss, _ = policy_loss(lp, lp.detach(), adv, mask, LossConfig(entropy_coef=0.01), entropy=ent)
    loss.backward()
    g = logits.grad.abs().sum(-1)  # [B, T]
    policy = roles == int(Role.POLICY)
    assert torch.all(g[~policy] == 0.0)  # exactly zero, not merely small
    assert torch.all(g[policy] > 0.0)


def test_policy_logprobs_path_matches_full_logits(tiny_llm):
    """The masked LM-head path used in training equals gather(log_softmax(logits)) at policy tokens."""
    from agent.trajectory import Trajectory
    from training.batch import collate
    from training.model.forward import policy_logprobs

    tok = tiny_llm.tokenizer
    t = Trajectory("q", "q")
    t.append(tok.encode("Question: capital?\n"), Role.PROMPT, 0)
    t.append(tok.encode("<search> capital </search>"), Role.POLICY, 1)
    t.append(tok.encode("\n\n<information>Paris</information>\n\n"), Role.TOOL, 1)
    t.append(tok.encode("<answer> Paris </answer>"), Role.POLICY, 2)
    b = collate([t], tok.pad_token_id)
    model = tiny_llm.model
    lp, _ = policy_logprobs(model, b)
    full = model(input_ids=b.input_ids).logits[:, :-1]
    ref, _ = token_logprobs(full, b.input_ids[:, 1:])
    m = b.loss_mask.bool()
    assert m.sum() > 0 and (~m).sum() > 0
    torch.testing.assert_close(lp[m], ref[m], rtol=1e-4, atol=1e-5)
    assert torch.all(lp[~m] == 0)
