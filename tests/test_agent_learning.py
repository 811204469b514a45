"""Your own agent learns: the SFT warm start of an external agent runs the agent itself (the shipped LangGraph
ReAct example) over the training proxy with a scripted oracle as its model, so the warm-start episodes are
in the agent's own chat template, with its tool results masked; the slow test trains the example (SFT, then
RL) through the CLI and sees the policy call the tool and the reward move."""

from __future__ import annotations

import json

import pytest

from agent.external.chat_template import CHATML_TOOLS
from corpora.formats import QAExample
from tests.chat_templates import LLAMA3_TOOLS

FRANCE = QAExample("q0", "What is the capital of France?", ["Paris"], {"supporting_ids": ["p0"], "hops": 1})
# the first search (the question) shows the Eiffel Tower and Gustave Eiffel, not Dijon's own paragraph
EIFFEL = QAExample("q1", "Where was the designer of the Eiffel Tower born?", ["Dijon"],
                   {"supporting_ids": ["p2", "p3", "p4"], "hops": 3})
TITLES = {"p0": "Paris", "p2": "Eiffel Tower", "p3": "Gustave Eiffel", "p4": "Dijon"}


def test_the_oracle_writes_tool_calls_as_the_chat_template_renders_them(tiny_llm):
    from agent.llm import SamplingParams, decode, encode
    from training.rollout.oracle import ToolCallOracleLLM

    tok = tiny_llm.tokenizer
    chatml = ToolCallOracleLLM(tok, [FRANCE], TITLES, chat_template=CHATML_TOOLS)
    assert chatml.call_text("capital of France") == \
        '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'
    llama = ToolCallOracleLLM(tok, [FRANCE], TITLES, chat_template=LLAMA3_TOOLS, tool="lookup", argument="q")
    assert llama.call_text("x y") == '{"name": "lookup", "parameters": {"q": "x y"}}'
    prompt = encode(tok, tok.apply_chat_template([{"role": "user", "content": FRANCE.question}],
                                                 chat_template=CHATML_TOOLS, add_generation_prompt=True, tokenize=False))
    (g,) = chatml.generate([prompt], SamplingParams(max_new_tokens=200))
    assert g.text == chatml.call_text(FRANCE.question) and g.finish_reason == "stop"
    assert g.token_ids[-1] == tok.eos_token_id and decode(tok, g.token_ids[:-1]) == g.text
    assert len(g.logprobs) == len(g.token_ids)
    (short,) = chatml.generate([prompt], SamplingParams(max_new_tokens=len(encode(tok, chatml.call_text("What"))) + 1))
    assert short.text == chatml.call_text("What") and short.finish_reason == "stop"  # query words dropped to fit
    (none,) = chatml.generate([encode(tok, "an unknown question")], SamplingParams(max_new_tokens=50))
    assert none.text == "<answer> unknown </answer>"
    with pytest.raises(ValueError, match="renders no assistant tool call"):
        ToolCallOracleLLM(tok, [FRANCE], chat_template="{{ messages[0].content }}")


def test_oracle_episodes_of_the_react_example_are_in_its_template_with_tool_results_masked(
        tiny_llm, bm25_index, agent_cfg, monkeypatch):
    """external_oracle_trajectories: LangGraph's ReAct agent runs unchanged, the oracle behind the proxy
    searches the question, then the supporting title it has not seen, then answers; every episode is one
    training sequence whose policy tokens are exactly the oracle's turns and whose tool results are masked."""
    from agent.llm import decode
    from agent.trajectory import Role
    from training.batch import collate
    from training.sft import external_oracle_trajectories

    monkeypatch.setenv("SLEUTH_INDEX", str(bm25_index))
    tok = tiny_llm.tokenizer
    tok.chat_template = None  # the tiny policy has none: the proxy renders with Sleuth's ChatML
    cfg = agent_cfg.model_copy(update={"kind": "external", "entry": "examples.react_agent:answer",
                                       "max_new_tokens": 128, "max_total_tokens": 2000, "format_reward": 0.2})
    trajs = external_oracle_trajectories([FRANCE, EIFFEL], tok, cfg, TITLES)
    assert [t.question_id for t in trajs] == ["q0", "q1"]
    assert [[x.action for x in t.turns] for t in trajs] == [["search", "answer"], ["search", "search", "answer"]]
    assert [x.query for x in trajs[1].turns[:2]] == [EIFFEL.question, "Dijon"]
    assert all(t.metadata["segments"] == 1 and t.reward == 1.2 and t.verdict["em"] == 1.0 for t in trajs)
    text = decode(tok, trajs[1].token_ids)
    assert text.startswith("<|im_start|>system\nAnswer the user's question.") and "<tool_response>" in text
    policy = decode(tok, [i for i, r in zip(trajs[1].token_ids, trajs[1].roles, strict=True) if r == Role.POLICY])
    assert policy == ('<tool_call>\n{"name": "search", "arguments": {"query": "' + EIFFEL.question +
                      '"}}\n</tool_call><|endoftext|><tool_call>\n{"name": "search", "arguments": {"query": '
                      '"Dijon"}}\n</tool_call><|endoftext|><answer> Dijon </answer><|endoftext|>')
    tool = decode(tok, [i for i, r in zip(trajs[1].token_ids, trajs[1].roles, strict=True) if r == Role.TOOL])
    assert "Doc 2(Title: Gustave Eiffel) Gustave Eiffel was a French civil engineer born in Dijon." in tool
    assert "(Title: Dijon) Dijon is a city in eastern France, famous for its mustard." in tool
    batch = collate(trajs, tok.pad_token_id, 2000)  # SFT trains on the policy tokens only
    assert int(batch.loss_mask.sum()) == sum(r == Role.POLICY for t in trajs for r in t.roles)


