"""The search-agent methods as registered choices: AEPO (estimator), E-GRPO / IKEA / SSRL (rewards), SSRL's
self-search engine (retrieval method), behaviour priming (SFT data builders): their options in the config, the
errors of bad input before the first step, and the rewards on hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from agent.trajectory import Trajectory, Turn
from training.config import SFTConfig, TrainConfig


def _traj(group=0, em=0.0, fmt=True, turns=(), metadata=None, reward=None, question="Where was Kalo born?"):
    t = Trajectory(question_id=f"q{group}", question=question, golden_answers=["Zeta"], group=group,
                   turns=[Turn(index=i + 1, **kw) for i, kw in enumerate(turns)], metadata=dict(metadata or {}))
    t.answer = "x" if fmt else None
    t.verdict = {"em": em, "format_ok": fmt}
    t.reward = em + (0.1 if fmt else 0.0) if reward is None else reward
    return t


def _search(q, obs="Doc 1(Title: Kalo) Kalo was born in Rumi."):
    return {"text": f"<search> {q} </search>", "action": "search", "query": q, "observation": obs}


def _answer(a):
    return {"text": f"<answer> {a} </answer>", "action": "answer", "answer": a}


# -- the config ---------------------------------------------------------------------------------------
def test_each_method_is_a_registered_choice_with_its_options():
    tc = TrainConfig.model_validate({"algorithm": {"adv_estimator": "aepo", "options": {"entropy_target": 1.5},
                                                   "reward": "egrpo", "reward_options": {"alpha": 0.5}}})
    assert type(tc.algorithm.options).__name__ == "AEPOOptions" and tc.algorithm.options.entropy_target == 1.5
    assert tc.algorithm.options.temperature_high == 1.2 and tc.algorithm.options.reinforce_samples == 60
    assert type(tc.algorithm.reward_options).__name__ == "EGRPOOptions" and tc.algorithm.reward_options.alpha == 0.5
    assert TrainConfig().algorithm.reward == "judge"
    ikea = TrainConfig().updated({"algorithm.reward": "ikea"}).algorithm.reward_options
    assert (ikea.r_kb_pos, ikea.r_kb_neg, ikea.rt_max, ikea.format_penalty) == (0.6, 0.05, 3, -1.0)
    ssrl = TrainConfig().updated({"algorithm.reward": "ssrl", "algorithm.reward_options": {"require_think": False}})
    assert ssrl.algorithm.reward_options.require_think is False and ssrl.algorithm.reward_options.em_weight == 0.9
    sft = SFTConfig.model_validate({"data": "primed", "data_options": {"required": ["verification"], "n": 3}})
    assert sft.data_options.required == ("verification",) and sft.data_options.pool_factor == 4
    assert SFTConfig().data == "oracle"


@pytest.mark.parametrize("section, key, value, message", [
    ("algorithm", "reward", "egrp", "unknown reward 'egrp' (train.algorithm.reward)"),
    ("algorithm", "reward_options", {"alpah": 0.3}, "did you mean train.algorithm.reward_options.alpha?"),
    ("algorithm", "reward_options", {"alpha": 1.0}, "E-GRPO's alpha must lie in [0.0, 1.0), got 1.0"),
    ("algorithm", "options", {"entropy_targt": 0.5}, "did you mean train.algorithm.options.entropy_target?"),
    ("algorithm", "options", {"entropy_target": 0.0}, "AEPO's entropy_target must lie in (0.0, inf), got 0.0"),
    ("algorithm", "options", {"temperature_low": 1.1}, "0 < temperature_low <= 1 <= temperature_high"),
])
def test_bad_method_settings_fail_when_the_config_is_loaded(section, key, value, message):
    alg = {"reward": "egrpo"} if key.startswith("reward") and key != "reward" else {}
    if key == "options":
        alg["adv_estimator"] = "aepo"
    alg[key] = value
    with pytest.raises(ValueError) as e:
        TrainConfig.model_validate({section: alg})
    assert message in str(e.value), str(e.value)


def test_bad_sft_data_settings_fail_when_the_config_is_loaded():
    for data, opts, message in (("primd", {}, "unknown SFT data builder 'primd' (sft.data)"),
                                ("primed", {"requried": []}, "did you mean sft.data_options.required?"),
                                ("primed", {"required": ["honesty"]}, "unknown behaviour(s) ['honesty']"),
                                ("random", {"outcome": "good"}, "outcome must be correct, incorrect or any"),
                                ("oracle", {"n": 3}, "it takes no options")):
        with pytest.raises(ValueError) as e:
            SFTConfig.model_validate({"data": data, "data_options": opts})
        assert message in str(e.value), str(e.value)


def test_the_aepo_entropy_target_is_checked_against_log_v():
    tc = TrainConfig.model_validate({"algorithm": {"adv_estimator": "aepo", "options": {"entropy_target": 6.0}}})
    tc.check_model(600)  # log 600 = 6.397
    with pytest.raises(ValueError, match=r"train.algorithm.options: AEPO's entropy target \(nats, V=400\) must lie "
                                         r"in \(0.0, 5.99"):
        tc.check_model(400)  # log 400 = 5.991
    TrainConfig().check_model(2)  # the other estimators need nothing of the policy


# -- the rewards --------------------------------------------------------------------------------------
def test_ikea_reward_by_searches_and_outcome():
    from training.algos.rewards import training_rewards

    trajs = [_traj(em=1.0, turns=[_answer("Zeta")]), _traj(em=1.0, turns=[_search("a"), _search("b"), _answer("Zeta")]),
             _traj(em=1.0, turns=[_search("a")] * 4 + [_answer("Zeta")]), _traj(em=0.0, turns=[_search("a"), _answer("y")]),
             _traj(em=0.0, turns=[_answer("y")]), _traj(em=0.0, fmt=False, turns=[_search("a")])]
    alg = TrainConfig().updated({"algorithm.reward": "ikea"}).algorithm
    r = training_rewards(alg, trajs, torch.zeros(6, dtype=torch.long))
    assert r.tolist() == pytest.approx([1.6, 1.2, 1.0, 0.05, 0.0, -1.0])
    assert [t.reward for t in trajs] == pytest.approx(r.tolist())  # the reward trained on is the one logged
    assert trajs[0].verdict["judge_reward"] == pytest.approx(1.1)  # the judge's is kept


def test_egrpo_rewards_a_near_miss_by_the_bridge_entities_its_turns_named():
    from training.algos.rewards import training_rewards

    meta = {"chain": ["Kalo", "Rumi", "Zeta"], "hops": 2}
    trajs = [_traj(em=1.0, turns=[_search("Kalo"), _search("Rumi"), _answer("Zeta")], metadata=meta),
             _traj(em=0.0, turns=[_search("Kalo"), _search("Rumi"), _answer("Vobe")], metadata=meta),
             _traj(em=0.0, turns=[_search("Kalo"), _answer("Rumi")], metadata=meta),  # Rumi named in the answer
             _traj(em=0.0, turns=[_answer("Vobe")], metadata=meta),
             _traj(em=0.0, fmt=False, turns=[_search("Rumi")], metadata=meta),
             # group 1: the best wrong rollout found nothing, so no partial credit at all
             _traj(group=1, em=0.0, turns=[_answer("Vobe")], metadata=meta)]
    alg = TrainConfig().updated({"algorithm.reward": "egrpo"}).algorithm
    r = training_rewards(alg, trajs, torch.tensor([0, 0, 0, 0, 0, 1]))
    # E = {Rumi} (Kalo is named in the question); gamma = 1, 1, 1, 0, (format error), 0; max per group 1 and 0
    assert r.tolist() == pytest.approx([1.0, 0.3, 0.3, 0.0, 0.0, 0.0])


def test_egrpo_reads_supporting_titles_off_the_observations_without_a_chain():
    from training.algos.rewards import retrieved_titles, training_rewards

    meta = {"supporting_ids": ["p1", "p2"], "hops": 2}
    obs = "Doc 1(Title: Gustave Eiffel) Gustave Eiffel was born in Dijon.\nDoc 2(Title: Dijon) Dijon is a city."
    found = _traj(em=0.0, turns=[{**_search("Eiffel", obs), "hit_ids": ["p1", "p2"]}, _answer("Dijon")], metadata=meta,
                  question="Where was the designer of the Eiffel Tower born?")
    half = _traj(em=0.0, turns=[_search("Gustave Eiffel", None), _answer("Paris")], metadata=meta,
                 question="Where was the designer of the Eiffel Tower born?")
    assert retrieved_titles([found, half]) == {"p1": "Gustave Eiffel", "p2": "Dijon"}
    alg = TrainConfig().updated({"algorithm.reward": "egrpo", "algorithm.reward_options": {"alpha": 0.2}}).algorithm
    r = training_rewards(alg, [found, half], torch.zeros(2, dtype=torch.long))
    # E = {Gustave Eiffel, Dijon}; "found" named Dijon only (gamma 1/2), "half" Gustave Eiffel only (1/2)
    assert r.tolist() == pytest.approx([0.2, 0.2])


def test_ssrl_reward_is_em_and_format_of_the_whole_response():
    from training.algos.rewards import episode_response, training_rewards

    good = _traj(em=1.0, turns=[_search("Kalo", "Kalo was born in Rumi."), _answer("Zeta")])
    assert episode_response(good) == ("<search> Kalo </search><information>Kalo was born in Rumi.</information>"
                                      "<answer> Zeta </answer>")
    bad = _traj(em=0.0, turns=[_answer("Vobe"), _search("x")])
    wrong = _traj(em=0.0, turns=[_answer("Vobe")])
    relaxed = TrainConfig().updated({"algorithm.reward": "ssrl",
                                     "algorithm.reward_options": {"require_think": False}}).algorithm
    r = training_rewards(relaxed, [good, bad, wrong], torch.zeros(3, dtype=torch.long))
    assert r.tolist() == pytest.approx([1.0, 0.0, 0.1])
    strict = TrainConfig().updated({"algorithm.reward": "ssrl"}).algorithm  # the paper's: no <think>, no format
    assert training_rewards(strict, [_traj(em=1.0, turns=[_answer("Zeta")])], torch.zeros(1)).tolist() == \
        pytest.approx([0.9])


def test_the_judge_reward_is_left_as_it_is():
    from training.algos.rewards import training_rewards

    t = _traj(em=1.0, turns=[_answer("Zeta")], reward=1.1)
    assert training_rewards(TrainConfig().algorithm, [t], torch.zeros(1)).tolist() == pytest.approx([1.1])
    assert "judge_reward" not in t.verdict


# -- AEPO's estimator ---------------------------------------------------------------------------------
def test_aepo_gives_the_spliced_samples_advantage_one_and_grpo_the_rest():
    from training.algos.estimators import AdvantageInputs, compute_advantages

    tc = TrainConfig.model_validate({"algorithm": {"adv_estimator": "aepo"}})
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([5, 0, 0, 0, 0])  # row 0: a REINFORCE sample in a group of its own
    mask = torch.ones(5, 3)
    inp = AdvantageInputs(rewards=rewards, groups=groups, mask=mask, token_turns=torch.ones(5, 3, dtype=torch.long),
                          turn_valid=torch.ones(5, 1, dtype=torch.bool), is_search=torch.zeros(5, 1, dtype=torch.bool),
                          search_calls=torch.zeros(5, dtype=torch.long), trajs=[None] * 5,
                          prepared={"aepo_rows": torch.tensor([True, False, False, False, False])})
    adv = compute_advantages(tc, inp)["advantages"]
    # group 0 = rewards 0, 1, 0, 0: mean 0.25, std (unbiased) 0.5 -> -0.5, 1.5, -0.5, -0.5
    assert adv[:, 0].tolist() == pytest.approx([1.0, -0.5, 1.5, -0.5, -0.5], abs=1e-4)
    assert torch.equal(adv[:, 0:1].expand(5, 3), adv)


# -- SSRL's self-search engine ------------------------------------------------------------------------
def test_the_self_search_engine_writes_with_the_policy_bound_to_it():
    from retrieval.registry import RETRIEVERS, OpenRequest

    entry = RETRIEVERS.get("self_search")
    assert entry.generative and not entry.cached and not entry.index_parts
    built = []
    engine = entry.open(OpenRequest(index_dir=None, generate=lambda: built.append(1) or (lambda ps: ["Own\nfirst"] * len(ps))))
    assert not built  # the request's LLM is built on the first search, not when opened
    (hits,) = engine.search(["Kalo"], 1)
    assert built == [1] and hits[0].title == "Own" and hits[0].contents == "Own\nfirst"
    engine.bind_policy(lambda ps: ["" for _ in ps])  # a policy that stops at once: its result is "no result"
    (hits,) = engine.search(["Kalo"], 2)
    assert [h.contents for h in hits] == ["Kalo\n(no result)", "Kalo\n(no result)"]
    assert engine.last_labels == [["useful", "useful"]]  # no noise: the policy writes what it knows
    with pytest.raises(RuntimeError, match="no policy"):
        entry.open(OpenRequest(index_dir=None)).search(["q"], 1)



@pytest.mark.parametrize("entropy, temperature, spliced", [(2.0, 1.2, 1), (5.5, 0.8, 0)])
def test_aepo_splices_its_samples_in_place_of_the_first_rows(entropy, temperature, spliced, tiny_llm, retriever,
                                                             agent_cfg):
    """H at or below the target: the hot temperature and the whole budget (1 sample); above it: the cool one and
    half the budget (0)."""
    import copy

    from agent.loop.batch import run_episodes
    from tests.conftest import QUESTIONS
    from training.algos.estimators import PrepareContext, prepare_inputs
    from training.batch import collate
    from training.rollout.worker import RolloutWorker

    trajs = run_episodes(QUESTIONS[:2], tiny_llm, retriever, agent_cfg, n_samples=2, top_k=1, seed=0)
    calls = []

    class Worker(RolloutWorker):
        def episodes(self, questions, n):
            calls.append(([q.id for q in questions], n, self.agent.temperature))
            out = [copy.deepcopy(t) for q in questions for t in trajs if t.question_id == q.id][:n * len(questions)]
            for i, t in enumerate(out):
                t.reward, t.group = float(i % 2 == 0), i // n  # per group: [1, 0]
            return out

    tc = TrainConfig.model_validate({"algorithm": {"adv_estimator": "aepo", "options": {
        "entropy_target": 5.0, "reinforce_samples": 1, "resample_fraction": 0.5}}, "rollout": {"group_size": 2}})
    batch = collate(trajs, tiny_llm.tokenizer.pad_token_id, 512)
    rows = list(trajs)
    ctx = PrepareContext(batch=batch, trajs=rows, tc=tc, tokenizer=tiny_llm.tokenizer, max_len=512, policy=None,
                         logprobs=None, worker=Worker(tiny_llm, retriever, agent_cfg, 1),
                         score=lambda b: setattr(b, "old_logprobs", torch.full_like(b.loss_mask, -1.0)),
                         entropy=lambda b: torch.full(b.loss_mask.shape, entropy))
    prepare_inputs(ctx)
    assert calls == [([trajs[0].question_id], 2, temperature)]  # half the questions, at T
    stats = batch.prepared["stats"]
    assert stats == {"aepo/entropy": pytest.approx(entropy), "aepo/temperature": temperature, "aepo/resampled": 2.0,
                     "aepo/selected": float(spliced)}
    assert batch.prepared["aepo_rows"].tolist() == [True] * spliced + [False] * (4 - spliced)
    assert len(rows) == 4 and rows[spliced:] == trajs[spliced:]  # the first GRPO rows gave way
    if spliced:
        assert rows[0] is not trajs[0] and rows[0].group == 2 and rows[0].metadata["aepo_temperature"] == 1.2
        assert torch.equal(batch.input_ids, collate(rows, tiny_llm.tokenizer.pad_token_id, 512).input_ids)
        assert batch.groups.tolist() == [2, 0, 1, 1] and batch.rewards[0] == 1.0
        assert float(batch.old_logprobs[batch.loss_mask > 0].max()) == -1.0  # scored again
