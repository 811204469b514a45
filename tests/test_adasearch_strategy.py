"""AdaSearch as the rollout strategy ``adasearch`` (Lin et al., 2025, arXiv 2512.16883): stage 1's parametric and
search modes, stage 2's labels, decision rewards and statistics, computed by hand on a scripted backend; its
options checked when the config is loaded; one step of each stage through ``sleuth train`` on the synthetic task
and on the shipped sample, stage 2 starting from stage 1's checkpoint."""

from __future__ import annotations

import json
import random

import pytest

from agent.llm import Generation, decode, encode
from tests.conftest import QUESTIONS

# q0 "capital of France" (Paris), q1 "designer of the Eiffel Tower" (Dijon), q2 "capital of Germany" (Berlin)
PARAMETRIC = {"France": ["<answer> Paris </answer>"] * 2, "Eiffel": ["<answer> Paris </answer>"] * 2,
              "Germany": ["<answer> Berlin </answer>", "<answer> Bonn </answer>"]}
DECIDE = {"France": ["<decision> answer </decision>"] * 2,
          "Eiffel": ["<decision> answer </decision>", "<think> not sure </think><decision> search </decision>"],
          "Germany": ["<decision> maybe </decision>"] * 2}


class Scripted:
    """A backend whose reply depends on the prompt's mode and question (per (mode, question) its replies in
    turn); the search mode searches once, then answers Paris. Records the prompts it saw."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen, self.count = tokenizer, [], {}

    def reply(self, text):
        key = next(k for k in PARAMETRIC if k in text)
        if "Without search." in text:
            mode, replies = "parametric", PARAMETRIC[key]
        elif "Answer or search?" in text:
            mode, replies = "decision", DECIDE[key]
        else:
            return "<answer> Paris </answer>" if "<information>" in text else "<search> capital </search>"
        i = self.count.get((mode, key), 0)
        self.count[(mode, key)] = i + 1
        return replies[i % len(replies)]

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = decode(self.tokenizer, p)
            self.seen.append(text)
            ids = encode(self.tokenizer, self.reply(text))[: params.max_new_tokens]
            out.append(Generation(ids, decode(self.tokenizer, ids), "stop", [-0.5] * len(ids)))
        return out


def make_worker(llm, retriever, **agent):
    """The rollout strategies' test worker, with 3 turns of up to 64 tokens (a decision or parametric answer
    fits one turn)."""
    from tests.test_rollout_strategies import make_worker as strategies_worker

    return strategies_worker(llm, retriever, **{"max_turns": 3, "max_new_tokens": 64, **agent})


def opts(**kw):
    from training.algos.knowledge_boundary import AdaSearchOptions

    return AdaSearchOptions(**kw)


def train_cfg(**rollout):
    from training.config import TrainConfig

    return TrainConfig.model_validate({"rollout": rollout})


# -- stage 1 ---------------------------------------------------------------------------------------------------
def test_stage1_runs_both_modes_in_their_own_groups(tok, retriever):
    """group_size 4, share 0.5: 2 search-mode episodes (group i) and 2 parametric ones (group Q + i) per
    question. The parametric episode of q1 answers Paris (wrong); a search written in parametric mode is an
    invalid turn and reaches no retriever."""
    from training.rollout.adasearch_rollout import stage1_groups

    llm = Scripted(tok)
    w = make_worker(llm, retriever)
    trajs, stats = stage1_groups(w, QUESTIONS[:2], 4, opts())
    modes = [t.metadata["mode"] for t in trajs]
    assert modes == ["search"] * 4 + ["parametric"] * 4
    assert [t.group for t in trajs] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    search, par = trajs[:4], trajs[4:]
    assert all(t.num_search_calls == 1 and t.num_turns == 2 for t in search)
    assert all(t.num_turns == 1 and t.num_search_calls == 0 and not t.retrieved_ids for t in par)
    # the prompt: BOS (if any) and the one-line parametric prompt, as prompt tokens; then only policy tokens
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    want = bos + encode(tok, "Without search. Question: What is the capital of France?\n")
    assert par[0].token_ids[: par[0].prompt_len] == want
    reply = encode(tok, "<answer> Paris </answer>")
    assert par[0].token_ids[par[0].prompt_len:] == reply and par[0].loss_mask == [0] * len(want) + [1] * len(reply)
    assert stats == {"adasearch/stage": 1.0, "adasearch/parametric_episodes": 4.0, "adasearch/search_episodes": 4.0,
                     "adasearch/parametric_em": 0.5, "adasearch/search_em": 0.5}


def test_a_search_in_parametric_mode_is_an_invalid_turn(tok, retriever):
    from training.rollout.adasearch_rollout import one_turn_episodes

    llm = Scripted(tok)
    llm.reply = lambda text: "<search> capital of France </search>"
    (t,) = one_turn_episodes(make_worker(llm, retriever), [(QUESTIONS[0], 0)], "parametric")
    assert t.turns[0].action == "invalid" and "parametric mode" in t.turns[0].error
    assert t.num_search_calls == 0 and t.reward == 0.0 and t.verdict["format_ok"] is False
    assert t.stop_reason == "max_turns"


@pytest.mark.parametrize(("share", "want"), [(0.0, (0, 4)), (0.25, (1, 3)), (0.5, (2, 2)), (0.6, (2, 2)),
                                             (0.75, (3, 1)), (1.0, (4, 0))])
def test_stage1_split_of_the_group(share, want):
    from training.algos.knowledge_boundary import adasearch_split

    assert adasearch_split(4, share) == want


def test_stage1_with_a_share_of_one_runs_only_parametric_episodes(tok, retriever):
    from training.rollout.adasearch_rollout import stage1_groups

    trajs, stats = stage1_groups(make_worker(Scripted(tok), retriever), QUESTIONS[:1], 2, opts(parametric_share=1.0))
    assert [t.metadata["mode"] for t in trajs] == ["parametric"] * 2 and [t.group for t in trajs] == [1, 1]
    assert stats["adasearch/search_em"] == 0.0 and stats["adasearch/parametric_em"] == 1.0


# -- stage 2 ---------------------------------------------------------------------------------------------------
def test_stage2_labels_rewards_and_statistics_by_hand(tok, retriever):
    """K = 2 parametric answers: q0 2/2 right (known), q1 0/2 (unknown), q2 1/2 (known at threshold 0.5).
    Decisions (group_size 2): q0 answer, answer (1, 1); q1 answer, search (0, 1); q2 unparseable twice (the
    format penalty -0.5). F1_aware: tp 2 (q0), fp 1 (q1), fn 2 (q2) -> 4 / 7."""
    from training.rollout.adasearch_rollout import stage2_groups

    llm = Scripted(tok)
    trajs, stats = stage2_groups(make_worker(llm, retriever), QUESTIONS[:3], 2,
                                 opts(stage=2, label_rollouts=2, format_penalty=-0.5))
    assert [t.metadata["mode"] for t in trajs] == ["decision"] * 6  # the label rollouts are not trained
    assert [t.group for t in trajs] == [0, 0, 1, 1, 2, 2]
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 1.0, -0.5, -0.5]
    assert [t.verdict["decision"] for t in trajs] == ["answer", "answer", "answer", "search", None, None]
    assert [t.verdict["known"] for t in trajs] == [True, True, False, False, True, True]
    assert [t.turns[0].action for t in trajs] == ["decision"] * 6
    assert [t.turns[0].error is None for t in trajs] == [True] * 4 + [False] * 2
    assert [t.stop_reason for t in trajs] == ["decision"] * 4 + ["max_turns"] * 2
    assert all(t.num_search_calls == 0 and not t.retrieved_ids for t in trajs)
    assert stats == pytest.approx({"adasearch/stage": 2.0, "adasearch/parametric_episodes": 6.0,
                                   "adasearch/decisions": 6.0, "adasearch/known_share": 2 / 3,
                                   "adasearch/parametric_em": 0.5, "adasearch/answer_share": 0.5,
                                   "adasearch/decision_format_ok": 4 / 6, "adasearch/decision_reward": 2 / 6,
                                   "adasearch/f1_aware": 4 / 7})
    # a decision's policy tokens are its generation, cut at </decision>; the prompt is the decision prompt
    t = trajs[3]
    assert decode(tok, t.token_ids[: t.prompt_len]).endswith("Answer or search? Question: Where was the designer "
                                                            "of the Eiffel Tower born?\n")
    assert t.loss_mask == [0] * t.prompt_len + [1] * (len(t) - t.prompt_len)
    assert sum(1 for p in llm.seen if "Without search." in p) == 6


def test_stage2_threshold_and_trained_label_rollouts(tok, retriever):
    """At threshold 0.75, q2's 1/2 is unknown: its unparseable decisions still get the penalty, q1 and q2 are
    unknown; with train_label_rollouts the K parametric episodes join as group Q + i with their EM reward."""
    from training.rollout.adasearch_rollout import stage2_groups

    trajs, stats = stage2_groups(make_worker(Scripted(tok), retriever), QUESTIONS[:3], 2,
                                 opts(stage=2, label_rollouts=2, known_threshold=0.75, train_label_rollouts=True))
    decs = [t for t in trajs if t.metadata["mode"] == "decision"]
    par = [t for t in trajs if t.metadata["mode"] == "parametric"]
    assert [t.verdict["known"] for t in decs] == [True, True, False, False, False, False]
    assert [t.reward for t in decs] == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]  # the default format penalty is 0
    assert [t.group for t in par] == [3, 3, 4, 4, 5, 5] and sorted(t.reward for t in par) == [0, 0, 0, 1, 1, 1]
    assert stats["adasearch/known_share"] == pytest.approx(1 / 3)
    assert stats["adasearch/f1_aware"] == pytest.approx(4 / 5)  # tp 2, fp 1, fn 0: 2 tp / (2 tp + fp + fn)


def test_adasearch_through_the_trainers_rollout(tok, retriever):
    """Through ``rollout``: groups renumbered 0..G-1, the strategy's statistics in the step's."""
    from training.rollout.worker import rollout

    tc = train_cfg(strategy="adasearch", group_size=2, strategy_options={"stage": 1})
    trajs, stats = rollout(make_worker(Scripted(tok), retriever), QUESTIONS[:2], tc)
    assert [t.group for t in trajs] == [0, 1, 2, 3] and stats["adasearch/stage"] == 1.0
    assert [t.metadata["mode"] for t in trajs] == ["search", "search", "parametric", "parametric"]


def test_adaptive_inference_routes_each_question_by_its_decision(tok, retriever):
    from training.rollout.adasearch_rollout import adaptive_episodes

    trajs = adaptive_episodes(make_worker(Scripted(tok), retriever), QUESTIONS[:3])
    assert [t.metadata["decision"] for t in trajs] == ["answer", "answer", None]
    assert [t.metadata["mode"] for t in trajs] == ["parametric", "parametric", "search"]
    assert [t.question_id for t in trajs] == ["q0", "q1", "q2"] and [t.num_search_calls for t in trajs] == [0, 0, 1]


def test_the_long_prompts_go_through_the_chat_template_setting(tok, retriever):
    from agent.protocols.base import user_message_ids
    from training.algos.knowledge_boundary import decision_prompt
    from training.rollout.adasearch_rollout import one_turn_episodes

    llm = Scripted(tok)
    llm.reply = lambda text: "<decision> search </decision>"
    w = make_worker(llm, retriever, short_prompt=False)
    (t,) = one_turn_episodes(w, [(QUESTIONS[1], 0)], "decision")
    assert t.token_ids[: t.prompt_len] == user_message_ids(tok, decision_prompt(QUESTIONS[1].question), w.agent)
    assert t.metadata["mode"] == "decision" and t.reward == 0.0  # scored by score_decisions, not the judge


# -- options ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("rollout", "message"), [
    ({"strategy_options": {"stage": 3}}, "AdaSearch's stage must be 1 (problem solving) or 2"),
    ({"strategy_options": {"stage": 0}}, "AdaSearch's stage must be 1"),
    ({"strategy_options": {"parametric_share": 1.5}}, "AdaSearch's parametric_share must lie in [0.0, 1.0], got 1.5"),
    ({"strategy_options": {"parametric_share": -0.1}}, "parametric_share must lie in [0.0, 1.0]"),
    ({"strategy_options": {"label_rollouts": 0}}, "AdaSearch's label_rollouts K must be >= 1"),
    ({"strategy_options": {"known_threshold": 0.0}}, "AdaSearch's known_threshold must lie in (0.0, 1.0], got 0.0"),
    ({"strategy_options": {"known_threshold": 1.01}}, "known_threshold must lie in (0.0, 1.0]"),
    ({"strategy_options": {"format_penalty": 0.5}}, "AdaSearch's format_penalty must lie in (-inf, 0.0], got 0.5"),
    ({"strategy_options": {"stages": 2}},
     "unknown option(s) 'stages' of rollout strategy 'adasearch' (train.rollout.strategy_options)"),
    ({"group_size": 1}, "parametric_share=0.5 of group_size=1 rollouts gives 1 parametric and 0 search"),
    ({"group_size": 3, "strategy_options": {"parametric_share": 0.1}}, "gives 0 parametric and 3 search"),
])
def test_bad_adasearch_settings_fail_when_the_config_is_loaded(rollout, message):
    with pytest.raises(ValueError) as e:
        train_cfg(strategy="adasearch", **rollout)
    assert message in str(e.value)


def test_good_adasearch_settings_and_the_bounds_they_may_touch():
    from training.config import TrainConfig

    tc = train_cfg(strategy="adasearch", group_size=2, strategy_options={"parametric_share": 1.0})
    assert tc.rollout.strategy_options.parametric_share == 1.0
    tc = train_cfg(strategy="adasearch", group_size=2, strategy_options={"parametric_share": 0.25})  # 1 and 1
    assert tc.rollout.strategy_options.parametric_share == 0.25
    o = train_cfg(strategy="adasearch", group_size=2, strategy_options={
        "stage": 2, "label_rollouts": 1, "known_threshold": 1.0, "format_penalty": -1.0}).rollout.strategy_options
    assert (o.stage, o.label_rollouts, o.known_threshold, o.format_penalty, o.train_label_rollouts) == (2, 1, 1.0, -1.0,
                                                                                                       False)
    # stage 2 does not split the group: a group of one decision is allowed (by an estimator without groups)
    tc = TrainConfig.model_validate({"algorithm": {"adv_estimator": "reinforce_pp"}, "rollout": {
        "strategy": "adasearch", "group_size": 1, "strategy_options": {"stage": 2}}})
    assert tc.rollout.group_size == 1
    with pytest.raises(ValueError, match="gives 1 parametric and 0 search"):
        tc.updated({"rollout.strategy_options": {"stage": 1}})


def test_an_external_agent_cannot_take_adasearch():
    from sleuth.config import AgentConfig
    from training.trainer import check_setup

    with pytest.raises(ValueError, match="train.rollout.strategy=adasearch steps the built-in agent loop"):
        check_setup(train_cfg(strategy="adasearch"), AgentConfig(kind="external", entry="examples.react_agent:run"))


def test_the_strategy_draws_nothing_from_its_rng(tok, retriever):
    from training.rollout.adasearch_rollout import adasearch_groups

    rng = random.Random(0)
    state = rng.getstate()
    adasearch_groups(make_worker(Scripted(tok), retriever), QUESTIONS[:1], 2, opts(), rng)
    assert rng.getstate() == state


# -- through sleuth train --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task_args(tmp_path_factory):
    """``sleuth train`` arguments of the synthetic task (a small draw of task v1) and of the shipped sample."""
    from corpora.synthetic import SyntheticSpec, write

    root = tmp_path_factory.mktemp("adasearch_tasks")
    paths = write(root / "synthetic", SyntheticSpec(n_train=12, n_test=4))
    synthetic = [f"data.{k}={v}" for k, v in paths.items()] + [f"retrieval.index_dir={root / 'synthetic_index'}",
                                                               "retrieval.top_k=1", "retrieval.build_dense=false"]
    sample = [f"retrieval.index_dir={root / 'sample_index'}", "retrieval.build_dense=false"]  # data.*: the sample
    return {"synthetic": synthetic, "sample": sample}


def train(out, model, task_args, task, *extra):
    from sleuth.cli import main

    rc = main(["train", f"out_dir={out}", f"policy.model={model}", "sft.enabled=false", "train.steps=1",
               "train.rollout.questions_per_step=2", "train.rollout.group_size=2", "agent.max_new_tokens=8",
               "agent.max_total_tokens=192", "agent.short_prompt=true", "eval.limit=2", *task_args[task],
               "train.rollout.strategy=adasearch", *extra])
    assert rc == 0
    (metrics,) = out.glob("*/metrics.jsonl")
    (record,) = [json.loads(x) for x in metrics.read_text().splitlines()]
    trajs = [json.loads(x) for x in (metrics.parent / "trajectories.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and "pg_loss" in record and "skipped" not in record  # the update ran
    return metrics.parent, record, trajs


@pytest.mark.parametrize("task", ["synthetic", "sample"])
def test_both_stages_train_through_sleuth_train(task, task_args, tiny_policy_dir, tmp_path):
    """Stage 1 for one step, then stage 2 for one step from stage 1's checkpoint (``latest``)."""
    run1, record, trajs = train(tmp_path / "stage1", tiny_policy_dir, task_args, task)
    # 2 questions x group_size 2, half parametric: one episode of each mode per question (the log holds the
    # first group_size trajectories: question 0's search episode, then question 1's)
    assert record["adasearch/stage"] == 1.0 and 0.0 <= record["adasearch/parametric_em"] <= 1.0
    assert record["adasearch/parametric_episodes"] == 2.0 and record["adasearch/search_episodes"] == 2.0
    assert [t["metadata"]["mode"] for t in trajs] == ["search"] * 2
    (latest,) = run1.glob("checkpoints/latest")
    _, record, trajs = train(tmp_path / "stage2", latest, task_args, task, "train.rollout.strategy_options.stage=2",
                             "train.rollout.strategy_options.label_rollouts=2")
    assert record["adasearch/stage"] == 2.0 and "adasearch/f1_aware" in record
    assert record["adasearch/parametric_episodes"] == 4.0 and record["adasearch/decisions"] == 4.0
    assert 0.0 <= record["adasearch/known_share"] <= 1.0 and 0.0 <= record["adasearch/answer_share"] <= 1.0
    assert [t["metadata"]["mode"] for t in trajs] == ["decision"] * 2
    for t in trajs:  # a decision's reward: 1 when it fits the label, 0 when not, the format penalty (0) otherwise
        d, k = t["verdict"]["decision"], t["verdict"]["known"]
        assert t["reward"] == (float((d == "answer") == k) if d is not None else 0.0)
