"""The token record is exact for both tool protocols: every prompt the backend received is a prefix of the
recorded episode, the tokens it returned follow that prefix as policy tokens, and (function calling) the
decoded episode equals the chat template's rendering of the same conversation."""

from __future__ import annotations

import pytest

from agent.llm import decode
from agent.loop.batch import run_episodes
from agent.protocols import function_call
from agent.trajectory import Role
from corpora.formats import QAExample
from tests.test_agent_fakes import CHAT_TEMPLATE, Recorder, ScriptLLM

FRANCE = QAExample("q0", "What is the capital of France?", ["Paris"], {"supporting_ids": ["p0"]})
EIFFEL = QAExample("q1", "Where was the designer of the Eiffel Tower born?", ["Dijon"])
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'


def assert_exact(rec: Recorder, trajs) -> None:
    """Every backend call matches one trajectory: prompt == prefix, returned ids == the next policy tokens."""
    assert rec.prompts, "the backend was never called"
    for p, out in zip(rec.prompts, rec.outputs, strict=True):
        owners = [t for t in trajs if t.token_ids[: len(p)] == p and t.token_ids[len(p): len(p) + len(out)] == out]
        assert owners, "a prompt the policy saw is not a prefix of any recorded trajectory"
        t = owners[0]
        assert all(r == Role.POLICY for r in t.roles[len(p): len(p) + len(out)])
        assert len(p) == len(t) or t.roles[len(p)] == Role.POLICY
    # and every policy span of every trajectory came from a backend call
    n_policy_spans = sum(1 for t in trajs for k in range(len(t)) if t.roles[k] == Role.POLICY and (k == 0 or t.roles[k - 1] != Role.POLICY))
    assert n_policy_spans == sum(1 for o in rec.outputs if o)


def with_template(llm):
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    return llm


def test_search_r1_record_is_exact_with_real_sampling(tiny_llm, retriever, agent_cfg):
    rec = Recorder(tiny_llm)
    trajs = run_episodes([FRANCE, EIFFEL], rec, retriever, agent_cfg, n_samples=2, temperature=1.0, seed=3)
    assert len(trajs) == 4
    assert_exact(rec, trajs)
    assert sum(t.num_turns for t in trajs) == len(rec.prompts)


@pytest.mark.parametrize("eos", [True, False], ids=["model-ends-turn", "stopped-at-tool_call"])
def test_function_call_record_is_exact_and_matches_chat_template(tiny_llm, retriever, agent_cfg, eos):
    llm = with_template(tiny_llm)
    tok = llm.tokenizer
    cfg = agent_cfg.model_copy(update={"protocol": "function_call", "max_obs_tokens": 400, "max_doc_chars": 80, "max_new_tokens": 200,
                                     "max_total_tokens": 2000})
    rec = Recorder(ScriptLLM(tok, {"capital of France": [CALL, "<answer> Paris </answer>"]}, marker="<tool_response>", eos=eos))
    (t,) = run_episodes([FRANCE], rec, retriever, cfg, top_k=2)
    assert [x.action for x in t.turns] == ["search", "answer"], [x.error for x in t.turns]
    assert t.turns[0].query == "capital of France" and t.answer == "Paris" and t.reward == 1.0
    assert "p0" in t.retrieved_ids
    assert_exact(rec, [t])
    # the decoded record is the chat template's rendering of the same conversation
    conv = function_call.messages(FRANCE.question) + [
        {"role": "assistant", "content": t.turns[0].text},
        {"role": "tool", "content": t.turns[0].observation},
        {"role": "assistant", "content": t.turns[1].text},
    ]
    rendered = tok.apply_chat_template(conv, tools=function_call.TOOLS, tokenize=False)
    assert decode(tok, t.token_ids) == (rendered.removesuffix("\n") if eos else rendered.removesuffix("<|endoftext|>\n"))
    tool = decode(tok, [i for i, r in zip(t.token_ids, t.roles) if r == Role.TOOL])
    assert "<tool_response>\nDoc 1(Title: Paris)" in tool and tool.endswith("<|im_start|>assistant\n")
    # the end-of-turn token is a policy token when the model wrote it, a tool (template) token otherwise
    end = max(k for k in range(len(t)) if t.roles[k] == Role.POLICY and t.turn_ids[k] == 1)
    if eos:
        assert t.token_ids[end] == tok.eos_token_id and t.roles[end + 1] == Role.TOOL
    else:
        assert t.token_ids[end] != tok.eos_token_id and t.token_ids[end + 1] == tok.eos_token_id
        assert t.roles[end + 1] == Role.TOOL


