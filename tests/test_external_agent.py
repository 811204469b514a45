"""External agents as rollouts: the shipped LangGraph ReAct example (``create_react_agent`` + ``ChatOpenAI`` + a
search tool over Sleuth's retriever) runs over the training proxy, unchanged but for its base URL; its
episodes come back as judged, grouped trajectories whose trained tokens are exactly the sampled ones, and an
agent that fails or hangs fails its own episode only."""

from __future__ import annotations

import asyncio

import pytest

from agent.external.runner import ExternalRunner, final_answer, load_entry
from corpora.formats import QAExample
from tests.chat_templates import CALLS, CHATML_TOOLS, Recording, ScriptedSampler
from tests.test_proxy_templates import assert_every_trained_token_was_sampled

FRANCE = QAExample("q0", "What is the capital of France?", ["Paris"], {"hops": 1})
GERMANY = QAExample("q2", "What is the capital of Germany?", ["Berlin"])


@pytest.fixture()
def react(bm25_index, monkeypatch):
    monkeypatch.setenv("SLEUTH_INDEX", str(bm25_index))
    return load_entry("examples.react_agent:answer")


@pytest.fixture()
def cfg(agent_cfg):
    return agent_cfg.model_copy(update={"max_new_tokens": 64, "max_total_tokens": 2000})


def test_the_react_example_trains_through_the_proxy(tiny_llm, react, cfg):
    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    backend = Recording(ScriptedSampler(tiny_llm.tokenizer, [CALLS["chatml"], "<answer> Paris </answer>"]))
    with ExternalRunner(backend, react, cfg) as runner:
        trajs = runner.run_episodes([FRANCE, GERMANY], n_samples=2)
        stats = runner.stats
    assert [t.group for t in trajs] == [0, 0, 1, 1] and stats["splits"] == 0 and stats["calls"] == 8
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0] and all(t.stop_reason == "answer" for t in trajs)
    assert all([x.action for x in t.turns] == ["search", "answer"] for t in trajs)
    assert trajs[0].turns[0].query == "capital of France" and trajs[0].metadata["hops"] == 1
    assert trajs[0].verdict["em"] == 1.0 and trajs[0].verdict["format_ok"]
    assert_every_trained_token_was_sampled(trajs, backend.calls)
    # the tool's result (Sleuth's retriever, through LangChain's tool message) is a masked tool span
    from agent.llm import decode
    from agent.trajectory import Role
    tool = decode(tiny_llm.tokenizer, [i for i, r in zip(trajs[0].token_ids, trajs[0].roles) if r == Role.TOOL])
    assert "Doc 1(Title: Paris)" in tool


def test_the_react_example_with_a_real_sampling_policy_is_exact(tiny_llm, react, cfg):
    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    backend = Recording(tiny_llm)
    with ExternalRunner(backend, react, cfg.model_copy(update={"max_new_tokens": 16}), temperature=1.0) as runner:
        trajs = runner.run_episodes([FRANCE, GERMANY], n_samples=2)
    assert len(trajs) >= 4 and all(t.stop_reason in ("answer", "max_turns") for t in trajs)
    assert_every_trained_token_was_sampled(trajs, backend.calls)


