"""LLM-as-judge: prompt, parsed verdicts, the unparseable policy, and the per-episode reward record."""

from __future__ import annotations

import pytest

from agent.judges import judge_batch, judge_prompt, llm_judge, parse_verdict
from agent.llm import Generation, encode
from agent.loop.batch import run_episodes
from agent.trajectory import Trajectory
from tests.test_agent_exactness import FRANCE
from tests.test_agent_fakes import ScriptLLM


class ReplyLLM:
    """Answers every judge prompt by a rule on the prompt text; records the batch sizes."""

    def __init__(self, tokenizer, rule):
        self.tokenizer, self.rule, self.batches = tokenizer, rule, []

    def generate(self, prompts, params):
        from agent.llm import decode

        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            text = self.rule(decode(self.tokenizer, p))
            out.append(Generation(encode(self.tokenizer, text), text))
        return out


def _traj(answer, golds=("Paris",)):
    return Trajectory("q", "What is the capital of France?", list(golds), answer=answer)


def test_parse_verdict():
    assert parse_verdict("VERDICT: correct") is True
    assert parse_verdict("Reasoning...\nverdict: **Incorrect**") is False
    assert parse_verdict("yes, it matches") is True and parse_verdict("No.") is False
    assert parse_verdict("I think so") is None and parse_verdict("") is None


def test_a_verdict_line_in_markdown_or_quotes_is_parsed():
    # instruct judges bold the label or quote the word; the line still says VERDICT: <word>
    assert parse_verdict("**VERDICT**: correct") is True and parse_verdict("**Verdict:** incorrect") is False
    assert parse_verdict('VERDICT: "correct"') is True and parse_verdict("__VERDICT__: incorrect") is False
    assert parse_verdict("**VERDICT**: correct or **VERDICT**: incorrect") is None


def test_a_reply_that_echoes_both_verdicts_is_unparseable_not_correct():
    # a small judge often parrots the instruction's last line; that says nothing about the answer
    assert parse_verdict("VERDICT: correct or VERDICT: incorrect") is None
    assert parse_verdict("verdict: incorrect / verdict: correct") is None
    assert parse_verdict("correct or incorrect") is None
    # a verdict line after reasoning that names the other word is still that verdict
    assert parse_verdict("Not correct.\nVERDICT: incorrect") is False
    assert parse_verdict("VERDICT: correct\nVERDICT: incorrect") is True  # the first verdict line


def test_prompt_has_question_golds_and_prediction():
    p = judge_prompt("Q?", ["a", "b"], "the  city\nof light")
    assert "Question: Q?" in p and "Reference answers: a; b" in p and "Predicted answer: the city of light" in p


def test_batch_judge_records_and_policies(tiny_llm):
    def rule(prompt):
        if "City of Light" in prompt:
            return "VERDICT: correct"
        if "Lyon" in prompt:
            return "VERDICT: incorrect"
        return "hmm, hard to say"

    llm = ReplyLLM(tiny_llm.tokenizer, rule)
    trajs = [_traj("the City of Light"), _traj("Lyon"), _traj("paris"), _traj(None)]
    res = judge_batch(llm, trajs, unparseable="zero")
    assert llm.batches == [3]  # one call; the unanswered episode is not sent
    assert [r for r, _ in res] == [1.0, 0.0, 0.0, 0.0]
    assert [v["llm_verdict"] for _, v in res] == ["correct", "incorrect", "unparseable", "no_answer"]
    assert res[2][1]["llm_raw"] == "hmm, hard to say" and res[0][1]["em"] == 0.0  # rules could not score it
    # policy "rule": an unparseable verdict falls back to EM ("paris" == gold)
    res = judge_batch(llm, trajs, unparseable="rule")
    assert [r for r, _ in res] == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        judge_batch(llm, trajs, unparseable="maybe")


def test_backend_error_is_judged_by_policy(tiny_llm):
    class Broken:
        tokenizer = tiny_llm.tokenizer

        def generate(self, prompts, params):
            raise TimeoutError("judge timed out")

    (r, v), = judge_batch(Broken(), [_traj("paris")], unparseable="rule")
    assert r == 1.0 and v["llm_verdict"] == "error" and "timed out" in v["llm_raw"]


def test_llm_judge_in_the_agent_loop(tiny_llm, retriever, agent_cfg):
    policy = ScriptLLM(tiny_llm.tokenizer, {"capital of France": ["<answer> the City of Light </answer>"]})
    judge_llm = ReplyLLM(tiny_llm.tokenizer, lambda p: "VERDICT: correct" if "City of Light" in p else "VERDICT: incorrect")
    (t,) = run_episodes([FRANCE], policy, retriever, agent_cfg, judge=llm_judge(judge_llm, format_reward=0.1))
    assert t.verdict["em"] == 0.0 and t.verdict["llm_correct"] == 1.0 and t.reward == pytest.approx(1.1)


