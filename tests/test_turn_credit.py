"""Turn-level estimators (training.algos.turn_credit) against hand-computed values of their papers'
equations."""

import pytest
import torch

from agent.trajectory import Trajectory, Turn
from training.algos import advantages as A
from training.algos import estimators as E
from training.algos import turn_credit as C
from training.algos.rewards import turn_table
from training.config import TrainConfig


def close(x, y, atol=1e-4):
    torch.testing.assert_close(x.float(), torch.tensor(y, dtype=torch.float32), atol=atol, rtol=0)


def traj(reward: float, observations: list[str], group: int = 0) -> Trajectory:
    """A trajectory searching once per observation, then answering."""
    turns = [Turn(k + 1, f"<search> q{k} </search>", "search", query=f"q{k}", observation=o)
             for k, o in enumerate(observations)]
    turns.append(Turn(len(observations) + 1, "<answer> x </answer>", "answer", answer="x"))
    return Trajectory("q", "q", ["x"], turns=turns, reward=reward, group=group)


# one prompt group: a and b read the same first document D1 and then diverge; c answers after D1; d's first
# search found another document
GROUP = [traj(1.0, ["D1", "D2"]), traj(0.0, ["D1", "D3"]), traj(0.0, ["D1"]), traj(0.0, ["D4"])]


def test_anchor_states_are_observation_histories():
    states = C.anchor_states(GROUP, 3)
    assert states[0] == [(), ("D1",), ("D1", "D2")]
    assert states[2] == [(), ("D1",), None]
    assert states[3] == [(), ("D4",), None]


