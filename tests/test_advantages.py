"""Every advantage estimator against hand-computed values on a small batch, incl. an all-equal group and a
batch of one trajectory; plus the config check that rejects PPO without a critic."""

from types import SimpleNamespace

import pytest
import torch

from training.algos import advantages as A
from training.algos import estimators as E
from training.config import TrainConfig

# group 0: four samples, rewards vary; group 1: all equal; group 2: a single trajectory
R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5])
G = torch.tensor([0, 0, 0, 0, 1, 1, 2])


def close(x, y, atol=1e-5):
    torch.testing.assert_close(x.float(), torch.tensor(y, dtype=torch.float32), atol=atol, rtol=0)


def test_grpo_hand_computed():
    # group 0: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.866025
    close(A.grpo_advantages(R, G), [0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.0])


def test_dr_grpo_no_std():
    close(A.dr_grpo_advantages(R, G), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])


def test_rloo_leave_one_out():
    # r=1: others [0, 0, 1] -> 1 - 1/3; r=0: others [1, 0, 1] -> 0 - 2/3
    close(A.rloo_advantages(R, G), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0])


def test_reinforce_pp_global_normalisation():
    # batch mean 4.5/7 = 0.642857, unbiased std 0.475595
    close(A.reinforce_pp_advantages(R, G), [0.750939, -1.351690, -1.351690, 0.750939, 0.750939, 0.750939, -0.300376])


def test_stratified_grpo_blend():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0])
    s = torch.tensor([1, 1, 2, 2])  # search calls
    # SAN: stratum 1 [1, 0] -> +-0.707107, stratum 2 [1, 1] -> 0; global: mean .75, std .5 -> .5, -1.5
    close(A.stratified_grpo_advantages(r, g, s, alpha=0.5), [0.603553, -1.103553, 0.25, 0.25])
    close(A.stratified_grpo_advantages(r, g, s, alpha=1.0), [0.707107, -0.707107, 0.0, 0.0])
    close(A.stratified_grpo_advantages(r, g, s, alpha=0.0), A.grpo_advantages(r, g).tolist())
    with pytest.raises(ValueError):
        A.stratified_grpo_advantages(r, g, s, alpha=1.5)


def test_strata_do_not_mix_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    s = torch.tensor([1, 1, 1, 1])  # same search count but different prompts: separate strata
    close(A.stratified_grpo_advantages(r, g, s, alpha=1.0), [0.707107, -0.707107, -0.707107, 0.707107])


OUTCOME = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "stratified_grpo"]
TC = TrainConfig()


def outcome(name: str, rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor,
            tc: TrainConfig = TC) -> torch.Tensor:
    """``[N]`` advantages of the registered estimator ``name`` through the trainer's path
    (:func:`training.algos.estimators.compute_advantages`), each trajectory one policy token long."""
    n = len(rewards)
    inp = E.AdvantageInputs(rewards=rewards.float(), groups=groups, mask=torch.ones(n, 1),
                            token_turns=torch.ones(n, 1, dtype=torch.long),
                            turn_valid=torch.ones(n, 1, dtype=torch.bool),
                            is_search=torch.zeros(n, 1, dtype=torch.bool), search_calls=search_calls,
                            trajs=[SimpleNamespace(group=int(g), metadata={}) for g in groups])
    return E.compute_advantages(tc.updated({"algorithm.adv_estimator": name}), inp)["advantages"][:, 0]


def test_the_built_in_estimators_are_registered():
    # in this order (a plugin test of the session may have registered more after them)
    assert list(E.ADV_ESTIMATORS)[:9] == [*OUTCOME, "ppo", "igpo", "gigpo", "evidence_igpo"]
    assert E.ADV_ESTIMATORS.get("ppo").critic and not E.ADV_ESTIMATORS.get("grpo").critic
    assert E.gold_probs in E.ADV_ESTIMATORS.get("igpo").prepare and E.ADV_ESTIMATORS.get("igpo").groups
    assert E.ADV_ESTIMATORS.get("ppo").prepare == (E.kl_reward_penalty, E.critic_values)
    assert E.ADV_ESTIMATORS.get("grpo").prepare == (E.kl_reward_penalty,)
    assert not E.ADV_ESTIMATORS.get("reinforce_pp").groups


