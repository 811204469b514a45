"""The rollout strategy interface (``train.rollout.strategy``) and the strategies registered on it: ARPO's
entropy-adaptive branching, REX-RAG's probes and their importance correction, search self-play's two roles.
Each runs on a scripted backend whose replies (and reported log-probabilities) are fixed, so the groups,
branches, probes and rewards are computed by hand."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from agent.llm import Generation, decode, encode
from agent.trajectory import Role
from tests.conftest import QUESTIONS


class ScriptedLLM:
    """Replies by ``script(context_text) -> (reply, logprob per token)``; counts its calls."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, 0

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            self.calls += 1
            reply, lp = self.script(decode(self.tokenizer, p))
            ids = encode(self.tokenizer, reply)[: params.max_new_tokens]
            out.append(Generation(ids, decode(self.tokenizer, ids), "stop", [lp] * len(ids)))
        return out


def make_worker(llm, retriever, **agent):
    from sleuth.config import AgentConfig
    from training.rollout.worker import RolloutWorker

    cfg = AgentConfig(**{"max_turns": 4, "max_new_tokens": 24, "max_total_tokens": 512, "max_obs_tokens": 60,
                         "max_doc_chars": 80, "short_prompt": True, "chat_template": "off", "reward": "em",
                         "format_reward": 0.0, **agent})
    return RolloutWorker(llm, retriever, cfg, top_k=1, retry_waits=())


def train_cfg(**rollout):
    from training.config import TrainConfig

    return TrainConfig.model_validate({"rollout": rollout})


# -- the interface ------------------------------------------------------------------------------------------
def test_the_default_strategy_is_plain_group_sampling():
    from training.rollout.strategies import ROLLOUT_STRATEGIES

    tc = train_cfg()
    assert tc.rollout.strategy == "plain" and type(tc.rollout.strategy_options).__name__ == "Options"
    assert {"plain", "arpo", "rexrag", "ssp"} <= set(ROLLOUT_STRATEGIES.names())


def test_plain_gives_the_same_trajectories_as_the_worker(tok, retriever):
    """The default strategy changes nothing: the step's trajectories are the worker's own episodes."""
    from training.rollout.worker import rollout

    script = lambda text: ("<search> capital of France </search>", -1.0) if "<information>" not in text \
        else ("<answer> Paris </answer>", -0.5)
    w = make_worker(ScriptedLLM(tok, script), retriever)
    trajs, stats = rollout(w, QUESTIONS[:2], train_cfg(group_size=3))
    direct = w.episodes(QUESTIONS[:2], 3)
    assert [t.token_ids for t in trajs] == [t.token_ids for t in direct]
    assert [t.group for t in trajs] == [0, 0, 0, 1, 1, 1] and stats == {"rollout_errors": 0.0, "rollout_dropped": 0.0}


def test_the_strategy_rng_leaves_torchs_generator_as_it_was():
    """The strategies' draws are seeded by torch's generator state without advancing it: plain sampling keeps
    exactly the trajectories of before, and the same state (a resumed run) gives the same draws."""
    from training.rollout.strategies import strategy_rng

    torch.manual_seed(3)
    state = torch.get_rng_state()
    first = strategy_rng().random()
    assert torch.equal(torch.get_rng_state(), state) and strategy_rng().random() == first
    torch.rand(1)
    assert strategy_rng().random() != first


@pytest.mark.parametrize(("rollout", "message"), [
    ({"strategy": "arpoo"}, "unknown rollout strategy 'arpoo' (train.rollout.strategy)"),
    ({"strategy": "arpo", "strategy_options": {"global_sample": 2}},
     "unknown option(s) 'global_sample' of rollout strategy 'arpo' (train.rollout.strategy_options)"),
    ({"strategy": "arpo", "group_size": 4, "strategy_options": {"global_samples": 5}},
     "global samples N=5 must lie in [1, M=4] (the group's rollout budget)"),
    ({"strategy": "arpo", "strategy_options": {"global_samples": 0}}, "global samples N must be >= 1, got 0"),
    ({"strategy": "arpo", "strategy_options": {"branches": 0}}, "branches per tool step Z must be >= 1"),
    ({"strategy": "arpo", "strategy_options": {"branch_prob": 1.5}}, "branch_prob (alpha) must lie in [0.0, 1.0]"),
    ({"strategy": "rexrag", "strategy_options": {"probe_prob": -0.1}}, "probe_prob must lie in [0.0, 1.0]"),
    ({"strategy": "rexrag", "strategy_options": {"hints": []}}, "non-empty pool of non-empty hints"),
    ({"strategy": "ssp", "strategy_options": {"reward_type": "acc"}}, "reward_type must be one of"),
    ({"strategy": "ssp", "strategy_options": {"proposals": 0}}, "SSP's proposals must lie in [1.0, inf)"),
    ({"strategy": "arpo", "asynchronous": True}, "train.rollout.asynchronous samples plain groups"),
])
def test_bad_strategy_settings_fail_when_the_config_is_loaded(rollout, message):
    with pytest.raises(ValueError) as e:
        train_cfg(**rollout)
    assert message in str(e.value)


