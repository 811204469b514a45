"""Advantage estimators (training.algos.advantages, training.algos.estimators) on hand-computed values: group
statistics, GRPO and its kin with both edges of their parameters, GAE over policy tokens only, IGPO's turn
advantages, turn values folded onto tokens, the search cost, and the registered estimators' wrapping (the KL
penalty, the search cost, an episode split into several sequences). The registered estimators are reached
through one function (:func:`estimate`), so a new estimator interface changes one function here."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from training.algos import advantages as A

S2 = math.sqrt(2.0)


def close(x, want, atol=1e-5):
    torch.testing.assert_close(x.float(), torch.tensor(want, dtype=torch.float32), atol=atol, rtol=0)
    return True


def test_segment_stats():
    mean, std, count = A.segment_stats(torch.tensor([1.0, 3.0, 5.0, 7.0, 0.1]), torch.tensor([4, 4, 9, 9, 2]))
    assert close(mean, [2.0, 2.0, 6.0, 6.0, 0.1]) and close(std, [S2, S2, S2, S2, 0.0])
    assert count.tolist() == [2.0, 2.0, 2.0, 2.0, 1.0]
    mean, std, _ = A.segment_stats(torch.full((3,), 0.1), torch.zeros(3, dtype=torch.long))
    assert (mean == torch.tensor(0.1)).all() and (std == 0).all()  # equal values: exactly their value, std 0


def test_grpo_dr_grpo_rloo_hand_computed():
    r, g = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 7.0]), torch.tensor([0, 0, 0, 1, 1, 2])
    std0 = math.sqrt(1 / 3)  # unbiased std of 1, 0, 0
    want = [(1 - 1 / 3) / std0, -1 / 3 / std0, -1 / 3 / std0, -1 / S2, 1 / S2, 0.0]
    assert close(A.grpo_advantages(r, g, eps=0.0), want, atol=1e-4)
    assert close(A.grpo_advantages(r, g, eps=1.0), [(2 / 3) / (std0 + 1), -1 / 3 / (std0 + 1), -1 / 3 / (std0 + 1),
                                                    -0.5 / (1 / S2 + 1), 0.5 / (1 / S2 + 1), 0.0], atol=1e-4)
    dr = [2 / 3, -1 / 3, -1 / 3, -0.5, 0.5, 0.0]
    assert close(A.grpo_advantages(r, g, norm_std=False), dr) and close(A.dr_grpo_advantages(r, g), dr)
    assert close(A.rloo_advantages(r, g), [1.0, -0.5, -0.5, -1.0, 1.0, 0.0])  # r_i - mean of the others
    assert close(A.grpo_advantages(torch.tensor([3.0, 3.0]), torch.tensor([0, 0])), [0.0, 0.0])


def test_reinforce_pp_and_stratified_grpo():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0])
    std = torch.tensor([1.0, 0.0, 0.0, 3.0]).std().item()
    assert close(A.reinforce_pp_advantages(r, eps=0.0), [(x - 1.0) / std for x in (1, 0, 0, 3)])
    assert close(A.reinforce_pp_advantages(torch.tensor([5.0])), [0.0])
    assert close(A.reinforce_pp_advantages(torch.tensor([2.0, 2.0])), [0.0, 0.0])
    # one group; strata (search calls) 0, 0, 1, 1: SAN within {1, 0} and {0, 3}
    g, s = torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 1, 1])
    san = [1 / S2, -1 / S2, -1 / S2, 1 / S2]
    gn = A.grpo_advantages(r, g).tolist()
    for alpha in (0.0, 0.25, 1.0):
        want = [alpha * a + (1 - alpha) * b for a, b in zip(san, gn, strict=True)]
        assert close(A.stratified_grpo_advantages(r, g, s, alpha=alpha), want, atol=1e-4)
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
            A.stratified_grpo_advantages(r, g, s, alpha=bad)
    # strata of different groups never mix: two groups, each with one trajectory per stratum
    two = A.stratified_grpo_advantages(r, torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 1]), alpha=1.0)
    assert close(two, [0.0, 0.0, 0.0, 0.0])


def test_to_token_advantages_and_last_token_rewards():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    assert close(A.to_token_advantages(torch.tensor([2.0, 3.0, -1.0]), mask),
                 [[0, 2, 2, 0], [0, 0, 0, 0], [-1, 0, -1, -1]])
    assert close(A.last_token_rewards(torch.tensor([2.0, 3.0, -1.0]), mask), [[0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, -1]])


def test_masked_whiten():
    v = torch.tensor([[1.0, 2.0, 99.0], [3.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # masked values 1, 2, 3: mean 2, unbiased var 1
    assert close(A.masked_whiten(v, m, eps=0.0), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert close(A.masked_whiten(v, m, eps=3.0), [[-0.5, 0.0, 0.0], [0.5, 0.0, 0.0]])
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert close(A.masked_whiten(v, one), [[0.0] * 3, [0.0] * 3])  # fewer than 2 entries: zeros
    assert close(A.batch_masked_whiten(v, m, eps=0.0), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


def test_gae_over_policy_tokens_only():
    # policy tokens at 0, 1 and 3 (2 is a tool token); reward 1 on the last; values 0.5, 0.25, (9), 0.75
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25, 9.0, 0.75]])
    m = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    adv, ret = A.gae_advantages(r, v, m, gamma=0.5, lam=0.5, whiten=False)
    d3 = 1.0 - 0.75
    d1 = 0.0 + 0.5 * 0.75 - 0.25
    d0 = 0.0 + 0.5 * 0.25 - 0.5
    a3, a1 = d3, d1 + 0.25 * d3
    a0 = d0 + 0.25 * a1
    assert close(adv, [[a0, a1, 0.0, a3]]) and close(ret, [[a0 + 0.5, a1 + 0.25, 0.0, a3 + 0.75]])
    adv1, _ = A.gae_advantages(r, v, m, gamma=1.0, lam=1.0, whiten=False)
    assert close(adv1, [[0.5, 0.75, 0.0, 0.25]])  # gamma = lam = 1: return minus value
    white, _ = A.gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    assert close(white, A.masked_whiten(adv1, m).tolist())


def test_igpo_turns_to_tokens_and_search_cost():
    # one group, two trajectories: turn rewards [0, 1] and [1, -] (second turn missing)
    tr = torch.tensor([[0.0, 1.0], [1.0, 5.0]])
    valid = torch.tensor([[True, True], [True, False]])
    std = torch.tensor([0.0, 1.0, 1.0]).std().item()
    n = [(0 - 2 / 3) / std, (1 - 2 / 3) / std, (1 - 2 / 3) / std]
    adv = A.igpo_turn_advantages(tr, valid, torch.tensor([0, 0]), gamma=0.5, eps=0.0)
    assert close(adv, [[n[0] + 0.5 * n[1], n[1]], [n[2], 0.0]], atol=1e-4)
    alone = A.igpo_turn_advantages(tr[:1], valid[:1], torch.tensor([3]))
    assert close(alone, [[-1 / S2 + 1 / S2, 1 / S2]], atol=1e-4)  # one trajectory, two valid turns: a group of 2
    # turn values onto tokens: turn 0 (prompt) and turns past K get 0; off-mask 0
    turns = torch.tensor([[0, 1, 1, 2, 3]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]])
    assert close(A.turns_to_tokens(torch.tensor([[10.0, 20.0]]), turns, mask), [[0.0, 10.0, 0.0, 20.0, 0.0]])
    assert close(A.turns_to_tokens(torch.zeros(1, 0), turns, mask), [[0.0] * 5])
    cost = A.search_cost_to_go(torch.tensor([[True, False, True, True]]), torch.tensor([[True, True, True, False]]), 0.5)
    assert close(cost, [[-1.0, -0.5, -0.5, 0.0]])


# -- the registered estimators ----------------------------------------------------------------------------
def traj(group, episode=None, segments=1):
    return SimpleNamespace(group=group, metadata={"episode": episode, "segments": segments} if episode else {},
                           turns=[], num_search_calls=0, question="q", golden_answers=[])


def estimate(name, rewards, groups, mask, trajs, turns=None, is_search=None, kl_tokens=None, **tc):
    """The registered estimator ``name``'s token advantages for a batch described by these tensors."""
    from training.algos.estimators import AdvantageInputs, compute_advantages

    N = mask.shape[0]
    turns = turns if turns is not None else (mask > 0).long()
    is_search = is_search if is_search is not None else torch.zeros(N, 1, dtype=torch.bool)
    inp = AdvantageInputs(rewards=rewards, groups=groups, mask=mask, token_turns=turns,
                          turn_valid=torch.ones_like(is_search), is_search=is_search,
                          search_calls=is_search.long().sum(-1), trajs=trajs, kl_tokens=kl_tokens)
    return compute_advantages(train_config(name, **{"kl_coef": 0.0, "search_cost": 0.0, **tc}), inp)["advantages"]