def test_function_call_malformed_calls_become_tool_errors(tiny_llm, retriever, agent_cfg):
    llm = with_template(tiny_llm)
    cfg = agent_cfg.model_copy(update={"protocol": "function_call", "max_turns": 5})
    bad = ['<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>',
           '<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>',
           '<tool_call>{"name": "search", "arguments": {"query": ""}}</tool_call>',
           '<tool_call>{"name": "search", "arguments": {"query": "' + "x" * 150 + '"}}</tool_call>',
           "<answer> Paris </answer>"]
    rec = Recorder(ScriptLLM(llm.tokenizer, {"capital of France": bad}, marker="<tool_response>", eos=True))
    cfg = cfg.model_copy(update={"max_new_tokens": 400, "max_total_tokens": 8000, "max_query_chars": 100})
    (t,) = run_episodes([FRANCE], rec, None, cfg)
    errors = [x.error for x in t.turns[:4]]
    assert "not valid JSON" in errors[0] and "unknown tool 'lookup'" in errors[1]
    assert "non-empty" in errors[2] and "exceeds 100" in errors[3]
    assert t.turns[0].observation.startswith("Error: invalid action") and t.answer == "Paris"
    assert_exact(rec, [t])


def test_function_call_with_real_tiny_policy_is_exact(tiny_llm, retriever, agent_cfg):
    llm = with_template(tiny_llm)
    cfg = agent_cfg.model_copy(update={"protocol": "function_call"})
    rec = Recorder(llm)
    trajs = run_episodes([FRANCE, EIFFEL], rec, retriever, cfg, n_samples=2, temperature=1.0, seed=0)
    assert_exact(rec, trajs)
    assert all(t.stop_reason in ("answer", "max_turns", "max_tokens") for t in trajs)


# Qwen3's template, reduced to what matters here: the last assistant message gets a (possibly empty) think block,
# an earlier one only when it reasoned, so a bare assistant turn renders differently once a tool message follows
QWEN3_LIKE = CHAT_TEMPLATE.replace(
    "{%- elif m.role != 'system' %}",
    "{%- elif m.role == 'assistant' %}{%- set r, c = '', m.content %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.last or r %}{{ '<|im_start|>assistant\\n<think>\\n' + r + '\\n</think>\\n\\n' + c + '<|endoftext|>\\n' }}"
    "{%- else %}{{ '<|im_start|>assistant\\n' + c + '<|endoftext|>\\n' }}{%- endif %}"
    "{%- elif m.role != 'system' %}")


def test_function_call_works_with_a_qwen3_style_think_template(tiny_llm, retriever, agent_cfg):
    """Qwen3's template adds an empty think block to the last assistant message only; the tool framing is
    still found (the probe's turn reasons), and the record stays exact."""
    tok = tiny_llm.tokenizer
    tok.chat_template = QWEN3_LIKE
    bare = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert "<think>" in tok.apply_chat_template(bare, tokenize=False)  # the template really does this
    tt = function_call.ToolTemplate.of(tok)
    assert (tt.close, tt.before, tt.after) == ("<|endoftext|>\n", "<|im_start|>user\n<tool_response>\n",
                                               "\n</tool_response><|endoftext|>\n<|im_start|>assistant\n")
    cfg = agent_cfg.model_copy(update={"protocol": "function_call", "max_obs_tokens": 400, "max_doc_chars": 80,
                                     "max_new_tokens": 200, "max_total_tokens": 2000})
    think_call = "<think>\nI should look it up.\n</think>\n\n" + CALL
    rec = Recorder(ScriptLLM(tok, {"capital of France": [think_call, "<answer> Paris </answer>"]},
                             marker="<tool_response>", eos=True))
    (t,) = run_episodes([FRANCE], rec, retriever, cfg, top_k=2)
    assert [x.action for x in t.turns] == ["search", "answer"], [x.error for x in t.turns]
    assert t.answer == "Paris" and t.turns[0].query == "capital of France"
    assert_exact(rec, [t])