def test_arpo_budget_follows_the_group_and_a_new_strategy_starts_from_its_defaults():
    tc = train_cfg(strategy="arpo", group_size=6)
    assert tc.rollout.strategy_options.core(6).global_samples == 3  # ceil(M / 2), the script's 8 of 16
    tc = tc.updated({"rollout.strategy": "rexrag"})
    assert tc.rollout.strategy_options.probe_prob == 0.2
    with pytest.raises(ValueError, match="did you mean train.rollout.strategy_options.probe_prob"):
        tc.updated({"rollout.strategy_options": {"probe_prb": 0.5}})


def test_the_arpo_estimator_checks_its_attribution():
    from training.config import TrainConfig

    with pytest.raises(ValueError, match="ARPO's attribution must be one of"):
        TrainConfig.model_validate({"algorithm": {"adv_estimator": "arpo", "options": {"attribution": "medium"}}})


def test_an_external_agent_cannot_take_a_branching_strategy():
    from sleuth.config import AgentConfig
    from training.trainer import check_setup

    with pytest.raises(ValueError, match="train.rollout.strategy=ssp steps the built-in agent loop"):
        check_setup(train_cfg(strategy="ssp"), AgentConfig(kind="external", entry="examples.react_agent:run"))


# -- ARPO --------------------------------------------------------------------------------------------------
def three_turns(text):
    """Search, search, answer; the second turn is written with a much lower log-probability (higher
    entropy) than the first."""
    n = text.count("<information>")
    return [("<search> Paris </search>", -0.1), ("<search> France </search>", -2.0),
            ("<answer> Paris </answer>", -0.3)][min(n, 2)]


def test_arpo_branches_where_the_entropy_rose_after_a_tool_result(tok, retriever):
    """alpha = 0, beta = 10: after turn 1 (dH = 0 by definition) P = 0; after turn 2, dH_2 = (H_2 - H_1) /
    log V > 0 makes P = clip(10 dH_2) = 1, so the Z = 2 draws both branch and the budget M = 3 is full."""
    from training.rollout.arpo_rollout import arpo_groups
    from training.rollout.strategies import ARPORolloutOptions

    w = make_worker(ScriptedLLM(tok, three_turns), retriever)
    opts = ARPORolloutOptions(global_samples=1, branches=2, branch_prob=0.0, entropy_weight=10.0).core(3)
    trajs, stats = arpo_groups(w, QUESTIONS[:1], opts, random.Random(0))
    assert len(trajs) == 3 and {t.group for t in trajs} == {0}
    src, *branches = trajs
    at = [b.metadata["arpo"]["branch_at"] for b in branches]
    assert src.metadata["arpo"] == {"branch_at": 0} and at[0] == at[1] > 0
    assert all(b.token_ids[: at[0]] == src.token_ids[: at[0]] for b in branches)
    assert all(b.answer == "Paris" and b.reward == 1.0 and b.num_search_calls == 2 for b in trajs)
    n1 = len(encode(tok, "<search> Paris </search>"))
    n2 = len(encode(tok, "<search> France </search>"))
    dh2 = (2.0 * n2 - 0.1 * n1) / math.log(len(tok))
    assert stats["arpo/branches"] == 2 and stats["arpo/sources"] == 2 and stats["arpo/refills"] == 0
    assert stats["arpo/delta_h_mean"] == pytest.approx(dh2 / 2, rel=1e-5)  # (0 + dH_2) / 2 sources


