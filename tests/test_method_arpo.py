"""ARPO's entropy-based adaptive rollout and advantage attribution (training.algos.arpo) on hand-computed cases."""

import math

import pytest
import torch

from agent.trajectory import Role, Trajectory
from training.algos import arpo as A


def close(x, y, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(x).float(), torch.tensor(y, dtype=torch.float32), atol=atol, rtol=0)


class Draws:
    """A stand-in for random.Random whose random() returns the given values in order."""

    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def test_options_defaults_follow_the_deep_search_script():
    o = A.arpo_options()
    assert (o.group_size, o.global_samples, o.branches, o.branch_prob, o.entropy_weight, o.entropy_window) == (
        16, 8, 1, 0.5, 0.2, 20)
    assert o.attribution == "soft" and o.branch_budget == 8


@pytest.mark.parametrize("values, match", [
    ({"group_size": 4, "global_samples": 5}, "global samples N=5 must lie in \\[1, M=4\\]"),
    ({"global_samples": 0}, "larger than the group"),
    ({"branches": 0}, "Z must be >= 1"),
    ({"branch_prob": 1.5}, "branch_prob"),
    ({"branch_prob": -0.1}, "branch_prob"),
    ({"entropy_weight": -1.0}, "entropy_weight"),
    ({"entropy_window": 0}, "entropy_window"),
    ({"attribution": "medium"}, "attribution"),
    ({"global_sample": 4}, "did you mean 'global_samples'"),
])
def test_options_reject_bad_values_and_unknown_names(values, match):
    with pytest.raises(ValueError, match=match):
        A.arpo_options(values)


def test_options_accept_both_ends_of_each_range():
    assert A.arpo_options({"group_size": 4, "global_samples": 4}).branch_budget == 0
    assert A.arpo_options({"group_size": 4, "global_samples": 1, "branch_prob": 0.0}).branch_budget == 3
    assert A.arpo_options({"branch_prob": 1.0, "entropy_weight": 0.0}).branch_prob == 1.0


def test_token_entropy_of_uniform_and_peaked_distributions():
    close(A.token_entropy(torch.zeros(2, 4)), [math.log(4), math.log(4)])
    close(A.token_entropy(torch.tensor([[100.0, 0.0, 0.0]])), [0.0], atol=1e-4)


def test_topk_entropy_sums_over_the_listed_tokens_only():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.0]]))  # second row: the third was left out
    close(A.topk_entropy(lp), [1.5 * math.log(2), math.log(2)])


def test_window_entropy_sums_the_first_k_tokens_over_log_v():
    close(A.window_entropy([1.0, 2.0, 3.0, 4.0], 3, 100), 6.0 / math.log(100))
    close(A.window_entropy([1.0, 2.0], 20, 100), 3.0 / math.log(100))  # shorter window: all of it
    assert A.window_entropy([], 20, 100) == 0.0
    with pytest.raises(ValueError, match="k=0"):
        A.window_entropy([1.0], 0, 100)
    with pytest.raises(ValueError, match="vocab_size=1"):
        A.window_entropy([1.0], 1, 1)


def test_entropy_changes_after_each_tool_result():
    t = Trajectory("q", "q")
    t.append([1, 2], Role.PROMPT, 0)
    t.append([3, 4, 5], Role.POLICY, 1)  # first window: entropies 1 + 1 (k = 2)
    t.append([6], Role.TOOL, 1)
    t.append([7, 8], Role.POLICY, 2)  # after a tool result: 3 + 2
    t.append([9], Role.POLICY, 3)  # no tool result before turn 3: not a branching step
    ent = [9.0, 9.0, 1.0, 1.0, 7.0, 9.0, 3.0, 2.0, 4.0]
    V = 100
    assert A.entropy_changes(t, ent, 2, V) == pytest.approx({2: (5.0 - 2.0) / math.log(V)})
    with pytest.raises(ValueError, match="8 entropies for 9 tokens"):
        A.entropy_changes(t, ent[:-1], 2, V)
    assert A.entropy_changes(Trajectory("q", "q"), [], 2, V) == {}


