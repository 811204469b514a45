"""direct / rag / ircot / agent on a scripted LLM and a keyword retriever."""

import pytest

from agent.llm import Generation
from agent.trajectory import Trajectory, Turn
from eval.methods import (
    MethodContext,
    _ircot_step,
    _sentence_open,
    agent,
    direct,
    extract_answer,
    ircot,
    make_method,
    rag,
)
from sleuth.config import AgentConfig
from tests.test_eval_fakes import PASSAGES, CharTokenizer, KeywordRetriever, ScriptedLLM, examples

FIELDS = {"id", "prediction", "golden_answers", "retrieved_ids", "search_calls", "turns", "generated_tokens", "wall_s"}


def test_extract_answer():
    assert extract_answer(" Paris </answer> trailing") == "Paris"
    assert extract_answer("Paris and more") == "Paris and more"  # budget ran out before </answer>
    assert extract_answer("</answer>") is None


def test_direct_uses_no_retrieval():
    llm = ScriptedLLM(known={"What is the capital of France?": "Paris"})
    recs = direct(examples(2), MethodContext(llm))
    assert [r["prediction"] for r in recs] == ["Paris", "unknown"]
    assert all(FIELDS <= set(r) for r in recs)
    assert [(r["search_calls"], r["turns"], r["retrieved_ids"]) for r in recs] == [(0, 1, [])] * 2
    assert recs[0]["generated_tokens"] == len("Paris</answer>")
    assert llm.calls == 1 and all(p.endswith("Question: " + e.question + "\n<answer>") for p, e in zip(llm.prompts, examples(2)))
    assert direct([], MethodContext(llm)) == []


def test_rag_retrieves_once_then_reads():
    llm, ret = ScriptedLLM(), KeywordRetriever(PASSAGES)
    exs = examples(3)
    recs = rag(exs, MethodContext(llm, ret, top_k=2))
    assert ret.batches == [[e.question for e in exs]]  # one batched search with the questions
    assert llm.calls == 1
    assert [r["prediction"] for r in recs] == ["Paris", "Rome", "Madrid"]
    assert [r["retrieved_ids"][0] for r in recs] == ["p0", "p1", "p3"] and all(len(r["retrieved_ids"]) == 2 for r in recs)
    assert all(r["search_calls"] == 1 and r["turns"] == 1 for r in recs)
    p = llm.prompts[0]
    assert f"<search> {exs[0].question} </search>" in p and "<information>Doc 1(Title: Paris)" in p and p.endswith("<answer>")


def test_rag_context_fits_the_episode_budget():
    cfg = AgentConfig(max_total_tokens=200, max_new_tokens=16, max_obs_tokens=384)
    llm = ScriptedLLM()
    rag(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), cfg, top_k=4))
    assert len(llm.prompts[0]) <= cfg.max_total_tokens - cfg.max_new_tokens
    assert "</information>" in llm.prompts[0]  # the body is cut, the closing tag is kept


def test_ircot_interleaves_retrieval_with_reasoning():
    llm, ret = ScriptedLLM(ircot_sentences=2), KeywordRetriever(PASSAGES)
    recs = ircot(examples(2), MethodContext(llm, ret, top_k=1, max_steps=4))
    # searches: the question, then each reasoning sentence; the third step answers
    assert ret.batches[1:] == [["Look up hop1."] * 2, ["Look up hop2."] * 2]
    for r in recs:
        assert r["search_calls"] == 3 and r["turns"] == 3
        assert r["retrieved_ids"][1:] == ["p2", "p1"]  # hop1 -> Berlin, hop2 -> Rome
        assert r["reasoning"] == "Look up hop1. Look up hop2."
    # "So the answer is <title of the last passage in context>"; q1 retrieved Rome first, so it is not new
    assert [r["prediction"] for r in recs] == ["Rome", "Berlin"]
    assert [r["retrieved_ids"][0] for r in recs] == ["p0", "p1"]