def test_arpo_fills_the_budget_with_global_samples_when_nothing_branches(tok, retriever):
    from training.rollout.arpo_rollout import arpo_groups
    from training.rollout.strategies import ARPORolloutOptions

    w = make_worker(ScriptedLLM(tok, three_turns), retriever)
    opts = ARPORolloutOptions(global_samples=2, branch_prob=0.0, entropy_weight=0.0).core(5)
    trajs, stats = arpo_groups(w, QUESTIONS[:2], opts, random.Random(0))
    assert sorted(t.group for t in trajs) == [0] * 5 + [1] * 5
    assert stats["arpo/branches"] == 0 and stats["arpo/refills"] == 6  # 2 x (M - N)
    assert all(t.metadata["arpo"] == {"branch_at": 0} for t in trajs)


def test_hard_attribution_averages_the_shared_prefix_and_soft_is_grpo():
    """Two rows share their first 3 tokens (a branch): hard attribution gives those tokens the mean of the
    two GRPO advantages (+-0.7071 -> 0), each row's own tokens keep its own; soft is GRPO's broadcast."""
    from training.algos.estimators import compute_advantages
    from training.config import TrainConfig

    a = SimpleNamespace(token_ids=[1, 2, 3, 4, 5], num_search_calls=0)
    b = SimpleNamespace(token_ids=[1, 2, 3, 6, 7], num_search_calls=0)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
    inp = SimpleNamespace(rewards=torch.tensor([1.0, 0.0]), groups=torch.tensor([0, 0]), mask=mask,
                          trajs=[a, b], search_calls=torch.tensor([0, 0]), kl_seq=lambda: torch.zeros(2))
    A = 1 / math.sqrt(2)  # GRPO's (r - mean) / std with the unbiased std of {1, 0}
    for attribution, row0 in (("soft", [0, A, A, A]), ("hard", [0, 0, A, A])):
        tc = TrainConfig.model_validate({"algorithm": {"adv_estimator": "arpo", "options": {"attribution": attribution}}})
        adv = compute_advantages(tc, inp)["advantages"]
        assert adv[0].tolist() == pytest.approx(row0, abs=1e-5)
        assert adv[1].tolist() == pytest.approx([-x for x in row0], abs=1e-5)


# -- REX-RAG -----------------------------------------------------------------------------------------------
HINT = "<think> let me look again"


def probe_script(text):
    """Search the Eiffel Tower, then answer Paris (wrong for q1), unless a probe's hint is in the context:
    then Dijon (right)."""
    if "<information>" not in text:
        return "<search> Eiffel Tower </search>", -1.0
    return ("<answer> Dijon </answer>" if "look again" in text else "<answer> Paris </answer>"), -0.5


def test_rexrag_probes_each_dead_end_from_its_prefix_with_a_hint(tok, retriever):
    from training.algos.rexrag import RexRagOptions
    from training.rollout.rexrag_rollout import rexrag_groups

    w = make_worker(ScriptedLLM(tok, probe_script), retriever)
    trajs, stats = rexrag_groups(w, [QUESTIONS[1], QUESTIONS[0]], 2, RexRagOptions(probe_prob=1.0, hints=(HINT,)),
                                 random.Random(0))
    # q1 (Dijon): both answers wrong, both probed; q0 (Paris): both right, none probed
    assert [t.group for t in trajs] == [0, 0, 1, 1, 0, 0]
    base, probes = trajs[:4], trajs[4:]
    assert [t.reward for t in base] == [0.0, 0.0, 1.0, 1.0] and [t.reward for t in probes] == [1.0, 1.0]
    hint = encode(tok, HINT)
    for orig, p in zip(base[:2], probes, strict=True):
        keep = p.metadata["probe"]["keep"]
        assert p.token_ids[:keep] == orig.token_ids[:keep]  # the prefix: prompt, search turn, its result
        assert orig.roles[keep] == Role.POLICY and orig.turn_ids[keep] == 2  # the cut: the final answer turn
        assert p.token_ids[keep : keep + len(hint)] == hint
        assert set(p.roles[keep:]) == {Role.POLICY} and set(p.turn_ids[keep:]) == {2}
        assert p.metadata["probe"]["hint_logp"] == [0.0] * len(hint)  # a pool of one hint: probability 1
        assert all(math.isnan(x) for x in p.logprobs[keep : keep + len(hint)])  # no backend sampled the hint
        assert p.num_search_calls == 1 and p.answer == "Dijon"
    assert stats == {"rexrag/probes": 2.0, "rexrag/probe_em": 1.0}