def test_failing_hanging_and_silent_agents_fail_their_own_episodes(tiny_llm, cfg):
    from openai import AsyncOpenAI

    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    cfg = cfg.model_copy(update={"max_new_tokens": 16})

    async def agent(question: str, base_url: str) -> str:
        if "river" in question:
            await asyncio.sleep(3600)  # hangs without blocking: cancelled at the timeout
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])
        if "Germany" in question:
            raise RuntimeError("the agent's own bug")
        return r.choices[0].message.content

    async def silent(question: str, base_url: str) -> str:
        return "Paris"

    with ExternalRunner(tiny_llm, agent, cfg, timeout_s=120, reruns=1, name="mine:agent") as runner:
        ok, bug = runner.run_episodes([FRANCE, QAExample("q2", "Capital of Germany?", ["Berlin"])])
        assert runner.stats["episodes"] == 3  # the one that raised was run again, and failed again
    river = QAExample("q3", "Which river flows through the Netherlands?", ["Rhine"])
    with ExternalRunner(tiny_llm, agent, cfg, timeout_s=1, reruns=1, name="mine:agent") as runner:
        (hang,) = runner.run_episodes([river])
        assert runner.stats["timeouts"] == 1  # not run again: a rerun would double the stall
    assert ok.stop_reason in ("answer", "max_turns") and len(ok) > 0
    assert [t.metadata["failed_attempts"] for t in (ok, bug, hang)] == [0, 2, 1]
    from training.rollout.faults import drop_failed
    assert drop_failed([ok, bug, hang]) == ([ok], {"rollout_errors": 3.0, "rollout_dropped": 2.0})
    assert bug.stop_reason == "error" and bug.reward == 0.0
    assert bug.metadata["error"] == "the agent mine:agent raised RuntimeError: the agent's own bug"
    assert hang.stop_reason == "error" and hang.metadata["error"] == \
        "the agent mine:agent took longer than 1 s (agent.external_timeout_s); it was cancelled"
    assert len(bug) > 0  # its calls are recorded (and the trainer leaves the episode out)
    with ExternalRunner(tiny_llm, silent, cfg, reruns=0, name="mine:silent") as runner:
        (t,) = runner.run_episodes([FRANCE])
    assert t.stop_reason == "error" and len(t) == 0
    assert t.metadata["error"].startswith("the agent mine:silent returned 'Paris' without calling the model at http")


def test_entry_points_and_answers():
    assert load_entry("examples.react_agent:answer").__name__ == "answer"
    with pytest.raises(ValueError, match="must be 'module:function'"):
        load_entry("examples.react_agent")
    with pytest.raises(ValueError, match="must be an async function"):
        load_entry("examples.react_agent:retriever")
    with pytest.raises(AttributeError, match="has no 'nope'"):
        load_entry("examples.react_agent:nope")
    with pytest.raises(ImportError):
        load_entry("no_such_module_here:f")
    assert final_answer("I think <answer> Paris </answer>") == "Paris"
    assert final_answer(" Paris ") == "Paris" and final_answer("  ") is None and final_answer(None) is None


def test_a_tokenizer_without_a_chat_template_renders_with_sleuths_chatml(tiny_llm, react, cfg):
    """The tiny policy Sleuth builds has no chat template: the proxy renders with
    agent.external.chat_template's ChatML (tools and tool calls included), so the ReAct example trains on it
    as on an instruct model."""
    from agent.external.chat_template import CHATML_TOOLS
    from agent.llm import decode

    tiny_llm.tokenizer.chat_template = None
    backend = Recording(ScriptedSampler(tiny_llm.tokenizer, [CALLS["chatml"], "<answer> Paris </answer>"]))
    with ExternalRunner(backend, react, cfg) as runner:
        (t,) = runner.run_episodes([FRANCE])
        assert runner.stats["splits"] == 0
    assert t.reward == 1.0 and [x.action for x in t.turns] == ["search", "answer"]
    prompt = decode(tiny_llm.tokenizer, t.token_ids[: t.prompt_len])
    assert prompt.startswith("<|im_start|>system\n") and '"name": "search"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and CHATML_TOOLS.startswith("{%- if tools %}")


def test_evaluation_runs_the_external_agent_with_one_record_per_episode(tiny_llm, react, cfg):
    """``eval``'s agent method takes the runner's ``loop_episodes`` in place of the built-in loop: one scored
    record per question, also for an episode the template split into two training sequences."""
    from eval.methods import EVAL_METHODS, MethodContext
    from tests.chat_templates import QWEN3_TOOLS

    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    backend = Recording(ScriptedSampler(tiny_llm.tokenizer, [CALLS["chatml"], "<answer> Paris </answer>"]))
    with ExternalRunner(backend, react, cfg, temperature=1.0) as runner:
        ctx = MethodContext(None, None, cfg, run_episodes=runner.loop_episodes)
        recs = EVAL_METHODS.get("agent").run([FRANCE, GERMANY], ctx)
        assert runner.proxy.settings.temperature == 1.0  # the evaluation's 0.0 held for its call only
    assert [r["prediction"] for r in recs] == ["Paris", "Paris"] and recs[0]["verdict"]["em"] == 1.0
    assert [r["search_calls"] for r in recs] == [1, 1] and recs[1]["verdict"]["em"] == 0.0

    async def two_rounds(question: str, base_url: str) -> str:  # a user follow-up: Qwen3 drops the reasoning
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": question}]
        for follow_up in ("And in French?", None):
            r = await client.chat.completions.create(model="m", messages=msgs)
            msgs.append(r.choices[0].message.model_dump(exclude_none=True))
            if follow_up:
                msgs.append({"role": "user", "content": follow_up})
        return msgs[-1]["content"]

    tiny_llm.tokenizer.chat_template = QWEN3_TOOLS
    backend = ScriptedSampler(tiny_llm.tokenizer, ["<think>\nhm\n</think>\n\n<answer> Paris </answer>"])
    with ExternalRunner(backend, two_rounds, cfg) as runner:
        seqs = runner.run_episodes([FRANCE])
        ctx = MethodContext(None, None, cfg, run_episodes=runner.loop_episodes)
        (rec,) = EVAL_METHODS.get("agent").run([FRANCE], ctx)
    assert [s.metadata["segment"] for s in seqs] == [0, 1] and all(s.reward == 1.0 for s in seqs)
    assert rec["prediction"] == "Paris" and rec["turns"] == 2