def train_config(name, options=None, **alg):
    """A train config whose ``train.algorithm`` section runs the registered estimator ``name`` with the
    settings ``alg`` (``kl_coef``, ``search_cost``, ``gamma``, ``lam``) and its options ``options`` (a dict of
    the fields of its registered Options class; its defaults when ``None``, the base Options for an unknown
    name, which :func:`compute_advantages` then rejects)."""
    from training.algos.estimators import ADV_ESTIMATORS
    from training.registry import Options

    cls = ADV_ESTIMATORS.get(name).options if name in ADV_ESTIMATORS else Options
    return SimpleNamespace(algorithm=SimpleNamespace(adv_estimator=name, options=cls(**(options or {})), **alg))


def test_outcome_estimators_broadcast_subtract_the_kl_and_charge_searches():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    trajs = [traj(0), traj(0)]
    assert close(estimate("dr_grpo", r, g, mask, trajs), [[0.5, 0.5], [-0.5, 0.0]])
    assert close(estimate("rloo", r, g, mask, trajs), [[1.0, 1.0], [-1.0, 0.0]])
    # KL penalty per token 0.5 on row 0 (2 tokens: 1.0) at kl_coef 0.5: rewards 0.5, 0 -> Dr. GRPO +-0.25
    kl = torch.tensor([[0.5, 0.5], [0.0, 3.0]])
    assert close(estimate("dr_grpo", r, g, mask, trajs, kl_tokens=kl, kl_coef=0.5), [[0.25, 0.25], [-0.25, 0.0]])
    # a search on turn 1 of row 0 costs 0.25 on that turn's tokens
    searched = torch.tensor([[True], [False]])
    got = estimate("dr_grpo", r, g, mask, trajs, is_search=searched, search_cost=0.25)
    assert close(got, [[0.25, 0.25], [-0.5, 0.0]])