def test_rexrag_behaviour_logprobs_on_the_batch_by_hand(tok, retriever):
    """With every old log-prob log 0.5, alpha = 2 probes / 6 rows, err = 2 wrong / 4 ordinary: ordinary rows
    log((1 - a) 0.5); a probe's prefix policy tokens log((1 - a) 0.5 + a 0.5 / err^(1/n)); its hint (pool
    probability 1) log((1 - a) 0.5 + a); its own continuation log(0.5)."""
    from training.algos.rexrag import RexRagOptions
    from training.batch import collate
    from training.config import TrainConfig
    from training.rollout.rexrag_rollout import rexrag_behaviour_logprobs, rexrag_groups

    w = make_worker(ScriptedLLM(tok, probe_script), retriever)
    trajs, _ = rexrag_groups(w, [QUESTIONS[1], QUESTIONS[0]], 2, RexRagOptions(probe_prob=1.0, hints=(HINT,)),
                             random.Random(0))
    batch = collate(trajs, tok.pad_token_id)
    batch.old_logprobs = torch.full_like(batch.loss_mask, math.log(0.5))
    tc = TrainConfig.model_validate({"rollout": {"strategy": "rexrag"}})
    rexrag_behaviour_logprobs(SimpleNamespace(batch=batch, trajs=trajs, tc=tc))
    mu = batch.behaviour_logprobs
    a, err = 2 / 6, 0.5
    m = batch.loss_mask.bool()
    assert torch.allclose(mu[0][m[0]], torch.tensor(math.log((1 - a) * 0.5)))
    p = trajs[4].metadata["probe"]
    keep, L = p["keep"], p["hint_len"]
    n_prefix = sum(r == Role.POLICY for r in trajs[4].roles[:keep])
    row = mu[4]
    first = next(i for i in range(keep) if trajs[4].roles[i] == Role.POLICY)  # a prefix policy token
    assert float(row[first - 1]) == pytest.approx(math.log((1 - a) * 0.5 + a * 0.5 * err ** (-1 / n_prefix)))
    assert float(row[keep - 1]) == pytest.approx(math.log((1 - a) * 0.5 + a))  # the hint's first token
    assert float(row[keep + L - 1]) == pytest.approx(math.log(0.5))  # the policy's own continuation
    assert not m[4, : first - 1].any() and torch.equal(mu[~m], batch.old_logprobs[~m])
    assert torch.equal(batch.ratio_logprobs(), mu)
    micro = batch.select(torch.tensor([0, 4]))  # micro-batches carry it to the loss
    assert torch.equal(micro.ratio_logprobs(), mu[[0, 4], : micro.loss_mask.shape[1]])
    off = TrainConfig.model_validate({"rollout": {"strategy": "rexrag", "strategy_options": {"correction": False}}})
    batch.behaviour_logprobs = None
    rexrag_behaviour_logprobs(SimpleNamespace(batch=batch, trajs=trajs, tc=off))
    assert batch.behaviour_logprobs is None and batch.ratio_logprobs() is batch.old_logprobs


# -- SSP ---------------------------------------------------------------------------------------------------
class SelfPlay:
    """Proposer: two searches, then the question; RAG verification: Paris; solver: search, then Paris on
    every other attempt and Berlin on the others (success rate 1/2)."""

    def __init__(self):
        self.solves = 0

    def __call__(self, text):
        n = text.count("<information>")
        if "Documents:" in text:
            return "<answer> Paris </answer>", -0.1
        if "Answer: Paris" in text:
            return [("<search> capital of France </search>", -0.2), ("<search> Paris city </search>", -0.2),
                    ("<answer> Which city is the capital of France? </answer>", -0.2)][min(n, 2)]
        if "Answer:" in text:  # another seed: a question with its own answer in it (rejected)
            return "<answer> Berlin is what </answer>", -0.2
        if n == 0:
            return "<search> capital of France </search>", -0.3
        self.solves += 1
        return ("<answer> Paris </answer>" if self.solves % 2 else "<answer> Berlin </answer>"), -0.3