def test_ircot_forces_an_answer_when_steps_run_out():
    llm, ret = ScriptedLLM(ircot_sentences=5), KeywordRetriever(PASSAGES)
    (rec,) = ircot(examples(1), MethodContext(llm, ret, top_k=1, max_steps=1))
    assert rec["search_calls"] == 2 and rec["turns"] == 2  # one reasoning step + the forced answer
    assert llm.prompts[-1].endswith("Look up hop1. </think>\n<answer>")
    assert rec["prediction"] == "Paris"  # forced answer reads the first passage


ABBREVIATED = "The team is from St. Louis. It trained with the U.S. Army 1.5 km away. So the answer is St. Louis."


def test_ircot_step_ends_at_a_sentence_end_not_an_abbreviation():
    llm, ret = ScriptedLLM(ircot_text=ABBREVIATED), KeywordRetriever(PASSAGES)
    (rec,) = ircot(examples(1), MethodContext(llm, ret, AgentConfig(max_new_tokens=64), top_k=1, max_steps=4))
    steps = ["The team is from St. Louis.", "It trained with the U.S. Army 1.5 km away."]
    assert ret.batches[1:] == [[s] for s in steps]  # the whole sentence is the retrieval query
    assert rec["reasoning"] == " ".join(steps) and rec["prediction"] == "St. Louis"
    # each "." that is no sentence end costs one more call: St. | U. S. 1. | St.
    assert rec["turns"] == llm.calls == 8 and rec["generated_tokens"] == len(ABBREVIATED)


def test_ircot_step_after_a_number_ends_where_the_sentence_ends():
    text = "He scored 21. So the answer is 21."
    llm, ret = ScriptedLLM(ircot_text=text), KeywordRetriever(PASSAGES)
    (rec,) = ircot(examples(1), MethodContext(llm, ret, AgentConfig(max_new_tokens=64), top_k=1, max_steps=4))
    assert ret.batches[1:] == [["He scored 21."]] and rec["reasoning"] == "He scored 21."
    assert rec["prediction"] == "21"
    # the look past "21." (no digit follows, so not kept) was generated and is counted; so is the empty one
    assert rec["turns"] == 4 and rec["generated_tokens"] == len(text) + len(" So the answer is 21.")


def test_ircot_step_of_endless_abbreviations_stops_at_the_token_budget():
    llm, ret = ScriptedLLM(ircot_text="St. " * 1000), KeywordRetriever(PASSAGES)
    cfg = AgentConfig(max_new_tokens=20)
    (rec,) = ircot(examples(1), MethodContext(llm, ret, cfg, top_k=1, max_steps=1))
    assert ret.batches[1] == [("St. " * 5)[:20].strip()]  # "St." + 4 x " St." + " ", cut at 20 tokens
    assert rec["generated_tokens"] == 20 + len("Paris</answer>") and rec["prediction"] == "Paris"
    assert rec["turns"] == llm.calls == 6 + 1


def test_ircot_continuations_are_batched_and_each_step_keeps_its_own_budget():
    exs = examples(2)
    mrs = "Mrs. Smith is here and there and everywhere."
    llm = ScriptedLLM(ircot_text={exs[0].question: "St. " * 1000, exs[1].question: mrs})
    ret = KeywordRetriever(PASSAGES)
    r0, r1 = ircot(exs, MethodContext(llm, ret, AgentConfig(max_new_tokens=20), top_k=1, max_steps=1))
    # round 2 asks for 17 tokens (what "St." left); "Mrs." left 16, so its continuation is cut to 16
    assert ret.batches[1] == [("St. " * 5)[:20].strip(), mrs[:20].strip()]
    assert llm.calls == 6 + 1 and (r0["turns"], r1["turns"]) == (7, 3)  # one call per round, both questions
    assert r0["generated_tokens"] == 20 + len("Paris</answer>")
    assert r1["generated_tokens"] == 20 + len("Rome</answer>")


class TextOnlyServer:
    """An OpenAI-compatible server that returns text only and names no stop string: the "." or newline it
    stopped at is left out (what :func:`agent.backends.openai.restore_stop` cannot put back)."""

    def __init__(self, llm):
        self.llm, self.tokenizer = llm, llm.tokenizer

    def generate(self, prompts, params):
        out = []
        for g in self.llm.generate(prompts, params):
            text = g.text[:-1] if g.finish_reason == "stop" and g.text.endswith((".", "\n")) else g.text
            out.append(Generation(self.tokenizer.encode(text), text, g.finish_reason, meta={"exact": False}))
        return out