@pytest.mark.parametrize("name", OUTCOME)
def test_all_equal_group_and_single_trajectory_give_zero(name):
    eq = outcome(name, torch.tensor([0.3, 0.3, 0.3]), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 1]), TC)
    close(eq, [0.0, 0.0, 0.0])
    one = outcome(name, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([2]), TC)
    close(one, [0.0])
    assert torch.isfinite(one).all()


@pytest.mark.parametrize("name", OUTCOME)
@pytest.mark.parametrize("value", [0.7, 0.1, 0.3, 0.9, 2.2])
@pytest.mark.parametrize("n", [3, 7, 12])
def test_all_equal_rewards_give_exactly_zero_whatever_the_value(name, value, n):
    """A float32 mean of equal rewards is not always the reward itself (0.7 * 7 / 7 != 0.7): the rounding left in
    ``r - mean`` was divided by ``std + eps`` with ``std`` of the same tiny size, giving every member of a
    flat group the same advantage (up to 0.19) instead of 0."""
    r = torch.full((n,), value)
    adv = outcome(name, r, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), TC)
    assert torch.equal(adv, torch.zeros(n)), adv
    # a flat group next to a varying one stays exactly 0, and the varying one is unchanged
    r2 = torch.cat([r, torch.tensor([0.0, 1.0])])
    g2 = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(2, dtype=torch.long)])
    adv2 = outcome(name, r2, g2, torch.zeros(n + 2, dtype=torch.long), TC)
    if name != "reinforce_pp":  # batch-level: the flat group is not flat in the batch
        assert torch.equal(adv2[:n], torch.zeros(n))
    k = (A.igpo_turn_advantages(torch.full((n, 2), value), torch.ones(n, 2, dtype=torch.bool),
                                torch.zeros(n, dtype=torch.long)))
    assert torch.equal(k, torch.zeros(n, 2))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        outcome("nope", R, G, G)
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        E.ADV_ESTIMATORS.get("grpp")
    with pytest.raises(ValueError, match="ppo needs critic values"):  # its prepare step did not run
        outcome("ppo", R, G, G, TC.updated({"algorithm.critic": "separate"}))


def test_gae_over_policy_tokens_only():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])  # position 3 is a tool token
    values = torch.tensor([[0.0, 0.2, 0.4, 9.0, 0.6]])  # the tool position's value is never used
    rew = A.last_token_rewards(torch.tensor([1.0]), mask)
    close(rew, [[0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, ret = A.gae_advantages(rew, values, mask, gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.0, 0.8, 0.6, 0.0, 0.4]])  # R - V_t
    close(ret, [[0.0, 1.0, 1.0, 0.0, 1.0]])
    adv, _ = A.gae_advantages(rew, values, mask, gamma=0.5, lam=0.5, whiten=False)
    # t=4: 1-.6=.4; t=2: .5*.6-.4=-.1 + .25*.4 = 0; t=1: .5*.4-.2 = 0 + .25*0 = 0
    close(adv, [[0.0, 0.0, 0.0, 0.0, 0.4]])
    white, _ = A.gae_advantages(rew, values, mask, gamma=1.0, lam=1.0, whiten=True)
    # [.8, .6, .4] whitened: mean .6, unbiased std .2 -> [1, 0, -1]
    close(white, [[0.0, 1.0, 0.0, 0.0, -1.0]], atol=1e-3)


def test_gae_single_token_batch():
    mask = torch.tensor([[0.0, 1.0]])
    adv, ret = A.gae_advantages(A.last_token_rewards(torch.tensor([2.0]), mask), torch.tensor([[0.0, 0.5]]), mask)
    close(adv, [[0.0, 0.0]])  # whitening one token gives 0, never NaN
    close(ret, [[0.0, 2.0]])


def test_igpo_turn_advantages():
    turn_r = torch.tensor([[0.2, 1.0], [0.0, 7.0]])
    valid = torch.tensor([[True, True], [True, False]])
    # valid rewards [.2, 1, 0]: mean .4, unbiased std .52915 -> [-.377964, 1.133893, -.755929]
    adv = A.igpo_turn_advantages(turn_r, valid, torch.tensor([0, 0]), gamma=1.0)
    close(adv, [[0.755929, 1.133893], [-0.755929, 0.0]])
    adv = A.igpo_turn_advantages(turn_r, valid, torch.tensor([0, 0]), gamma=0.5)
    close(adv, [[-0.377964 + 0.5 * 1.133893, 1.133893], [-0.755929, 0.0]])
    # a group of one trajectory with one turn: nothing to compare with -> 0
    close(A.igpo_turn_advantages(torch.tensor([[1.0]]), torch.tensor([[True]]), torch.tensor([0])), [[0.0]])


def test_turns_to_tokens_and_search_cost():
    turn_vals = torch.tensor([[1.0, 2.0, 3.0]])
    token_turns = torch.tensor([[0, 1, 1, 2, 2, 3, 4]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]])
    close(A.turns_to_tokens(turn_vals, token_turns, mask), [[0.0, 1.0, 0.0, 2.0, 2.0, 3.0, 0.0]])
    cost = A.search_cost_to_go(torch.tensor([[True, True, False]]), torch.tensor([[True, True, True]]), 0.1)
    close(cost, [[-0.2, -0.1, 0.0]])