def test_an_episode_split_into_sequences_counts_once():
    mask = torch.ones(3, 1)
    # rows 0 and 1: one episode (reward 1) in two sequences; row 2: another episode (reward 0)
    trajs = [traj(0, "e1", 2), traj(0, "e1", 2), traj(0, "e2", 1)]
    got = estimate("dr_grpo", torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 0]), mask, trajs)
    assert close(got, [[0.5], [0.5], [-0.5]])  # the group mean is (1 + 0) / 2, not (1 + 1 + 0) / 3


def test_unknown_estimator():
    with pytest.raises(ValueError):
        estimate("no_such_estimator", torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1, 1), [traj(0)])


def test_stratified_keys_never_collide_across_groups():
    # groups 0, 1, 0, 1 and strata 0, 0, 1, 1: four (group, stratum) cells of one trajectory each, so SAN is 0
    # everywhere even where a group-minus-stratum key would merge (group 1, stratum 0) with (group 0, stratum 1)
    r = torch.tensor([1.0, 2.0, 5.0, 3.0])
    got = A.stratified_grpo_advantages(r, torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 1]), alpha=1.0)
    assert close(got, [0.0, 0.0, 0.0, 0.0])


def test_turns_to_tokens_with_one_turn_column():
    # K = 1: the prompt (turn 0) and a turn beyond K get 0, never an index past the single column
    got = A.turns_to_tokens(torch.tensor([[7.0]]), torch.tensor([[0, 1, 2, 1]]), torch.ones(1, 4))
    assert got.tolist() == [[0.0, 7.0, 0.0, 7.0]]