def test_config_judge_llm_uses_the_policy_backend(tiny_llm, retriever, agent_cfg):
    # one scripted backend answers both the policy turns and the judge prompt
    both = ScriptLLM(tiny_llm.tokenizer, {"Predicted answer": ["VERDICT: incorrect"],
                                          "capital of France": ["<answer> Paris </answer>"]})
    cfg = agent_cfg.model_copy(update={"judge": "llm"})
    (t,) = run_episodes([FRANCE], both, retriever, cfg)
    assert t.verdict["em"] == 1.0 and t.verdict["llm_verdict"] == "incorrect" and t.reward == 0.0


def test_vllm_backend_serialises_calls_from_the_judge_and_the_scheduler(tiny_llm, monkeypatch):
    """``agent.judge: llm`` judges with the policy backend in a worker thread while the scheduler's thread
    generates. vLLM's offline ``LLM`` is not thread-safe: ``generate`` steps the one engine until it is
    idle and returns *every* request that finished, its own and another thread's. The fake engine below
    does the same; each caller must still get exactly its own continuations."""
    import threading
    import time
    import types

    from agent.llm import SamplingParams, decode
    from tests.test_backends_vllm_fake import install_fake_vllm

    tok = tiny_llm.tokenizer

    class Engine:  # vllm.LLM: one shared request pool
        def __init__(self, **kw):
            self.pending = []

        def get_tokenizer(self):
            return tok

        def generate(self, reqs, sps, use_tqdm=False):
            self.pending.extend(reqs)
            time.sleep(0.2)  # the engine steps; another thread may add requests meanwhile
            done, self.pending = self.pending, []
            out = types.SimpleNamespace
            return [out(outputs=[out(token_ids=list(r["prompt_token_ids"]), logprobs=None, finish_reason="length")])
                    for r in done]

    install_fake_vllm(monkeypatch, Engine)
    from agent.backends.vllm import VLLMBackend

    backend = VLLMBackend("fake")
    prompts = {name: [encode(tok, f"{name} prompt {i}") for i in range(n)] for name, n in (("judge", 1), ("policy", 3))}
    got: dict[str, list] = {}

    def call(name):
        try:
            got[name] = backend.generate(prompts[name], SamplingParams(max_new_tokens=16, stop=()))
        except Exception as e:  # noqa: BLE001
            got[name] = e

    threads = [threading.Thread(target=call, args=(name,)) for name in prompts]
    for th in threads:
        th.start()
        time.sleep(0.05)
    for th in threads:
        th.join()
    for name, ps in prompts.items():
        assert [decode(tok, g.token_ids) for g in got[name]] == [decode(tok, p) for p in ps], name


def test_config_judge_llm_keeps_the_self_judge_reward(tiny_llm, retriever, agent_cfg):
    # agent.judge=llm with ReSeek's self-judge: the agreeing self-judgement is rewarded as with the rule judge
    both = ScriptLLM(tiny_llm.tokenizer, {"Predicted answer": ["VERDICT: correct"], "capital of France": [
        "<search> capital of France </search>", "<judge>useful</judge> <answer> Paris </answer>"]})
    cfg = agent_cfg.model_copy(update={"judge": "llm", "self_judge": True, "self_judge_reward": 0.5,
                                       "max_new_tokens": 64})
    (t,) = run_episodes([FRANCE], both, retriever, cfg, top_k=1)
    assert t.turns[1].judgement == "useful" and t.verdict["llm_verdict"] == "correct"
    assert t.verdict["self_judge_acc"] == 1.0 and t.verdict["self_judgements"] == 1 and t.reward == 1.5


def test_a_bare_verdict_contradicted_on_its_line_is_unparseable():
    """A bare leading "yes"/"no" was taken as the verdict even when the same line said the opposite ("Yes,
    but incorrect" scored correct); a first line with both a positive and a negative verdict word is now
    unparseable, like a ``VERDICT:`` line with both."""
    assert parse_verdict("Yes, but incorrect.") is None
    assert parse_verdict("No - it is correct") is None
    assert parse_verdict("Yes, the answer is correct.") is True and parse_verdict("No, incorrect.") is False
    assert parse_verdict("Yes.\nAn incorrect guess would differ.") is True  # only the first line counts