def test_config_rejects_critic_estimator_without_critic():
    from sleuth.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs a value model"):
        load_config(None, ["train.algorithm.adv_estimator=ppo"])
    assert load_config(None, ["train.algorithm.adv_estimator=ppo", "train.algorithm.critic=separate"]).train.algorithm.critic == "separate"
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["train.algorithm.adv_estimator=grpo", "train.rollout.group_size=1"])
    assert load_config(None, ["train.algorithm.adv_estimator=reinforce_pp", "train.rollout.group_size=1"]).train.rollout.group_size == 1


@pytest.mark.parametrize("name", ["reinforce_pp", "stratified_grpo", "grpo"])
def test_outcome_advantages_under_torchrun_equal_one_process_on_the_whole_batch(name, monkeypatch):
    """REINFORCE++ normalises over the batch and Stratified GRPO blends in batch statistics: on W ranks each
    rank must get its rows of the advantages one process computes on every rank's trajectories (group ids
    are per rank, so they are kept apart), not statistics of its own share. Two ranks simulated."""
    g = torch.Generator().manual_seed(0)
    r = [torch.rand(6, generator=g), torch.rand(4, generator=g) * 3]  # the two ranks' rewards: other scales
    groups = [torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 0, 1, 1])]
    strata = [torch.tensor([0, 1, 2, 0, 1, 1]), torch.tensor([2, 2, 0, 1])]
    whole = outcome(name, torch.cat(r), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3]), torch.cat(strata))
    for rank in (0, 1):
        parts = [(r[i].tolist(), groups[i].tolist(), strata[i].tolist()) for i in (0, 1)]
        monkeypatch.setattr(E, "world", lambda rank=rank: (rank, 2))
        monkeypatch.setattr(E, "gather_objects", lambda obj, parts=parts: parts)
        got = outcome(name, r[rank], groups[rank], strata[rank])
        torch.testing.assert_close(got, whole[:6] if rank == 0 else whole[6:])


def test_an_episode_split_into_several_sequences_counts_once_in_its_group():
    """An external agent's episode whose chat template rewrote history becomes several training sequences
    (agent.external.stitch), each with the episode's reward. GRPO compared every sequence as an episode, so a
    split episode weighed as many times as it had sequences: here rows (1, 1, 0) gave (0.58, 0.58, -1.15)."""
    from agent.trajectory import Trajectory

    def traj(ep, segments):
        return Trajectory(question_id="q", question="x", group=0,
                          metadata={"episode": ep, "segment": 0, "segments": segments})

    trajs = [traj("a", 2), traj("a", 2), traj("b", 1)]
    inp = E.AdvantageInputs(rewards=torch.tensor([1.0, 1.0, 0.0]), groups=torch.zeros(3, dtype=torch.long),
                            mask=torch.ones(3, 2), token_turns=torch.ones(3, 2, dtype=torch.long),
                            turn_valid=torch.ones(3, 1, dtype=torch.bool), is_search=torch.zeros(3, 1, dtype=torch.bool),
                            search_calls=torch.tensor([1, 0, 0]), trajs=trajs)
    adv = E.compute_advantages(TC, inp)["advantages"][:, 0]
    # two episodes with rewards 1 and 0: GRPO gives +-(0.5 / 0.7071)
    close(adv, [0.707107, 0.707107, -0.707107])
    assert E.episode_rows([traj("a", 1), traj("b", 1)]) is None