def test_oracle_warm_start_of_an_agent_that_never_searches_is_refused(tiny_llm, agent_cfg, monkeypatch, tmp_path):
    from training.sft import external_oracle_trajectories

    (tmp_path / "lazy_agent.py").write_text(
        "async def answer(question, base_url):\n    return 'I do not know'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = agent_cfg.model_copy(update={"kind": "external", "entry": "lazy_agent:answer"})
    with pytest.raises(ValueError, match="solved none of 1 questions.*without calling the model"):
        external_oracle_trajectories([FRANCE], tiny_llm.tokenizer, cfg, TITLES)
    with pytest.raises(ValueError, match="needs agent.entry"):
        external_oracle_trajectories([FRANCE], tiny_llm.tokenizer, cfg.model_copy(update={"entry": None}))


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known: at this budget GRPO learns to answer without the tool (no sampled episode "
                   "is right, so the format reward favours a direct answer); bench/RESULTS.md, 'Your own agent'")
def test_the_react_example_learns_to_call_its_tool_through_the_cli(tmp_path, capsys):
    """`sleuth train --config configs/react_agent.yaml` on the synthetic task, small budget: the SFT warm start
    on the agent's own oracle episodes, then GRPO; the policy calls the tool in its rollouts and the training
    reward moves between the first and the last steps."""
    from corpora.synthetic import write
    from sleuth.cli import main

    data = write(tmp_path / "data")
    over = [f"out_dir={tmp_path}", f"retrieval.index_dir={tmp_path / 'index'}",
            *(f"data.{k}={p}" for k, p in data.items()), "sft.max_examples=30", "sft.epochs=40",
            "train.steps=6", "train.rollout.questions_per_step=4", "train.rollout.group_size=4",
            "train.checkpoints.save_every=3"]
    assert main(["train", "--config", "configs/react_agent.yaml", *over]) == 0
    sft = [json.loads(x) for x in (tmp_path / "oracle_trajectories.jsonl").read_text().splitlines()]
    assert len(sft) == 30 and all(t["verdict"]["em"] == 1.0 for t in sft)
    records = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["search_calls"] >= 0.5 and r["proxy_calls"] >= 16 for r in records), records  # it calls the tool
    assert len({round(r["reward"], 6) for r in records}) > 1 and any(r["adv_abs_mean"] > 0 for r in records)
    capsys.readouterr()


def _react_config(tmp_path, *extra: str):
    """configs/react_agent.yaml (the shipped example's run) on task v1 written under ``tmp_path``."""
    from corpora.synthetic import write
    from sleuth.config import load_config

    data = write(tmp_path / "data")
    return load_config("configs/react_agent.yaml", [
        f"out_dir={tmp_path / 'run'}", f"retrieval.index_dir={tmp_path / 'index'}",
        *(f"data.{k}={p}" for k, p in data.items()), *extra])


def _greedy_episodes(cfg, model, questions):
    from agent.external.runner import runner_for
    from sleuth.pipeline import load_llm

    with runner_for(load_llm(cfg, model), cfg.agent, temperature=0.0) as runner:
        return runner.run_episodes(questions, merge=True)