def test_function_call_needs_a_chat_template(tiny_llm, retriever, agent_cfg):
    """Sleuth's own error, naming the fix (`sleuth ask ... agent.protocol=function_call` on the tiny policy
    showed transformers' 'Cannot use chat template functions ...' instead)."""
    tiny_llm.tokenizer.chat_template = None
    cfg = agent_cfg.model_copy(update={"protocol": "function_call"})
    with pytest.raises(ValueError, match="use agent.protocol=search_r1"):
        run_episodes([FRANCE], tiny_llm, retriever, cfg)


def test_self_judge_is_recorded_and_rewarded(tiny_llm, retriever, agent_cfg):
    cfg = agent_cfg.model_copy(update={"self_judge": True, "self_judge_reward": 0.5, "max_new_tokens": 64,
                                     "max_turns": 4})
    llm = ScriptLLM(tiny_llm.tokenizer, {
        "capital of France": ["<search> capital of France </search>", "<judge>useful</judge> <answer> Paris </answer>"],
        "Eiffel Tower": ["<search> Rhine river </search>", "<judge>useful</judge><search> Eiffel designer </search>",
                         "<judge>maybe</judge><answer> Dijon </answer>", "<answer> Dijon </answer>"],
    })
    t1, t2 = run_episodes([FRANCE, EIFFEL], llm, retriever, cfg, top_k=1)
    assert t1.turns[1].judgement == "useful" and t1.verdict["self_judge_acc"] == 1.0 and t1.reward == 1.5
    # "useful" for a block without the answer disagrees with the gold; a malformed judge is an invalid action
    assert t2.turns[1].judgement == "useful" and t2.verdict["self_judge_acc"] == 0.0
    assert t2.turns[2].action == "invalid" and "must be 'useful' or 'not useful'" in t2.turns[2].error
    assert t2.answer == "Dijon" and t2.reward == 1.0


def test_function_call_with_self_judge_tells_the_policy_to_judge(tiny_llm, agent_cfg):
    """agent.self_judge adds ReSeek's <judge> instruction to the Search-R1 prompt; with function calling the
    system message never mentioned it, so an instruct policy was never asked to judge (no self-judge reward)."""
    from agent.protocols.build import prompt_ids

    tok = with_template(tiny_llm).tokenizer
    cfg = agent_cfg.model_copy(update={"protocol": "function_call"})
    plain = decode(tok, prompt_ids(tok, FRANCE.question, cfg))
    judged = decode(tok, prompt_ids(tok, FRANCE.question, cfg.model_copy(update={"self_judge": True})))
    assert "<judge>" not in plain and "<judge> and </judge> as useful or not useful" in judged


def test_max_obs_tokens_must_leave_room_past_the_observation_framing(tiny_llm, agent_cfg):
    """``max_obs_tokens`` no larger than the ``<information>`` framing would end every episode at its first
    search (as ``max_tokens``); making the context says so instead."""
    from agent.llm import encode
    from agent.loop.nodes import make_context

    tok = tiny_llm.tokenizer
    frame = len(encode(tok, "\n\n<information>")) + len(encode(tok, "</information>\n\n"))
    with pytest.raises(ValueError, match=f"max_obs_tokens={frame} leaves no room.*takes {frame} tokens"):
        make_context(tiny_llm, None, agent_cfg.model_copy(update={"max_obs_tokens": frame}))
    assert make_context(tiny_llm, None, agent_cfg.model_copy(update={"max_obs_tokens": frame + 1})).top_k == 3


def test_a_cut_observation_is_recorded_as_the_policy_saw_it(tiny_llm, retriever, agent_cfg):
    """An observation cut to ``max_obs_tokens`` is recorded as the cut text (what the policy read), so the
    self-judge is scored against it: "not useful" for a block whose answer was cut off agrees."""
    from agent.llm import encode

    tok = tiny_llm.tokenizer
    frame = len(encode(tok, "\n\n<information>")) + len(encode(tok, "</information>\n\n"))
    cfg = agent_cfg.model_copy(update={"self_judge": True, "self_judge_reward": 0.5, "max_new_tokens": 64,
                                     "max_obs_tokens": frame + 6})
    llm = ScriptLLM(tok, {"Eiffel Tower": ["<search> Gustave Eiffel born </search>",
                                           "<judge>not useful</judge><answer> Dijon </answer>"]})
    (t,) = run_episodes([EIFFEL], llm, retriever, cfg, top_k=1)
    turn = t.turns[0]
    assert turn.hit_ids == ["p3"] and turn.n_tool_tokens == frame + 6
    tool_ids = [i for i, r, k in zip(t.token_ids, t.roles, t.turn_ids, strict=True) if r == Role.TOOL and k == 1]
    assert turn.observation == decode(tok, tool_ids[len(encode(tok, "\n\n<information>")):-len(encode(tok, "</information>\n\n"))])
    assert "Dijon" not in turn.observation
    assert t.verdict["self_judge_acc"] == 1.0 and t.reward == 1.5