def test_discounted_turn_returns():
    r = torch.tensor([[0.0, -0.1, 1.0], [2.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    # row 0: R_3 = 1, R_2 = -0.1 + 0.5, R_1 = 0 + 0.5 * 0.4
    close(C.discounted_turn_returns(r, valid, 0.5), [[0.2, 0.4, 1.0], [2.0, 0.0, 0.0]])


def test_gigpo_hand_computed():
    valid, _ = turn_table(GROUP)
    rewards = torch.tensor([t.reward for t in GROUP])
    turn_r = torch.zeros(4, 3)
    turn_r[0, 2], turn_r[1, 2] = 1.0, 0.0  # the outcome on each trajectory's last turn (c, d: turn 2, zero)
    states = C.anchor_states(GROUP, 3)
    groups = torch.zeros(4, dtype=torch.long)
    # episode level (GRPO): rewards [1, 0, 0, 0], mean .25, unbiased std .5 -> [1.5, -.5, -.5, -.5]
    # step level, gamma 1: turn 1 (state ()) all four -> [1.5, -.5, -.5, -.5]; turn 2, state (D1,): a, b, c
    # with returns [1, 0, 0] -> mean 1/3, std sqrt(1/3) -> [1.1547, -.57735, -.57735]; d's (D4,) alone -> 0;
    # turn 3: a and b each alone -> 0
    step = C.gigpo_step_advantages(C.discounted_turn_returns(turn_r, valid, 1.0), valid, groups, states)
    close(step, [[1.5, 1.1547, 0.0], [-0.5, -0.57735, 0.0], [-0.5, -0.57735, 0.0], [-0.5, 0.0, 0.0]])
    adv = C.gigpo_advantages(rewards, groups, turn_r, valid, states, gamma=1.0, omega=1.0)
    close(adv, [[3.0, 2.6547, 1.5], [-1.0, -1.07735, -0.5], [-1.0, -1.07735, 0.0], [-1.0, -0.5, 0.0]])
    adv = C.gigpo_advantages(rewards, groups, turn_r, valid, states, gamma=1.0, omega=0.5)
    close(adv, [[2.25, 2.07735, 1.5], [-0.75, -0.788675, -0.5], [-0.75, -0.788675, 0.0], [-0.75, -0.5, 0.0]])
    # omega 0: GRPO's advantage on every turn
    adv = C.gigpo_advantages(rewards, groups, turn_r, valid, states, omega=0.0)
    close(adv, (A.grpo_advantages(rewards, groups).unsqueeze(-1) * valid.float()).tolist())


def test_gigpo_discount_and_mean_norm():
    # two successes of different lengths from the same first state: with gamma < 1 the shorter one's first
    # turn has the higher return (0.9 vs 0.81), with F_norm = 1 the step advantage is R - mean
    trajs = [traj(1.0, ["D1"]), traj(1.0, ["D2", "D3"])]
    valid, _ = turn_table(trajs)
    turn_r = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    ret = C.discounted_turn_returns(turn_r, valid, 0.9)
    close(ret, [[0.9, 1.0, 0.0], [0.81, 0.9, 1.0]])
    step = C.gigpo_step_advantages(ret, valid, torch.tensor([0, 0]), C.anchor_states(trajs, 3), norm_std=False)
    close(step, [[0.045, 0.0, 0.0], [-0.045, 0.0, 0.0]])


def test_step_groups_never_cross_prompt_groups():
    trajs = [traj(1.0, ["D1"]), traj(0.0, ["D1"]), traj(0.0, ["D1"], 1), traj(1.0, ["D1"], 1)]
    valid, _ = turn_table(trajs)
    turn_r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    step = C.gigpo_step_advantages(turn_r, valid, torch.tensor([0, 0, 1, 1]), C.anchor_states(trajs, 2))
    close(step[:, 1], [0.707107, -0.707107, -0.707107, 0.707107])


def _inputs(trajs: list[Trajectory]) -> E.AdvantageInputs:
    """AdvantageInputs with two policy tokens per turn: token_turns [1, 1, 2, 2, ...]."""
    valid, is_search = turn_table(trajs)
    K = valid.shape[1]
    token_turns = torch.arange(1, K + 1).repeat_interleave(2).expand(len(trajs), 2 * K)
    mask = valid.repeat_interleave(2, dim=1).float()
    return E.AdvantageInputs(rewards=torch.tensor([t.reward for t in trajs]),
                             groups=torch.tensor([t.group for t in trajs]),
                             mask=mask, token_turns=token_turns, turn_valid=valid, is_search=is_search,
                             search_calls=torch.tensor([t.num_search_calls for t in trajs]), trajs=trajs)


def test_registered_gigpo_writes_turn_advantages_on_tokens():
    tc = TrainConfig(algorithm={"adv_estimator": "gigpo", "options": {"omega": 1.0}})
    out = E.compute_advantages(tc, _inputs(GROUP))["advantages"]
    close(out[0], [3.0, 3.0, 2.6547, 2.6547, 1.5, 1.5])
    close(out[3], [-1.0, -1.0, -0.5, -0.5, 0.0, 0.0])
    # a search cost makes the return sum(turn rewards): d (1 search) now beats b (2 searches) by 0.1
    # F_norm = 1 (verl-agent's mean_norm): rewards [1, 0, 0, 0] -> episode [.75, -.25, -.25, -.25]; a's turn 2
    # step group [1, 0, 0] -> 2/3
    tc = TrainConfig(algorithm={"adv_estimator": "gigpo", "options": {"std_norm": False}})
    out = E.compute_advantages(tc, _inputs(GROUP))["advantages"]
    close(out[0], [1.5, 1.5, 0.75 + 2 / 3, 0.75 + 2 / 3, 0.75, 0.75])
    tc = TrainConfig(algorithm={"adv_estimator": "gigpo", "search_cost": 0.1})
    out = E.compute_advantages(tc, _inputs(GROUP))["advantages"]
    assert out[3, 0] > out[1, 0]


def test_gigpo_config():
    assert E.ADV_ESTIMATORS.get("gigpo").groups
    with pytest.raises(ValueError, match="group_size"):
        TrainConfig(algorithm={"adv_estimator": "gigpo"}, rollout={"group_size": 1})
    with pytest.raises(ValueError):
        TrainConfig(algorithm={"adv_estimator": "gigpo", "options": {"omega": -1.0}})


def answered(reward: float, observations: list[str], group: int = 0, question: str = "q") -> Trajectory:
    t = traj(reward, observations, group)
    t.question, t.golden_answers = question, ["Paris"]
    return t


def test_evidence_gain_marks_the_search_that_first_retrieves_the_answer():
    trajs = [answered(1.0, ["Berlin is a city.", "Paris is the capital.", "Paris again."]),
             answered(0.0, ["The Parisian metro."]),  # not the answer as a whole word
             answered(0.0, ["Paris."], question="Is Paris big?")]  # the question holds it already: no gain
    close(C.evidence_gain(trajs, 4), [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])


def test_evidence_igpo_hand_computed():
    # a reads the answer at its second search and answers right; b reads it at once and answers wrong;
    # c never retrieves it. Turn rewards: a [0, 1, 1], b [1, 0], c [0, 0] -> over the group's 7 turns mean 3/7,
    # unbiased std .534522: 1 -> 1.069045, 0 -> -.801784; accumulated from the last turn (gamma 1)
    group = [answered(1.0, ["Berlin is a city.", "Paris is the capital."]), answered(0.0, ["Paris it is."]),
             answered(0.0, ["Nothing here."])]
    out = E.compute_advantages(TrainConfig(algorithm={"adv_estimator": "evidence_igpo"}), _inputs(group))["advantages"]
    close(out[0, ::2], [1.336306, 2.138090, 1.069045])
    close(out[1, ::2], [0.267261, -0.801784, 0.0])
    close(out[2, ::2], [-1.603568, -0.801784, 0.0])
    # the probability-free gain needs no gold-answer forward pass
    entry = E.ADV_ESTIMATORS.get("evidence_igpo")
    assert E.gold_probs not in entry.prepare and entry.groups


def test_gigpo_defaults_are_gamma_1_and_omega_1():
    valid, _ = turn_table(GROUP)
    rewards = torch.tensor([t.reward for t in GROUP])
    turn_r = torch.zeros(4, 3)
    turn_r[0, 2] = 1.0  # only on a's last turn: its earlier turns' returns depend on gamma
    states = C.anchor_states(GROUP, 3)
    groups = torch.zeros(4, dtype=torch.long)
    adv = C.gigpo_advantages(rewards, groups, turn_r, valid, states)
    close(adv, [[3.0, 2.6547, 1.5], [-1.0, -1.07735, -0.5], [-1.0, -1.07735, 0.0], [-1.0, -0.5, 0.0]])
    # rewards on two turns of different depth: the discount changes the step advantages, not just their scale
    turn_r[1, 0] = 0.5
    adv = C.gigpo_advantages(rewards, groups, turn_r, valid, states)
    close(adv, C.gigpo_advantages(rewards, groups, turn_r, valid, states, gamma=1.0, omega=1.0).tolist())
    for gamma in (0.0, 2.0):
        other = C.gigpo_advantages(rewards, groups, turn_r, valid, states, gamma=gamma, omega=1.0)
        assert (other - adv).abs().max() > 0.01, gamma


def test_gigpo_step_advantage_divides_by_std_plus_eps():
    # one step group of two returns 1 and 0: mean .5, unbiased std sqrt(.5); eps .5 -> +-.5 / (.70711 + .5)
    ret = torch.tensor([[1.0], [0.0]])
    valid = torch.ones(2, 1, dtype=torch.bool)
    got = C.gigpo_step_advantages(ret, valid, torch.zeros(2, dtype=torch.long), [[()], [()]], eps=0.5)
    close(got, [[0.414214], [-0.414214]], atol=1e-5)


def _indexed(question: str, turns: list[tuple[int, str]]) -> Trajectory:
    return Trajectory(question, question, ["Paris"], turns=[
        Turn(k, f"<search> q{k} </search>", "search", query=f"q{k}", observation=o) for k, o in turns])


def test_turns_outside_1_to_K_are_ignored_and_turn_K_counts():
    # a turn numbered 0 is not column -1, and a turn numbered K is the last column
    t = _indexed("q", [(0, "Paris z"), (1, "a"), (2, "Paris b")])
    assert C.anchor_states([t], 3) == [[("Paris z",), ("Paris z", "a"), None]]
    close(C.evidence_gain([t], 3), [[0, 1, 0]])
    close(C.evidence_gain([t], 2), [[0, 1]])  # the answer at turn K = 2
    # a trajectory skipped (the question holds the answer) does not stop the next ones
    skipped = _indexed("Is Paris big?", [(1, "Paris")])
    close(C.evidence_gain([skipped, t, _indexed("q", [(1, "Paris")])], 2), [[0, 0], [0, 1], [1, 0]])