def test_the_examples_sft_warm_start_makes_the_untrained_policy_call_its_tool(tmp_path, monkeypatch):
    """The example's own warm start (sleuth.pipeline.run_sft_stage with configs/react_agent.yaml, a small
    budget): the untrained tiny policy never calls the agent's tool; after SFT on the agent's oracle episodes
    its first turn is one well-formed call of the agent's tool in the agent's template, as the proxy parses it."""
    import torch

    from agent.external.stitch import parse_tool_calls
    from corpora import read_qa
    from sleuth.pipeline import data_paths, ensure_index, run_sft_stage, sft_questions, tiny_policy_path

    cfg = _react_config(tmp_path, "sft.max_examples=3", "sft.epochs=100", "sft.batch_size=3", "sft.lr=1.0e-2",
                        "policy.tiny.tokenizer_texts=3000", "agent.max_new_tokens=72")
    retriever = ensure_index(cfg, log=lambda _: None)
    monkeypatch.setenv("SLEUTH_INDEX", cfg.retrieval.index_dir)  # the example's tool searches the run's index
    questions = sft_questions(read_qa(data_paths(cfg)["train"]), cfg.sft.max_examples)
    assert [q.metadata["hops"] for q in questions] == [1, 2, 3]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits for a busy core
    try:
        untrained = _greedy_episodes(cfg, tiny_policy_path(cfg, log=lambda _: None), questions)
        sft = _greedy_episodes(cfg, run_sft_stage(cfg, retriever, log=lambda _: None), questions)
    finally:
        torch.set_num_threads(threads)
    assert [t.num_search_calls for t in untrained] == [0] * 3  # nothing to learn from before the warm start
    for t in sft:
        first = t.turns[0]
        content, calls, error = parse_tool_calls(first.text.removesuffix("<|endoftext|>"))
        assert (first.action, content, error, len(calls)) == ("search", "", None, 1), first.text
        assert calls[0]["function"]["name"] == "search" and first.query
        assert json.loads(calls[0]["function"]["arguments"]) == {"query": first.query}


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "agent_learning.py"
    spec = importlib.util.spec_from_file_location("agent_learning_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_bootstrap_of_the_agent_learning_bench_pairs_seeds_and_questions():
    bench = _bench()

    def run(sft: list[float], rl: list[float]) -> dict:
        return {"sft": {"per_question": {"em": sft}}, "rl": {"per_question": {"em": rl}}}

    assert bench.paired_bootstrap([run([0.0] * 4, [1.0] * 4)] * 3, "em") == (1.0, 1.0, 1.0)
    d, lo, hi = bench.paired_bootstrap([run([0.0] * 40, [1.0] * 20 + [0.0] * 20), run([0.0] * 40, [0.0] * 40)], "em")
    # seeds +0.5 and 0: a quarter of the draws pick seed 2 twice (0 exactly), a quarter seed 1 twice (0.5 +- 0.16)
    assert d == 0.25 and lo == 0.0 and 0.5 < hi < 0.75
    with pytest.raises(ValueError, match="same non-empty questions"):
        bench.paired_bootstrap([run([0.0], [1.0]), run([0.0] * 2, [1.0] * 2)], "em")


def test_the_agent_learning_bench_runs_the_example_end_to_end_at_a_tiny_size(tmp_path, monkeypatch):
    """bench/agent_learning.py's plumbing: one seed of the example's CLI run at a tiny budget, the three
    evaluations on the same held-out questions, the JSON and the tables; a second call reads the seed back."""
    bench = _bench()
    monkeypatch.setenv("SLEUTH_INDEX", str(tmp_path / "work" / "index"))  # the example's tool: the run's index
    tiny = ["policy.tiny.tokenizer_texts=2000", "sft.max_examples=3", "sft.epochs=1", "sft.batch_size=3",
            "train.steps=1", "train.questions_per_step=2", "train.group_size=2", "train.save_every=1",
            "eval.limit=3", "agent.max_new_tokens=80"]
    args = ["--seeds", "0", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "res"),
            *(x for t in tiny for x in ("--set", t))]
    assert bench.main(args) == 0
    res = json.loads((tmp_path / "res" / "agent_learning.json").read_text())
    assert list(res["runs"]) == ["0"] and res["overrides"] == tiny
    r = res["runs"]["0"]
    assert r["steps"] == 1 and [k for k, _ in bench.STAGES] == ["init", "sft", "rl"]
    for k, _ in bench.STAGES:
        per = r[k]["per_question"]
        assert len(per["em"]) == len(per["reward"]) == len(per["searches"]) == 3
        assert r[k]["em"] == sum(per["em"]) / 3 and 0.0 <= r[k]["reward"] <= 1.1
    assert r["init"]["searches"] == 0.0  # the untrained policy never calls the tool
    md = (tmp_path / "res" / "agent_learning.md").read_text()
    assert md.startswith("3 held-out questions, 1 seed(s)") and "| untrained (before SFT) |" in md
    assert "- em, after RL - after SFT:" in md
    with pytest.raises(SystemExit, match="overrides"):  # runs of other settings are not mixed in
        bench.main(["--seeds", "1", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "res")])
    assert bench.main([*args, "--report"]) == 0