def test_sleuth_serve_answers_with_the_external_agent(tiny_llm, react, cfg, retriever):
    """``create_app(..., external=runner)``: /ask and /v1/chat/completions answer with the external agent (judged
    when golden answers come with the question); the built-in loop is not run."""
    import httpx2

    from agent.serve.app import create_app
    from tests.test_agent_fakes import ServerThread

    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    backend = Recording(ScriptedSampler(tiny_llm.tokenizer, [CALLS["chatml"], "<answer> Paris </answer>"]))
    with ExternalRunner(backend, react, cfg, temperature=0.0) as runner:
        app = create_app(backend, retriever, cfg.model_copy(update={"kind": "external"}), external=runner)
        with ServerThread(app) as server, httpx2.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/ask", json={"question": FRANCE.question, "golden_answers": ["Paris"]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["answer"] == "Paris" and body["verdict"]["em"] == 1.0 and body["searches"] == 1
            chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": GERMANY.question}]})
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["message"]["content"] == "Paris"
            # the built-in loop's knobs would be ignored by the external agent: a value of its own is refused,
            # the server's own (what the browser page sends) is accepted
            for field, value in (("top_k", 2), ("max_turns", 1)):
                r = http.post("/ask", json={"question": FRANCE.question, field: value})
                assert r.status_code == 422 and "agent.kind=external" in r.json()["error"]["message"], r.text
            r = http.post("/ask", json={"question": FRANCE.question, "max_turns": cfg.max_turns})
            assert r.status_code == 200, r.text
        assert runner.stats["calls"] == 6 and len(backend.calls) == 6  # three episodes of two calls, all external


@pytest.mark.slow
def test_sleuth_train_resume_and_eval_an_external_agent_on_the_shipped_sample(tmp_path, capsys):
    """The README's commands for your own agent: `sleuth train --config configs/react_agent.yaml` on the shipped
    sample (the tiny policy, CPU): steps complete with rewards, monitors and the proxy's counters logged, the
    held-out evaluation runs the external agent, checkpoints resume, and `sleuth eval` reports the agent."""
    import json

    from sleuth.cli import main

    common = ["--config", "configs/react_agent.yaml", f"out_dir={tmp_path}", f"retrieval.index_dir={tmp_path / 'index'}",
              "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1", "policy.tiny.vocab_size=1024",
              "policy.tiny.intermediate_size=64", "train.rollout.questions_per_step=2", "train.rollout.group_size=2",
              "train.checkpoints.save_every=1", "train.monitoring.eval_every=2", "eval.limit=4"]
    assert main(["train", *common, "train.steps=2"]) == 0
    records = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward", "em", "format_ok", "entropy", "proxy_calls", "proxy_splits", "pg_loss", "rollout_errors"):
        assert all(key in r for r in records), key
    assert all(r["proxy_calls"] >= 4 for r in records) and "eval_em" in records[1]
    assert main(["train", *common, "train.steps=3", "--resume"]) == 0
    records = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (tmp_path / "grpo" / "checkpoints" / "step_000003").is_dir()
    capsys.readouterr()
    assert main(["eval", *common, "--model", str(tmp_path / "grpo" / "checkpoints" / "latest")]) == 0
    out = capsys.readouterr().out
    assert "| agent | n | EM |" in out and "| 4 |" in out