def test_ssp_proposer_filter_rag_check_solver_and_rewards_by_hand(tok, retriever):
    from training.algos.ssp import SSPOptions
    from training.rollout.ssp_rollout import ssp_groups

    w = make_worker(ScriptedLLM(tok, SelfPlay()), retriever)
    opts = SSPOptions(min_question_words=4, min_searches=2)
    seeds = [QUESTIONS[0], QUESTIONS[2]]  # answers Paris and Berlin; their questions are never shown
    trajs, stats = ssp_groups(w, seeds, group_size=2, proposals=2, opts=opts, rng=random.Random(0))
    props = [t for t in trajs if t.metadata["role"] == "proposer"]
    solvers = [t for t in trajs if t.metadata["role"] == "solver"]
    assert [t.group for t in props] == [0, 0, 1, 1] and [t.group for t in solvers] == [2, 2, 3, 3]
    assert all(t.question == "Which city is the capital of France?" and t.golden_answers == ["Paris"] for t in solvers)
    assert [t.verdict["em"] for t in solvers] == [1.0, 0.0, 1.0, 0.0]
    # valid questions: 1 - success = 1 - 1/2; the Berlin seed's question holds its answer: -1
    assert [t.reward for t in props] == [0.5, 0.5, -1.0, -1.0]
    assert [t.verdict["ssp_valid"] for t in props] == [True, True, False, False]
    assert props[0].metadata["proposed_question"] == "Which city is the capital of France?"
    assert stats == {"ssp/proposals": 4.0, "ssp/valid_rate": 0.5, "ssp/filter_pass_rate": 0.5, "ssp/rag_pass_rate": 1.0,
                     "ssp/solver_em": 0.5, "ssp/proposer_reward": -0.25}


def test_ssp_rag_verification_rejects_a_question_the_documents_do_not_answer(tok, retriever):
    from training.algos.ssp import SSPOptions
    from training.rollout.ssp_rollout import ssp_groups

    play = SelfPlay()
    script = lambda text: ("<answer> Lyon </answer>", -0.1) if "Documents:" in text else play(text)
    w = make_worker(ScriptedLLM(tok, script), retriever)
    trajs, stats = ssp_groups(w, [QUESTIONS[0]], 2, 1, SSPOptions(min_question_words=4), random.Random(0))
    assert len(trajs) == 1 and trajs[0].reward == -1.0 and trajs[0].verdict["ssp_filter"] is True
    assert stats["ssp/rag_pass_rate"] == 0.0 and stats["ssp/valid_rate"] == 0.0


def test_ssp_counts_a_step_as_rollout_groups_through_the_worker(tok, retriever):
    """Through the trainer's rollout: SSP's groups are renumbered with the others and its stats logged."""
    from training.rollout.worker import rollout

    w = make_worker(ScriptedLLM(tok, SelfPlay()), retriever)
    tc = train_cfg(strategy="ssp", group_size=2, strategy_options={"min_question_words": 4, "proposals": 1})
    trajs, stats = rollout(w, [QUESTIONS[0]], tc)
    assert [t.group for t in trajs] == [0, 1, 1] and stats["ssp/valid_rate"] == 1.0


@pytest.mark.parametrize("correction", [True, False])
def test_rexrag_trains_with_the_corrected_ratio(correction, tiny_policy_dir, retriever, tmp_path):
    """One RL step whose rollout backend is the scripted prober: 2 x 2 wrong answers, all probed. With the
    correction the ratio's denominator is the mixture (ordinary rows: (1 - 1/2) pi_old, a ratio of 2 on-policy;
    hint tokens: 1/2 pi_old + 1/2, a ratio near 0 for the untrained policy), so the mean ratio moves away
    from 1; without it the ratio is pi / pi_old = 1 on-policy."""
    from agent.backends.hf import load_model_and_tokenizer
    from sleuth.config import load_config
    from tests.conftest import run_rl

    torch.set_num_threads(1)
    model, tk = load_model_and_tokenizer(str(tiny_policy_dir), device="cpu")
    cfg = load_config(None, ["train.steps=1", "train.rollout.questions_per_step=2", "train.rollout.group_size=2",
                             "agent.max_turns=3", "agent.max_new_tokens=12", "agent.max_total_tokens=256",
                             "agent.max_obs_tokens=60", "agent.short_prompt=true", "agent.format_reward=0",
                             "train.rollout.strategy=rexrag", "train.rollout.strategy_options.probe_prob=1.0",
                             f"train.rollout.strategy_options.hints=[{HINT!r}]",
                             f"train.rollout.strategy_options.correction={str(correction).lower()}"])
    out = run_rl(cfg, model, tk, retriever, [QUESTIONS[1]], tmp_path,
                 llm_factory=lambda m, t: ScriptedLLM(t, probe_script))
    rec = out["last"]
    assert rec["rexrag/probes"] == 4.0 and rec["rexrag/probe_em"] == 1.0 and rec["reward"] == 0.5
    if correction:
        assert abs(rec["ratio_mean"] - 1.0) > 0.05
    else:
        assert rec["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