def test_ircot_step_through_a_server_that_drops_the_stop_string():
    inner, ret = ScriptedLLM(ircot_text=ABBREVIATED), KeywordRetriever(PASSAGES)
    ctx = MethodContext(TextOnlyServer(inner), ret, AgentConfig(max_new_tokens=64), top_k=1, max_steps=4)
    (rec,) = ircot(examples(1), ctx)
    assert ret.batches[1:] == [["The team is from St. Louis"], ["It trained with the U.S. Army 1.5 km away"]]
    assert rec["reasoning"] == "The team is from St. Louis. It trained with the U.S. Army 1.5 km away."
    assert rec["prediction"] == "St. Louis" and rec["generated_tokens"] == len(ABBREVIATED) - 3


class LeadingSpaceDroppingTokenizer(CharTokenizer):
    """Decodes as a SentencePiece tokenizer with a dummy prefix does (Llama 2, Mistral): one leading space
    of the decoded ids is dropped, so ``decode(a) + decode(b) != decode(a + b)`` when ``b`` starts a word."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        text = super().decode(ids)
        return text.removeprefix(" ")


class DecodingBackend:
    """``llm`` whose generations' text is the tokenizer's decoding of their ids, as a real backend's is."""

    def __init__(self, llm):
        self.llm, self.tokenizer = llm, llm.tokenizer

    def generate(self, prompts, params):
        return [Generation(g.token_ids, self.tokenizer.decode(g.token_ids), g.finish_reason, meta=g.meta)
                for g in self.llm.generate(prompts, params)]


def test_ircot_continued_step_is_the_decoding_of_all_its_ids():
    """A continued step joined each round's own decoding: with a tokenizer that drops a leading space
    "St." + " Louis." became "St.Louis." in the query and the chain of thought, while the ids (what the
    model saw) said "St. Louis."."""
    inner, ret = ScriptedLLM(ircot_text=ABBREVIATED), KeywordRetriever(PASSAGES)
    inner.tokenizer = LeadingSpaceDroppingTokenizer()
    ctx = MethodContext(DecodingBackend(inner), ret, AgentConfig(max_new_tokens=64), top_k=1, max_steps=4)
    (rec,) = ircot(examples(1), ctx)
    steps = ["The team is from St. Louis.", "It trained with the U.S. Army 1.5 km away."]
    assert ret.batches[1:] == [[s] for s in steps]
    assert rec["reasoning"] == " ".join(steps) and rec["prediction"] == "St. Louis"


@pytest.mark.parametrize(
    "text, more",
    [
        ("The capital is St.", ""), ("Dr.", ""), ("the U.", ""), ("the U.S.", ""), ("the U.S", ""),
        ("Apples, pears, etc.", ""), ("on Jan.", ""), ("J. R. R.", ""), ("in 1.", " 5"), ("No.", " 5"),
        ("in 1.5", ""), ("The capital is Rome.", None), ("He was born in 1990.)", None), ("It rained.\"", None),
        ("Most.", None), ("Rest.", None), ("no.", None), ("Wait...", None), ("born in 1990.", None),
        ("Look up hop1.", None), ("sold 1,000.", None), ("Not.", None),
    ],
)
def test_sentence_open(text, more):
    p = _sentence_open(text)
    assert (p is None) == (more is None)
    if p is not None:
        assert p.match(more or " Louis")
    if more == " 5":
        assert not p.match(" He")


@pytest.mark.parametrize("text", ["World War I.", "the U.S.", "Apple Inc.", "vitamin C.", "Plan B.", "Sen."])
def test_a_sentence_opening_word_after_an_abbreviation_ends_the_sentence(text):
    """After an abbreviation or initial, a word that usually opens a sentence ("It", "The", "So") says the
    "." ended one; a name, a lower-case word or another initial ("A." of "A. A. Milne") goes on."""
    p = _sentence_open(text)
    for new_sentence in (" It ended in 1918.", " The company", "\nSo the", " In 1918", " A war"):
        assert not p.match(new_sentence), new_sentence
    for same_sentence in (" Louis", " Army", " and more", " A. Milne", " Smith", "Louis", " Italy"):
        assert p.match(same_sentence), same_sentence