class EndsWith(ScriptLLM):
    """A scripted chat model with two end-of-turn ids (``eos_ids``, as Qwen2.5-Instruct's generation config
    lists ``<|im_end|>`` and ``<|endoftext|>``) that ends every turn with ``end_id``."""

    def __init__(self, tokenizer, scripts, end_id: int, eos_ids: set[int]):
        super().__init__(tokenizer, scripts, marker="<tool_response>")
        self.end_id, self.eos_ids = end_id, eos_ids

    def generate(self, prompts, params):
        return [type(g)(g.token_ids + [self.end_id], g.text, "stop") for g in super().generate(prompts, params)]


@pytest.mark.parametrize("case", ["ends-with-template-close", "ends-with-other-eos"])
def test_function_call_turn_close_follows_the_end_token_the_policy_wrote(tiny_llm, retriever, agent_cfg, case):
    """The template closes an assistant turn with <|endoftext|> (id 0); the backend ends turns at 0 or 1.
    A turn that ended with the close token gets no second one; a turn that ended with the other end-of-turn
    token still gets the template's close, whatever the tokenizer's own ``eos_token`` is."""
    llm = with_template(tiny_llm)
    tok = llm.tokenizer
    close_id, other_id = 0, 1
    assert tok.convert_ids_to_tokens([close_id, other_id]) == ["<|endoftext|>", "<|pad|>"]
    if case == "ends-with-template-close":
        tok.eos_token = "<|pad|>"  # the tokenizer's eos is not the template's turn close
    end_id = close_id if case == "ends-with-template-close" else other_id
    cfg = agent_cfg.model_copy(update={"protocol": "function_call", "max_obs_tokens": 400, "max_doc_chars": 80,
                                     "max_new_tokens": 200, "max_total_tokens": 2000})
    policy = EndsWith(tok, {"capital of France": [CALL, "<answer> Paris </answer>"]}, end_id, {close_id, other_id})
    (t,) = run_episodes([FRANCE], policy, retriever, cfg, top_k=2)
    assert [x.action for x in t.turns] == ["search", "answer"], [x.error for x in t.turns]
    text = decode(tok, t.token_ids)
    if case == "ends-with-template-close":
        assert "</tool_call><|endoftext|>\n<|im_start|>user\n<tool_response>" in text
    else:
        assert "</tool_call><|pad|><|endoftext|>\n<|im_start|>user\n<tool_response>" in text


def test_self_judge_gold_is_looked_for_in_the_documents_not_in_their_doc_labels():
    """A small-number gold ("2": how many ...?) is in every block's "Doc 2(Title: ...)" label; a block whose
    documents never say it is not useful, and "not useful" agrees with the gold."""
    from agent.judges import self_judge_agreement
    from agent.protocols.base import format_docs
    from agent.trajectory import Trajectory, Turn
    from retrieval.base import Hit

    obs = format_docs([Hit("a", "Phobos", "Phobos\nPhobos is a moon of Mars.", 1.0),
                       Hit("b", "Deimos", "Deimos\nDeimos is a moon of Mars.", 0.5)])
    def traj(golds, judgement):
        return Trajectory("q", "How many moons does Mars have?", golds, turns=[
            Turn(1, "<search> Mars moons </search>", "search", query="Mars moons", observation=obs),
            Turn(2, f"<judge>{judgement}</judge><answer> 2 </answer>", "answer", answer="2", judgement=judgement)])

    assert self_judge_agreement(traj(["2"], "not useful")) == (1, 1)
    assert self_judge_agreement(traj(["two", "2"], "useful")) == (0, 1)
    assert self_judge_agreement(traj(["Phobos"], "useful")) == (1, 1)  # titles and texts still count
    assert self_judge_agreement(traj(["Deimos"], "useful")) == (1, 1)
