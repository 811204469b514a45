"""Rollouts through a retrieval server or policy backend that fails and comes back: failed episodes are run
again, those that still fail are left out of the update, and the step's metrics count both."""

from __future__ import annotations

import threading

import pytest

from retrieval.client import RetrievalServerError
from tests.conftest import QUESTIONS
from tests.test_agent_fakes import ScriptLLM

SCRIPTS = {q.question: [f"<search> {q.question} </search>", f"<answer> {q.golden_answers[0]} </answer>"]
           for q in QUESTIONS}


class FlakyRetriever:
    """The wrapped retriever, but its calls raise ``error`` while ``down`` is true, or for the first
    ``fail_calls`` calls; ``calls`` counts every call."""

    def __init__(self, inner, fail_calls: int = 0, error: Exception | None = None):
        self.inner, self.fail_calls, self.calls, self.down = inner, fail_calls, 0, False
        self.error = error or RetrievalServerError("retrieval server at http://127.0.0.1:1 failed: refused")
        self.lock = threading.Lock()

    def search(self, queries, k):
        with self.lock:
            self.calls += 1
            fail = self.down or self.calls <= self.fail_calls
        if fail:
            raise self.error
        return self.inner.search(queries, k)


@pytest.fixture()
def no_waits(monkeypatch):
    import training.rollout.faults

    monkeypatch.setattr(training.rollout.faults, "RETRY_WAITS_S", (0.01, 0.01, 0.01))


def test_episodes_failed_by_a_retrieval_outage_are_run_again_in_their_group(tiny_llm, retriever, agent_cfg,
                                                                              no_waits):
    from training.rollout.faults import run_episodes_retrying

    flaky = FlakyRetriever(retriever, fail_calls=2)  # the first batch and its second try
    trajs = run_episodes_retrying(QUESTIONS[:2], ScriptLLM(tiny_llm.tokenizer, SCRIPTS), flaky, agent_cfg,
                                  n_samples=2, top_k=2)
    assert [t.group for t in trajs] == [0, 0, 1, 1]
    assert [t.question for t in trajs] == [QUESTIONS[0].question] * 2 + [QUESTIONS[1].question] * 2
    assert all(t.stop_reason == "answer" and t.reward == 1.0 for t in trajs), [t.metadata for t in trajs]
    assert [t.metadata["failed_attempts"] for t in trajs] == [2] * 4 and flaky.calls == 3


def test_a_request_fault_is_run_again_once_at_once_then_dropped_and_counted(tiny_llm, retriever, agent_cfg,
                                                                            monkeypatch):
    """A failure that is the request's own (the retriever raising ValueError for it) is not waited for: one
    immediate rerun, then the episode is left out with its failed runs counted."""
    import training.rollout.faults
    from training.rollout.faults import drop_failed, run_episodes_retrying

    # would hang the test if waited for
    monkeypatch.setattr(training.rollout.faults, "RETRY_WAITS_S", (600.0,))
    flaky = FlakyRetriever(retriever, error=ValueError("the encoder rejected the query"))
    flaky.down = True
    trajs = run_episodes_retrying(QUESTIONS[:1], ScriptLLM(tiny_llm.tokenizer, SCRIPTS), flaky, agent_cfg,
                                  n_samples=2)
    assert all(t.stop_reason == "error" and not t.metadata["service_down"] for t in trajs)
    assert [t.metadata["failed_attempts"] for t in trajs] == [2, 2]
    with pytest.raises(RuntimeError, match="all 2 episodes of this rollout failed.*encoder rejected"):
        drop_failed(trajs)


def test_drop_failed_leaves_out_failed_episodes_and_counts_them():
    from agent.trajectory import Trajectory
    from training.rollout.faults import drop_failed

    ok = Trajectory("q", "x", stop_reason="answer", metadata={"failed_attempts": 1})
    bad = Trajectory("q", "x", stop_reason="error", metadata={"error": "ConnectionError: x", "failed_attempts": 3})
    kept, stats = drop_failed([ok, bad, Trajectory("q", "x", stop_reason="max_turns")])
    assert kept == [ok, kept[1]] and len(kept) == 2 and bad not in kept
    assert stats == {"rollout_errors": 4.0, "rollout_dropped": 1.0}


def test_the_trainer_rollout_neither_trains_on_nor_hides_episodes_of_an_outage(tiny_policy_dir, retriever):
    """Before, an episode whose search failed (the retrieval server down) stayed in the batch with reward 0
    and its tokens up to the failed search: the update taught the policy that searching earns nothing. Now
    the rollout runs it again, after the configured waits, and the step's stats count the failures."""
    import time

    from tests.test_trainer import load, make_cfg
    from training.rollout.worker import RolloutWorker, rollout

    cfg = make_cfg("train.rollout.group_size=2", "agent.max_turns=3", "agent.max_new_tokens=40", "agent.max_total_tokens=400",
                   "agent.max_obs_tokens=120", "train.rollout.retry_waits=[0.01,0.01,0.01]")
    _, tok = load(tiny_policy_dir)
    flaky = FlakyRetriever(retriever, fail_calls=1)

    def worker():
        return RolloutWorker(ScriptLLM(tok, SCRIPTS), flaky, cfg.agent, cfg.retrieval.top_k,
                             retry_waits=tuple(cfg.train.rollout.retry_waits))

    trajs, stats = rollout(worker(), QUESTIONS[:2], cfg.train)
    assert len(trajs) == 4 and all(t.stop_reason == "answer" for t in trajs)
    assert stats["rollout_errors"] == 4.0 and stats["rollout_dropped"] == 0.0
    # a service that stays down: the episodes are dropped after the three waits (not the 30 s default), not
    # trained on; all of them down is an error
    flaky.down = True
    t0, calls = time.monotonic(), flaky.calls
    with pytest.raises(RuntimeError, match="all 4 episodes of this rollout failed"):
        rollout(worker(), QUESTIONS[:2], cfg.train)
    assert flaky.calls - calls == 4 and time.monotonic() - t0 < 10  # the first try and one rerun per wait


def test_rollout_retry_waits_are_validated_and_default_to_the_module_schedule():
    from training.config import TrainConfig
    from training.rollout.faults import RETRY_WAITS_S

    assert TrainConfig().rollout.retry_waits == list(RETRY_WAITS_S)
    assert TrainConfig(rollout={"retry_waits": []}).rollout.retry_waits == []
    with pytest.raises(ValueError, match="train.rollout.retry_waits must be seconds >= 0"):
        TrainConfig(rollout={"retry_waits": [2.0, -1.0]})
    for bad in ([float("nan")], [float("inf")]):  # a wait of for ever would hang the run
        with pytest.raises(ValueError, match="finite number"):
            TrainConfig(rollout={"retry_waits": bad})


def test_rank_records_sum_the_fault_counts():
    from training.trainer import merge_rank_records

    rec = merge_rank_records([({"rollout_errors": 3.0, "rollout_dropped": 1.0, "reward": 1.0}, 4),
                              ({"rollout_errors": 2.0, "rollout_dropped": 0.0, "reward": 0.0}, 4)], set())
    assert rec["rollout_errors"] == 5.0 and rec["rollout_dropped"] == 1.0 and rec["reward"] == 0.5