def test_ircot_answer_after_an_initial_is_not_run_into_the_next_sentence():
    """'answer is World War I. It ended in 1918.' predicted 'World War I. It ended in 1918': the initial's
    continuation ran the next sentence into the answer."""
    text = "So the answer is World War I. It ended in 1918."
    llm, ret = ScriptedLLM(ircot_text=text), KeywordRetriever(PASSAGES)
    (rec,) = ircot(examples(1), MethodContext(llm, ret, AgentConfig(max_new_tokens=64), top_k=1, max_steps=4))
    assert rec["prediction"] == "World War I"
    assert rec["turns"] == 2 and rec["generated_tokens"] == len(text)  # the look past "I." is counted


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer> Rome </answer>", ("answer", "Rome")),
        ("Thus the answer is: Rome.", ("answer", "Rome")),
        ("<search> capital of Italy </search>", ("sentence", "capital of Italy")),
        ("Rome is in  Italy.", ("sentence", "Rome is in Italy.")),
        ("</think>", ("done", "")),
        ("", ("done", "")),
    ],
)
def test_ircot_step_parsing(text, expected):
    assert _ircot_step(text) == expected


def test_agent_method_maps_trajectories():
    def fake_run_episodes(exs, llm, retriever, cfg, *, n_samples=1, temperature=None, top_k=3, seed=0):
        assert n_samples == 1 and temperature == 0.0
        out = []
        for e in exs:
            t = Trajectory(question_id=e.id, question=e.question, golden_answers=e.golden_answers)
            t.turns = [Turn(0, "<search> x </search>", "search"), Turn(1, "<answer> A </answer>", "answer")]
            t.answer, t.retrieved_ids, t.roles, t.stop_reason = "A", ["p1", "p2"], [0, 1, 1, 2, 1], "answer"
            out.append(t)
        return out

    ctx = MethodContext(ScriptedLLM(), KeywordRetriever(PASSAGES), run_episodes=fake_run_episodes)
    recs = agent(examples(2), ctx)
    assert [(r["prediction"], r["search_calls"], r["turns"], r["generated_tokens"]) for r in recs] == [("A", 1, 2, 3)] * 2
    assert recs[0]["retrieved_ids"] == ["p1", "p2"] and recs[0]["stop_reason"] == "answer"

    def wrong_order(exs, *a, **k):
        return list(reversed(fake_run_episodes(exs, *a, **k)))

    with pytest.raises(RuntimeError, match="expected"):
        agent(examples(2), MethodContext(ScriptedLLM(), KeywordRetriever(PASSAGES), run_episodes=wrong_order))


def test_agent_method_through_the_real_loop():
    llm, ret = ScriptedLLM(), KeywordRetriever(PASSAGES)
    cfg = AgentConfig(max_turns=3, max_new_tokens=200, max_total_tokens=4000)
    recs = agent(examples(3), MethodContext(llm, ret, cfg, top_k=2))
    assert [r["prediction"] for r in recs] == ["Paris", "Rome", "Madrid"]
    assert all(r["search_calls"] == 1 and r["turns"] == 2 and len(r["retrieved_ids"]) == 2 for r in recs)
    assert all(r["generated_tokens"] > 0 for r in recs)


def test_make_method():
    llm, ret = ScriptedLLM(), KeywordRetriever(PASSAGES)
    fn = make_method("rag", llm, ret, top_k=1)
    assert [r["retrieved_ids"] for r in fn(examples(1))] == [["p0"]]
    with pytest.raises(ValueError, match="registered: direct, rag, ircot, agent, search_o1; did you mean 'search_o1'"):
        make_method("search-o1", llm, ret)
    with pytest.raises(ValueError, match="needs a retriever"):
        make_method("ircot", llm, None)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['max_stpes'\] of method 'ircot'; known: .*max_steps"):
        make_method("ircot", llm, ret, max_stpes=2)
    assert make_method("direct", llm, None)(examples(1))[0]["prediction"] == "unknown"