def test_branch_probability_is_clipped_alpha_plus_beta_delta():
    close(A.branch_probability(torch.tensor([0.0, 1.0, -3.0, 3.0]), 0.5, 0.2), [0.5, 0.7, 0.0, 1.0])


def test_branch_plan_draws_up_to_z_per_source_within_the_budget():
    opts = A.arpo_options({"group_size": 4, "global_samples": 2, "branches": 2})
    rollouts = [2, 4]
    sources = [A.BranchSource(0, 0.0), A.BranchSource(0, 2.5), A.BranchSource(0, 0.0), A.BranchSource(1, 9.0)]
    # source 0: p = 0.5, draws 0.4 (branch) and 0.6 (no); source 1: p = 1, one slot left, draw 0.9 (branch);
    # source 2: no slot left, no draw; source 3: its question is full already, no draw
    rng = Draws([0.4, 0.6, 0.9])
    assert A.branch_plan(sources, rollouts, opts, rng) == [1, 1, 0, 0]
    assert rollouts == [4, 4] and rng.values == []


def test_branch_plan_at_the_probability_boundary():
    opts = A.arpo_options({"group_size": 3, "global_samples": 1, "branches": 1})
    assert A.branch_plan([A.BranchSource(0, 1.0)], [1], opts, Draws([0.7])) == [1]  # u == p: branch
    assert A.branch_plan([A.BranchSource(0, 1.0)], [1], opts, Draws([0.7001])) == [0]


def test_refill_global_adds_one_sample_per_round_to_finished_questions_below_budget():
    rollouts = [3, 4, 2]
    assert A.refill_global([0, 0, 1], rollouts, 4) == [1, 0, 0]
    assert rollouts == [4, 4, 2]


def test_entropy_balanced_global_samples():
    assert A.entropy_balanced_global_samples(16, 1.0, [1.0, 1.0], 2.0) == 8  # sigmoid(0) = 1/2
    assert A.entropy_balanced_global_samples(16, math.log(3), [0.0], 1.0) == 12  # sigmoid(ln 3) = 3/4
    assert A.entropy_balanced_global_samples(16, 0.0, [50.0], 1.0) == 1  # at least one global sample
    assert A.entropy_balanced_global_samples(16, 50.0, [0.0], 1.0) == 16
    assert A.entropy_balanced_global_samples(4, 2.0, [], 1.0) == 2
    with pytest.raises(ValueError):
        A.entropy_balanced_global_samples(0, 1.0, [], 1.0)


# rows 0-2 share a question: row 1 branched from row 0 after two tokens; row 2 shares only the first token;
# row 3 is another question's row with the same tokens as row 0
TOKENS = [[5, 6, 7, 8], [5, 6, 9], [5, 1], [5, 6, 7, 8]]
GROUPS = [0, 0, 0, 1]


def test_shared_prefix_lengths():
    lcp = A.shared_prefix_lengths(TOKENS, GROUPS)
    assert lcp.tolist() == [[4, 2, 1, 0], [2, 3, 1, 0], [1, 1, 2, 0], [0, 0, 0, 4]]


def test_hard_attribution_averages_the_advantages_of_the_rows_sharing_a_token():
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    out = A.hard_attributed_advantages(adv, TOKENS, GROUPS)
    mean3 = (1.0 - 1.0 + 0.5) / 3
    close(out, [[mean3, 0.0, 1.0, 1.0],
                [mean3, 0.0, -1.0, 0.0],
                [mean3, 0.5, 0.0, 0.0],
                [2.0, 2.0, 2.0, 2.0]])


def test_hard_attribution_of_unshared_rows_is_their_own_advantage():
    out = A.hard_attributed_advantages(torch.tensor([0.3, -0.7]), [[1, 2], [3, 4, 5]], [0, 0])
    close(out, [[0.3, 0.3, 0.0], [-0.7, -0.7, -0.7]])