def test_ppo_estimator_returns_carry_the_search_cost_and_the_kl_penalty():
    from training.algos.estimators import AdvantageInputs, compute_advantages

    # one row, two searches at 0.25 each: outcome 1 - 0.5 on the last policy token; KL 0.5 * [0.5, 1.0] per token
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    searched = torch.tensor([[True, True]])
    inp = AdvantageInputs(rewards=torch.tensor([1.0]), groups=torch.tensor([0]), mask=mask,
                          token_turns=torch.tensor([[1, 2, 0]]), turn_valid=torch.ones(1, 2, dtype=torch.bool),
                          is_search=searched, search_calls=torch.tensor([2]), trajs=[traj(0)],
                          values=torch.zeros(1, 3), kl_tokens=torch.tensor([[0.5, 1.0, 9.0]]))
    tc = train_config("ppo", kl_coef=0.5, search_cost=0.25, gamma=1.0, lam=1.0)
    out = compute_advantages(tc, inp)
    # token rewards [-0.25, 0.5 - 0.5, 0] -> returns-to-go [-0.25, 0, 0]
    assert close(out["returns"], [[-0.25, 0.0, 0.0]])


def test_igpo_estimator_turn_rewards_rows_of_different_lengths():
    from training.algos.estimators import AdvantageInputs, compute_advantages

    # row 0: two turns (a search, then the answer: reward 1); row 1: one turn (the answer: reward 0)
    # (minus its KL penalty 0.5 * [0.6, 0.4], and the search cost when that turn searched, as row 1's does)
    valid = torch.tensor([[True, True, False], [True, False, False]])
    searched = torch.tensor([[True, False, False], [True, False, False]])
    mask, turns = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]), torch.tensor([[1, 2, 2], [1, 1, 0]])
    inp = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), groups=torch.tensor([0, 0]), mask=mask, token_turns=turns,
                          turn_valid=valid, is_search=searched, search_calls=torch.tensor([1, 1]),
                          trajs=[traj(0), traj(0)], prepared={"gold_probs": [[0.1, 0.4, 0.9], [0.2, 0.5]]},
                          kl_tokens=torch.tensor([[0.2, 0.2, 0.2], [0.4, 0.0, 9.0]]))
    tc = train_config("igpo", options={"ig_coef": 2.0}, kl_coef=0.5, search_cost=0.1, gamma=1.0)
    got = compute_advantages(tc, inp)["advantages"]
    # gains [0.3, 0.5] and [0.3]; 2 * gain - 0.1 per search; each row's last valid turn holds its outcome
    turn_r = torch.tensor([[2 * 0.3 - 0.1, 1.0 - 0.3, 0.0], [0.0 - 0.2 - 0.1, 0.0, 0.0]])
    want = A.turns_to_tokens(A.igpo_turn_advantages(turn_r, valid, inp.groups, 1.0), turns, mask)
    assert close(got, want.tolist())


def test_outcome_turn_rewards_and_registration_defaults():
    from training.algos.estimators import ADV_ESTIMATORS, AdvantageInputs, outcome_turn_rewards

    # the outcome minus 0.5 * KL on each row's last valid turn, -0.25 on every valid search turn
    valid = torch.tensor([[True, True, False], [True, False, False]])
    searched = torch.tensor([[True, True, True], [False, False, False]])  # row 0's third turn does not exist
    inp = AdvantageInputs(rewards=torch.tensor([1.0, 2.0]), groups=torch.tensor([0, 0]), mask=torch.ones(2, 2),
                          token_turns=torch.ones(2, 2, dtype=torch.long), turn_valid=valid, is_search=searched,
                          search_calls=torch.tensor([3, 0]), trajs=[traj(0), traj(0)],
                          kl_tokens=torch.tensor([[0.5, 0.5], [1.0, 1.0]]))
    got = outcome_turn_rewards(inp, SimpleNamespace(search_cost=0.25, kl_coef=0.5))
    assert close(got, [[-0.25, -0.25 + 1.0 - 0.5, 0.0], [2.0 - 1.0, 0.0, 0.0]])
    # registered without groups=True: the estimator needs no group (PPO), with it: it does
    assert not ADV_ESTIMATORS.get("ppo").groups and ADV_ESTIMATORS.get("ppo").critic
    assert ADV_ESTIMATORS.get("gigpo").groups and ADV_ESTIMATORS.get("evidence_igpo").groups
