"""The episode judges (agent.judges), value by value: the rule judge's reward (metric + format reward, the
format reward only for a well-formed episode that answered), ReSeek's self-judge term, the LLM judge's verdict
parsing, options, batching and unparseable policy. Fast: a character-level fake tokenizer, no model."""

from __future__ import annotations

import pytest

from agent.judges import (
    check_judge_options,
    configured_judge,
    judge_answers,
    judge_batch,
    judge_prompt,
    llm_judge,
    parse_verdict,
    rule_judge,
    self_judge_agreement,
    with_self_judge,
)
from agent.llm import Generation
from agent.trajectory import Trajectory, Turn

OBS_PARIS = "Doc 1(Title: Paris) Paris is the capital of France."
OBS_BERLIN = "Doc 1(Title: Berlin) Berlin is the capital of Germany."


class CharTokenizer:
    """One token per character (code point), enough for :func:`agent.llm.complete`."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


class ReplyLLM:
    """Answers each judge prompt with ``rule(prompt_text)``; records the prompts and sampling params of each call."""

    def __init__(self, rule):
        self.tokenizer, self.rule, self.calls = CharTokenizer(), rule, []

    def generate(self, prompts, params):
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.calls.append((texts, params))
        return [Generation(self.tokenizer.encode(r), r) for r in (self.rule(t) for t in texts)]


class FailingLLM:
    tokenizer = CharTokenizer()

    def generate(self, prompts, params):
        raise RuntimeError("judge server down")


def episode(answer, turns=(), golds=("Paris",), question="What is the capital of France?"):
    return Trajectory("q0", question, list(golds), answer=answer, turns=list(turns))


def answered(error=None):
    """A search turn (with ``error`` if malformed) then the answer turn."""
    return [Turn(1, "<search> x </search>", "search" if error is None else "invalid", error=error,
                 observation=OBS_PARIS), Turn(2, "<answer> Paris </answer>", "answer", answer="Paris")]


# -- the rule judge ------------------------------------------------------------------------------------
def test_rule_judge_adds_the_format_reward_only_to_a_well_formed_answered_episode():
    judge = rule_judge("em", format_reward=0.25)
    reward, v = judge(episode("Paris", answered()))
    assert reward == 1.25 and v == {"em": 1.0, "f1": 1.0, "cover_em": 1.0, "format_ok": True}
    reward, v = judge(episode("Paris", answered(error="unclosed <search> tag")))  # malformed: no format reward
    assert reward == 1.0 and v["format_ok"] is False and v["em"] == 1.0
    reward, v = judge(episode("Lyon", answered()))  # wrong but well formed: the format reward alone
    assert reward == 0.25 and v == {"em": 0.0, "f1": 0.0, "cover_em": 0.0, "format_ok": True}
    reward, v = judge(episode(None, answered()[:1]))  # no answer: nothing, not even the format reward
    assert reward == 0.0 and v == {"em": 0.0, "f1": 0.0, "cover_em": 0.0, "format_ok": False}
    reward, v = judge(episode("Paris", []))  # an answer with no recorded turn is well formed
    assert reward == 1.25 and v["format_ok"] is True


def test_rule_judge_rewards_the_chosen_metric():
    ep = episode("Paris France", answered())  # EM 0, F1 2/3 (precision 1/2, recall 1), cover-EM 1
    assert rule_judge("em")(ep)[0] == 0.0
    assert rule_judge("f1")(ep)[0] == pytest.approx(2 / 3)
    assert rule_judge("cover_em")(ep)[0] == 1.0
    assert rule_judge("f1", format_reward=0.5)(ep)[0] == pytest.approx(2 / 3 + 0.5)
    assert rule_judge("em")(episode("Paris", answered(error="bad")))[0] == 1.0  # format_reward 0: EM alone


# -- ReSeek's self-judge ---------------------------------------------------------------------------------
def self_judged(first, second):
    """Two searches (Paris's document, then Berlin's), each judged by the next turn (``first``, ``second``)."""
    return episode("Paris", [
        Turn(1, "", "search", query="capital", observation=OBS_PARIS),
        Turn(2, "", "search", query="capital", observation=OBS_BERLIN, judgement=first),
        Turn(3, "", "answer", answer="Paris", judgement=second),
    ])


def test_self_judge_agreement_counts_ratings_against_the_documents():
    assert self_judge_agreement(self_judged("useful", "not useful")) == (2, 2)
    assert self_judge_agreement(self_judged("not useful", "useful")) == (0, 2)
    assert self_judge_agreement(self_judged("useful", "useful")) == (1, 2)
    assert self_judge_agreement(self_judged(None, "not useful")) == (1, 1)
    assert self_judge_agreement(episode("Paris", answered())) == (0, 0)  # no rating
    # a rating after a turn that did not search, or whose search has no observation, is not counted
    for action in ("invalid", "tool", "answer"):
        t = episode("Paris", [Turn(1, "", action, observation="Paris"), Turn(2, "", "answer", judgement="useful")])
        assert self_judge_agreement(t) == (0, 0), action
    t = episode("Paris", [Turn(1, "", "search", observation=None), Turn(2, "", "answer", judgement="useful")])
    assert self_judge_agreement(t) == (0, 0)
    # the "Doc i(Title: " label is not evidence: a gold answer "Doc" is not found in the label
    t = episode("Doc", [Turn(1, "", "search", observation=OBS_PARIS), Turn(2, "", "answer", judgement="not useful")],
                golds=("Doc",))
    assert self_judge_agreement(t) == (1, 1)
    # an empty gold answer (normalised to nothing) matches nothing
    t = episode("x", [Turn(1, "", "search", observation=OBS_PARIS), Turn(2, "", "answer", judgement="not useful")],
                golds=("the",))
    assert self_judge_agreement(t) == (1, 1)


def test_with_self_judge_adds_the_weighted_agreement_and_records_it():
    judge = rule_judge("em", format_reward=0.0, self_judge_reward=0.5)
    reward, v = judge(self_judged("useful", "useful"))
    assert reward == 1.0 + 0.5 * 1 / 2 and v["self_judge_acc"] == 0.5 and v["self_judgements"] == 2
    reward, v = judge(episode("Paris", answered()))  # no self-judgement: no term, no record
    assert reward == 1.0 and "self_judge_acc" not in v and "self_judgements" not in v
    reward, v = judge(self_judged("useful", "not useful"))  # both agree
    assert reward == 1.0 + 0.5 * 2 / 2 and v["self_judge_acc"] == 1.0
    # the defaults: no self-judge term, no format reward
    assert rule_judge()(self_judged("useful", "not useful"))[0] == 1.0
    assert rule_judge("em", 0.25)(self_judged("useful", "not useful"))[0] == 1.25
    assert with_self_judge(lambda t: (0.0, {}))(self_judged("useful", "not useful"))[0] == 0.0

    def blocking(traj):
        return 0.0, {}

    blocking.blocking = True
    assert with_self_judge(blocking, 1.0).blocking is True
    assert with_self_judge(lambda t: (0.0, {}), 1.0).blocking is False


# -- the LLM judge -------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply,want", [
    ("VERDICT: correct", True),
    ("**Correct**", True),  # the verdict word, not the emphasis around it
    (" yes", True),
    ("Yes\nbut incorrect", True),  # only the first line of a bare verdict counts
    ("Yes, incorrect\nfine", None),
    ("VERDICT: incorrect", False),
    ("verdict = Incorrect", False),
    ('**VERDICT**: "correct"', True),
    ("I think so.\nVERDICT: correct\n", True),
    ("VERDICT: correct or VERDICT: incorrect", None),  # the instruction echoed back
    ("VERDICT: correct\nVERDICT: incorrect", True),  # the first verdict line counts
    ("Correct.", True),
    ("yes", True),
    ("No, it is Lyon.", False),
    ("incorrect", False),
    ("Yes, but incorrect", None),
    ("correctly", None),
    ("The answer is correct", None),  # a verdict word, but not leading
    ("", None),
    (None, None),
])
def test_parse_verdict(reply, want):
    assert parse_verdict(reply) is want


def test_judge_prompt_is_exact():
    assert judge_prompt("  What is\nthe capital? ", [" Paris ", "City of Light"], "Paris  ,\n France") == (
        "You are grading an answer to a question against the reference answers.\n"
        "Question: What is the capital?\n"
        "Reference answers: Paris; City of Light\n"
        "Predicted answer: Paris , France\n"
        "Is the predicted answer correct (same meaning as a reference answer)? "
        "Reply with exactly one line: VERDICT: correct or VERDICT: incorrect\n")
    assert "Reference answers: (none)\n" in judge_prompt("q", [], "p")


def test_check_judge_options_both_sides():
    check_judge_options("zero", "em", 1)
    check_judge_options("rule", "cover_em", 16)
    check_judge_options("rule", "f1", 1)
    for bad, match in ((("never", "em", 1), "unparseable policy"), (("zero", "acc", 1), "fallback_metric"),
                       (("zero", "em", 0), "max_new_tokens"), (("zero", "em", True), "max_new_tokens"),
                       (("zero", "em", 1.5), "max_new_tokens")):
        with pytest.raises(ValueError, match=match):
            check_judge_options(*bad)


def _rule(text):
    pred = text.split("Predicted answer: ")[1].split("\n")[0]
    return {"Paris": "VERDICT: correct", "Lyon": "VERDICT: incorrect"}.get(pred, "hmm")


def test_judge_answers_one_greedy_batch_and_the_unparseable_policy():
    llm = ReplyLLM(_rule)
    qs, golds = ["q"] * 5, [["Paris"]] * 5
    preds = ["Paris", "Lyon", "Paris France", None, "  "]
    out = judge_answers(llm, qs, golds, preds, unparseable="zero", max_new_tokens=7)
    assert out == [
        {"llm_correct": 1.0, "llm_verdict": "correct", "llm_raw": "VERDICT: correct"},
        {"llm_correct": 0.0, "llm_verdict": "incorrect", "llm_raw": "VERDICT: incorrect"},
        {"llm_correct": 0.0, "llm_verdict": "unparseable", "llm_raw": "hmm"},
        {"llm_correct": 0.0, "llm_verdict": "no_answer", "llm_raw": None},
        {"llm_correct": 0.0, "llm_verdict": "no_answer", "llm_raw": None},
    ]
    (prompts, params), = llm.calls  # one batch of the three answered, greedy, within max_new_tokens
    assert len(prompts) == 3 and params.temperature == 0.0 and params.max_new_tokens == 7
    assert params.stop == ("\n\n",)
    rule = judge_answers(llm, qs, golds, preds, unparseable="rule", fallback_metric="cover_em")
    assert [r["llm_correct"] for r in rule] == [1.0, 0.0, 1.0, 0.0, 0.0]  # cover-EM of "Paris France": 1
    assert rule[2]["llm_verdict"] == "unparseable"
    f1 = judge_answers(llm, qs, golds, preds, unparseable="rule", fallback_metric="f1")
    assert f1[2]["llm_correct"] == pytest.approx(2 / 3)
    assert judge_answers(llm, [], [], []) == [] and len(llm.calls) == 3  # nothing to judge: no call
    for q, g, p in ((1, 0, 1), (1, 1, 0), (1, 1, 2), (2, 1, 1), (1, 2, 2)):
        with pytest.raises(ValueError, match="parallel lists"):
            judge_answers(llm, ["q"] * q, [["Paris"]] * g, ["Paris"] * p)
    judge_answers(llm, ["q"], [["Paris"]], ["Paris"])
    assert llm.calls[-1][1].max_new_tokens == 16  # the default verdict length


def test_a_backend_failure_or_a_short_reply_list_is_an_error_judged_by_the_policy():
    out = judge_answers(FailingLLM(), ["q", "q"], [["Paris"], ["Paris"]], ["Paris", None], unparseable="rule")
    assert out[0] == {"llm_correct": 1.0, "llm_verdict": "error", "llm_raw": "RuntimeError: judge server down"}
    assert out[1]["llm_verdict"] == "no_answer"
    assert judge_answers(FailingLLM(), ["q"], [["Paris"]], ["Paris"])[0]["llm_correct"] == 0.0

    class Short(ReplyLLM):
        def generate(self, prompts, params):
            return super().generate(prompts, params)[:-1]

    out = judge_answers(Short(_rule), ["q", "q"], [["Paris"]] * 2, ["Paris", "Lyon"])
    assert [o["llm_verdict"] for o in out] == ["error", "error"]
    assert out[0]["llm_raw"] == "RuntimeError: judge backend returned 1 replies for 2 prompts"

    class Long(ReplyLLM):
        def generate(self, prompts, params):
            return super().generate(prompts + prompts[:1], params)

    out = judge_answers(Long(_rule), ["q"], [["Paris"]], ["Paris"])
    assert out[0]["llm_raw"] == "RuntimeError: judge backend returned 2 replies for 1 prompts"

    class Says(FailingLLM):  # an error message that reads like a verdict is still an error
        def generate(self, prompts, params):
            raise RuntimeError("VERDICT: correct")

    assert judge_answers(Says(), ["q"], [["Lyon"]], ["Paris"])[0] == {
        "llm_correct": 0.0, "llm_verdict": "error", "llm_raw": "RuntimeError: VERDICT: correct"}


def test_judge_batch_and_llm_judge_reward_and_format():
    llm = ReplyLLM(_rule)
    trajs = [episode("Paris", answered()), episode("Paris", answered(error="bad")), episode("Lyon", answered()),
             episode(None, [])]
    out = judge_batch(llm, trajs, format_reward=0.5)
    assert [r for r, _ in out] == [1.5, 1.0, 0.5, 0.0]
    assert [v["format_ok"] for _, v in out] == [True, False, True, False]
    assert out[0][1] == {"em": 1.0, "f1": 1.0, "cover_em": 1.0, "format_ok": True, "llm_correct": 1.0,
                         "llm_verdict": "correct", "llm_raw": "VERDICT: correct"}
    assert len(llm.calls) == 1  # one batch
    judge = llm_judge(llm, format_reward=0.5, max_new_tokens=3)
    assert judge.blocking is True
    assert judge(trajs[1])[0] == 1.0 and llm.calls[-1][1].max_new_tokens == 3
    # the defaults: no format reward, 16 tokens per verdict
    assert [r for r, _ in judge_batch(llm, trajs)] == [1.0, 1.0, 0.0, 0.0] and llm.calls[-1][1].max_new_tokens == 16
    assert llm_judge(llm)(trajs[2])[0] == 0.0 and llm.calls[-1][1].max_new_tokens == 16
    assert llm_judge(llm)(trajs[0])[0] == 1.0


def test_configured_judge_picks_the_rule_or_the_llm_judge():
    from types import SimpleNamespace

    cfg = SimpleNamespace(judge="rule", reward="f1", format_reward=0.5, self_judge_reward=0.0)
    judge = configured_judge(cfg)
    assert judge(episode("Paris France", answered()))[0] == pytest.approx(2 / 3 + 0.5) and judge.blocking is False
    bare = SimpleNamespace(reward="em", format_reward=0.0)  # no judge, no self_judge_reward: the rule judge, no term
    assert configured_judge(bare)(self_judged("useful", "not useful"))[0] == 1.0
    cfg = SimpleNamespace(judge="llm", reward="em", format_reward=0.25, self_judge_reward=0.5,
                          llm_judge=SimpleNamespace(unparseable="rule", max_new_tokens=4))
    with pytest.raises(ValueError, match="needs a judge model"):
        configured_judge(cfg)
    llm = ReplyLLM(lambda t: "hmm")  # unparseable: the rule policy falls back to EM
    judge = configured_judge(cfg, llm)
    assert judge.blocking is True
    reward, v = judge(self_judged("useful", "useful"))
    assert reward == 1.0 + 0.25 + 0.5 * 1 / 2 and v["llm_verdict"] == "unparseable"
    assert llm.calls[-1][1].max_new_tokens == 4
