"""The LangGraph agent loop with a scripted backend: protocol handling, budgets, token records, batching."""

from __future__ import annotations

import pytest

from agent.llm import Generation, SamplingParams, decode, encode
from agent.loop.batch import run_episodes
from agent.trajectory import Role, Trajectory, load_trajectories, save_trajectories
from corpora.formats import QAExample


class ScriptedLLM:
    """Plays a fixed list of turn texts per episode (episodes are told apart by the question in the prompt)."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.batches: list[int] = []
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params: SamplingParams):
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = decode(self.tokenizer, p)
            q = next(k for k in self.scripts if k in text)
            turn = text.count("<information>")
            script = self.scripts[q]
            reply = script[min(turn, len(script) - 1)]
            ids = encode(self.tokenizer, reply)[: params.max_new_tokens]
            out.append(Generation(ids, decode(self.tokenizer, ids), "stop" if len(ids) < params.max_new_tokens else "length"))
        return out


def test_search_then_answer_records_roles_and_turns(tiny_llm, retriever, agent_cfg):
    ex = QAExample("q0", "What is the capital of France?", ["Paris"], {"supporting_ids": ["p0"]})
    llm = ScriptedLLM(tiny_llm.tokenizer, {"capital of France": ["<search> capital of France </search>", "<answer> Paris </answer>"]})
    (t,) = run_episodes([ex], llm, retriever, agent_cfg, top_k=2)
    assert t.answer == "Paris" and t.stop_reason == "answer" and t.reward == 1.0
    assert [x.action for x in t.turns] == ["search", "answer"] and t.num_search_calls == 1
    assert "p0" in t.retrieved_ids and t.verdict["format_ok"]
    t.check()
    # roles: prompt, then policy turn 1, tool (turn 1), policy turn 2
    runs = []
    for r, k in zip(t.roles, t.turn_ids):
        if not runs or runs[-1] != (r, k):
            runs.append((r, k))
    assert runs == [(Role.PROMPT, 0), (Role.POLICY, 1), (Role.TOOL, 1), (Role.POLICY, 2)]
    tool_text = decode(tiny_llm.tokenizer, [i for i, r in zip(t.token_ids, t.roles) if r == Role.TOOL])
    assert tool_text.strip().startswith("<information>Doc 1(Title: Paris)") and tool_text.strip().endswith("</information>")


def test_what_the_policy_saw_is_what_is_recorded(tiny_llm, retriever, agent_cfg):
    ex = QAExample("q1", "Where was the designer of the Eiffel Tower born?", ["Dijon"])
    llm = ScriptedLLM(tiny_llm.tokenizer, {"Eiffel Tower born": [
        "<search> Eiffel Tower designer </search>", "<search> Gustave Eiffel </search>", "<answer> Dijon </answer>"]})
    (t,) = run_episodes([ex], llm, retriever, agent_cfg)
    assert len(llm.prompts) == 3
    for p in llm.prompts:  # every prompt the backend received is a prefix of the recorded episode
        assert t.token_ids[: len(p)] == p
    # and each turn's policy tokens directly follow the prompt it was generated from
    ends = [len(p) for p in llm.prompts]
    for k, e in enumerate(ends, start=1):
        assert t.roles[e] == Role.POLICY and t.turn_ids[e] == k


def test_malformed_action_becomes_error_observation(tiny_llm, retriever, agent_cfg):
    ex = QAExample("q2", "What is the capital of Germany?", ["Berlin"])
    llm = ScriptedLLM(tiny_llm.tokenizer, {"capital of Germany": ["<search> capital of Germany", "<answer> Berlin </answer>"]})
    (t,) = run_episodes([ex], llm, retriever, agent_cfg)
    assert t.turns[0].action == "invalid" and "unclosed <search>" in t.turns[0].error
    assert "My previous action is invalid" in t.turns[0].observation
    assert t.answer == "Berlin" and t.verdict["em"] == 1.0 and not t.verdict["format_ok"]


def test_no_answer_before_turn_budget(tiny_llm, retriever, agent_cfg):
    ex = QAExample("q3", "Which river flows through Germany?", ["Rhine"])
    llm = ScriptedLLM(tiny_llm.tokenizer, {"river flows": ["<search> river Germany </search>"]})
    (t,) = run_episodes([ex], llm, retriever, agent_cfg)
    assert t.answer is None and t.stop_reason == "max_turns" and t.num_turns == agent_cfg.max_turns
    assert t.reward == 0.0


def test_token_budget_ends_episode(tiny_llm, retriever, agent_cfg):
    cfg = agent_cfg.model_copy(update={"max_total_tokens": 60})
    ex = QAExample("q3", "Which river flows through Germany?", ["Rhine"])
    llm = ScriptedLLM(tiny_llm.tokenizer, {"river flows": ["<search> river Germany </search>"]})
    (t,) = run_episodes([ex], llm, retriever, cfg)
    assert len(t) <= 60 and t.answer is None and t.stop_reason in ("max_tokens", "max_turns")


def test_episodes_are_batched_and_grouped(tiny_llm, retriever, agent_cfg):
    exs = [QAExample(f"q{i}", f"What is the capital of France number {i}?", ["Paris"]) for i in range(5)]
    llm = ScriptedLLM(tiny_llm.tokenizer, {"capital of France": ["<search> France </search>", "<answer> Paris </answer>"]})
    trajs = run_episodes(exs, llm, retriever, agent_cfg, n_samples=3)
    assert len(trajs) == 15 and [t.group for t in trajs] == [i for i in range(5) for _ in range(3)]
    assert llm.batches == [15, 15]  # one backend call per turn for all 15 episodes


def test_backend_failure_fails_episode_cleanly(tiny_llm, retriever, agent_cfg):
    class Broken:
        tokenizer = tiny_llm.tokenizer

        def generate(self, prompts, params):
            raise TimeoutError("backend timed out")

    (t,) = run_episodes([QAExample("q", "anything?", ["x"])], Broken(), retriever, agent_cfg)
    assert t.stop_reason == "error" and "timed out" in t.metadata["error"] and t.reward == 0.0


def test_trajectory_jsonl_round_trip(tmp_path, tiny_llm, retriever, agent_cfg):
    ex = QAExample("q0", "What is the capital of France?", ["Paris"])
    llm = ScriptedLLM(tiny_llm.tokenizer, {"capital of France": ["<search> France </search>", "<answer> Paris </answer>"]})
    trajs = run_episodes([ex], llm, retriever, agent_cfg)
    save_trajectories(tmp_path / "t.jsonl", trajs)
    (back,) = list(load_trajectories(tmp_path / "t.jsonl"))
    assert isinstance(back, Trajectory) and back.to_json() == trajs[0].to_json()


def test_appending_after_a_torn_last_line_drops_it(tmp_path):
    """A run killed while appending leaves a torn last line; the next append (the resumed run) drops it
    instead of gluing its first record onto it, so every whole record stays readable."""
    path = tmp_path / "t.jsonl"
    trajs = [Trajectory(f"q{i}", "Où est Dijon ?", ["Dijon"], token_ids=[1, 2], roles=[0, 1], turn_ids=[0, 1])
             for i in range(3)]
    save_trajectories(path, trajs[:2])
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:25])  # killed mid-write
    save_trajectories(path, trajs[2:], append=True)
    assert [t.question_id for t in load_trajectories(path)] == ["q0", "q1", "q2"]
    save_trajectories(tmp_path / "new.jsonl", trajs[:1], append=True)  # appending to no file creates it
    assert [t.question_id for t in load_trajectories(tmp_path / "new.jsonl")] == ["q0"]


def test_reading_a_file_whose_writer_was_killed_skips_only_the_torn_last_line(tmp_path):
    """trajectories.jsonl of a training run killed mid-append (or still running) ends in a partial record; the
    whole records before it are read, the torn tail is skipped with a warning (a torn line inside still raises)."""
    import json

    import pytest

    path = tmp_path / "t.jsonl"
    trajs = [Trajectory(f"q{i}", "Où est Dijon ?", ["Dijon"], token_ids=[1, 2], roles=[0, 1], turn_ids=[0, 1])
             for i in range(2)]
    save_trajectories(path, trajs)
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:-40])
    with pytest.warns(UserWarning, match="torn last line"):
        assert [t.question_id for t in load_trajectories(path)] == ["q0", "q1"]
    path.write_bytes(whole.splitlines(keepends=True)[0][:-40] + b"\n" + whole)
    with pytest.raises(json.JSONDecodeError):
        list(load_trajectories(path))


def test_run_episodes_works_where_an_event_loop_is_already_running(tiny_llm, retriever, agent_cfg):
    """A Jupyter cell (or any async caller) already runs an event loop: the synchronous entry point must not
    fail there with 'asyncio.run() cannot be called from a running event loop'."""
    import asyncio

    ex = QAExample("q0", "What is the capital of France?", ["Paris"])
    llm = ScriptedLLM(tiny_llm.tokenizer, {"capital of France": ["<search> France </search>", "<answer> Paris </answer>"]})

    async def notebook_cell():
        return run_episodes([ex], llm, retriever, agent_cfg)

    (t,) = asyncio.run(notebook_cell())
    assert t.answer == "Paris" and t.stop_reason == "answer"


def test_real_tiny_policy_runs_episodes(tiny_llm, retriever, agent_cfg):
    """An untrained policy produces garbage; the loop must still end every episode with a stop reason."""
    exs = [QAExample(f"q{i}", f"What is the capital of France {i}?", ["Paris"]) for i in range(4)]
    trajs = run_episodes(exs, tiny_llm, retriever, agent_cfg, n_samples=2, seed=0)
    assert len(trajs) == 8
    for t in trajs:
        t.check()
        assert t.stop_reason in ("answer", "max_turns", "max_tokens") and len(t) <= agent_cfg.max_total_tokens


def test_truncate_at_stop_keeps_an_exact_prefix(tiny_llm):
    from agent.llm import truncate_at_stop

    tok = tiny_llm.tokenizer
    ids = encode(tok, "<search> Paris </search> trailing words <answer> x </answer>")
    cut, text, reason = truncate_at_stop(tok, ids, ("</search>", "</answer>"), {tok.eos_token_id})
    assert reason == "stop" and cut == ids[: len(cut)] and text.endswith("</search>")
    assert decode(tok, cut) == text
    eos = tok.eos_token_id
    cut, text, reason = truncate_at_stop(tok, ids[:3] + [eos] + ids[3:], ("</search>",), {eos})
    assert reason == "stop" and cut == ids[:3] + [eos] and text == decode(tok, ids[:3])
    cut, text, reason = truncate_at_stop(tok, ids[:3], ("</search>",), {eos})
    assert reason == "length" and cut == ids[:3]


def test_chat_template_on_without_a_template_is_refused_when_the_context_is_made(tiny_llm, retriever, agent_cfg):
    """``agent.chat_template=on`` with a tokenizer that has no chat template failed inside every episode
    (transformers' error at ``apply_chat_template``; under ``sleuth serve`` an HTTP 500 per request). It is
    a ``ValueError`` naming the setting when the agent context is made (server start, training start)."""
    from agent.loop.nodes import make_context

    assert not getattr(tiny_llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="agent.chat_template=on"):
        make_context(tiny_llm, retriever, agent_cfg.model_copy(update={"chat_template": "on"}))
    make_context(tiny_llm, retriever, agent_cfg.model_copy(update={"chat_template": "auto"}))
