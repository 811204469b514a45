"""search_o1: the model searches mid-reasoning; Reason-in-Documents output, not raw documents, enters the chain."""

import re

import pytest

from agent.llm import Generation, SamplingParams
from eval.methods import EVAL_METHODS, MethodContext, make_method, search_o1
from eval.run import run_benchmarks
from eval.search_o1 import NO_INFO
from sleuth.config import AgentConfig
from tests.test_eval_fakes import PASSAGES, CharTokenizer, KeywordRetriever, examples

FIELDS = {"id", "prediction", "golden_answers", "retrieved_ids", "search_calls", "turns", "generated_tokens",
          "wall_s", "refined"}
_Q = re.compile(r"Question:\s*(.*?)\n")
_TITLE = re.compile(r"Doc \d+\(Title: (.*?)\)")
_FACT = re.compile(r"FACT (\w+)")


class SearchO1LLM:
    """Scripted Search-o1 model. Reasoning turns: search ``hop1 .. hop<hops>`` (one per turn), then answer
    with the last fact inserted; questions in ``known`` are answered at once. Reason-in-Documents calls
    (recognised by their prompt) reply ``FACT <title of Doc 1> for <query>``, or nothing when
    ``empty_rid``. ``ramble`` turns without a tag (longer than the budget) come first. Records every
    prompt by kind and the batch sizes."""

    def __init__(self, hops=2, known=(), empty_rid=False, ramble=0):
        self.tokenizer = CharTokenizer()
        self.hops, self.known, self.empty_rid, self.ramble = hops, set(known), empty_rid, ramble
        self.reason_prompts: list[str] = []
        self.rid_prompts: list[str] = []
        self.forced_prompts: list[str] = []
        self.batches: list[tuple[str, int]] = []

    def _respond(self, ctx: str) -> tuple[str, str]:
        if "Current search query:" in ctx:
            titles = _TITLE.findall(ctx)
            query = ctx.split("Current search query:", 1)[1].split("\n", 1)[0].strip()
            return "rid", "" if self.empty_rid else f" FACT {titles[0]} for {query}\n\nignored"
        facts = _FACT.findall(ctx)
        if ctx.endswith("<answer>"):
            return "forced", (facts[-1] if facts else "unknown") + "</answer>"
        q = _Q.search(ctx).group(1)
        if q in self.known:
            return "reason", "<think>I know</think><answer> Paris </answer>"
        if ctx.count("ramble") < self.ramble:
            return "reason", "ramble " * 100
        k = ctx.count("<information>")
        if k < self.hops:
            return "reason", f"<think>step {k}</think><search> hop{k + 1} </search> never"
        return "reason", f"<answer> {facts[-1] if facts else 'unknown'} </answer>"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        outs, kinds = [], set()
        for p in prompts:
            ctx = self.tokenizer.decode(p)
            kind, text = self._respond(ctx)
            kinds.add(kind)
            {"rid": self.rid_prompts, "forced": self.forced_prompts, "reason": self.reason_prompts}[kind].append(ctx)
            cut = min((text.find(s) + len(s) for s in params.stop if s in text), default=len(text))
            text = text[: min(cut, params.max_new_tokens)]
            outs.append(Generation(self.tokenizer.encode(text), text, "stop" if cut <= params.max_new_tokens else "length"))
        assert len(kinds) <= 1, "one batch mixes reasoning and Reason-in-Documents prompts"
        self.batches.append((kinds.pop() if kinds else "none", len(prompts)))
        return outs


def test_search_o1_control_flow_and_records():
    llm, ret = SearchO1LLM(hops=2), KeywordRetriever(PASSAGES)
    recs = search_o1(examples(2), MethodContext(llm, ret, top_k=1, max_steps=4))
    # the model's own queries are searched (not the question), one batch per step over both questions
    assert ret.batches == [["hop1", "hop1"], ["hop2", "hop2"]]
    assert llm.batches == [("reason", 2), ("rid", 2), ("reason", 2), ("rid", 2), ("reason", 2)]  # no forced answer
    for r in recs:
        assert FIELDS <= set(r)
        assert r["prediction"] == "Rome"  # the last inserted fact (hop2 -> Rome)
        assert r["retrieved_ids"] == ["p2", "p1"] and r["search_calls"] == 2
        assert r["turns"] == 5  # 3 reasoning steps + 2 Reason-in-Documents calls
        assert r["refined"] == ["FACT Berlin for hop1", "FACT Rome for hop2"]
        assert r["wall_s"] >= 0 and r["raw"].startswith("<answer>")
    # generated tokens: every call's output (the CharTokenizer has one token per character)
    expect = sum(len(t) for t in ["<think>step 0</think><search> hop1 </search>", " FACT Berlin for hop1\n\n",
                                  "<think>step 1</think><search> hop2 </search>", " FACT Rome for hop2\n\n",
                                  "<answer> Rome </answer>"])
    assert recs[0]["generated_tokens"] == expect


def test_refined_information_replaces_the_documents():
    llm = SearchO1LLM(hops=2)
    search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), top_k=2, max_steps=4))
    last = llm.reason_prompts[-1]
    assert "<information>FACT Berlin for hop1</information>" in last
    assert "<information>FACT Rome for hop2</information>" in last
    assert "Doc 1(Title:" not in last and "capital of Germany" not in last  # raw documents never enter the chain
    # the Reason-in-Documents prompt sees the documents, the query and the previous reasoning
    rid = llm.rid_prompts[1]
    assert "Current search query: hop2" in rid and "Doc 1(Title: Rome)" in rid and "Doc 2(Title:" in rid
    assert "step 0" in rid and "FACT Berlin for hop1" in rid and "step 1" in rid
    # the chain continues the model's own tokens exactly (text after </search> was cut by the stop)
    assert "</search> never" not in last and "hop1 </search>\n\n<information>" in last


def test_stops_at_answer_and_batches_only_running_questions():
    llm, ret = SearchO1LLM(hops=1, known={"What is the capital of France?"}), KeywordRetriever(PASSAGES)
    recs = search_o1(examples(3), MethodContext(llm, ret, top_k=1, max_steps=4))
    assert llm.batches == [("reason", 3), ("rid", 2), ("reason", 2)]
    assert ret.batches == [["hop1", "hop1"]]
    assert (recs[0]["prediction"], recs[0]["search_calls"], recs[0]["turns"], recs[0]["refined"]) == ("Paris", 0, 1, [])
    assert [r["prediction"] for r in recs[1:]] == ["Berlin", "Berlin"] and all(r["turns"] == 3 for r in recs[1:])


def test_max_steps_forces_an_answer():
    llm, ret = SearchO1LLM(hops=5), KeywordRetriever(PASSAGES)
    (rec,) = search_o1(examples(1), MethodContext(llm, ret, top_k=1, max_steps=2))
    assert rec["search_calls"] == 2 and len(llm.reason_prompts) == 2
    assert rec["turns"] == 2 + 2 + 1  # 2 reasoning steps, 2 Reason-in-Documents, the forced answer
    (forced,) = llm.forced_prompts
    assert forced.endswith("FACT Rome for hop2</information>\n\n<answer>")
    assert rec["prediction"] == "Rome"
    # max_steps defaults to cfg.max_turns
    llm = SearchO1LLM(hops=5)
    (rec,) = search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), AgentConfig(max_turns=3), top_k=1))
    assert rec["search_calls"] == 3 and len(llm.forced_prompts) == 1


def test_empty_extraction_inserts_no_helpful_information():
    llm = SearchO1LLM(hops=1, empty_rid=True)
    (rec,) = search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), top_k=1, max_steps=3))
    assert rec["refined"] == [NO_INFO] and f"<information>{NO_INFO}</information>" in llm.reason_prompts[-1]
    assert rec["prediction"] == "unknown"


def test_no_reason_in_documents_call_when_no_document_fits_or_none_was_found():
    """A budget that leaves no room for a document token (or a search with no hits) sent a Reason-in-Documents
    prompt with no documents: a wasted generation. Nothing is asked then, and the chain gets NO_INFO."""
    cfg = AgentConfig(max_total_tokens=400, max_new_tokens=60, max_obs_tokens=300, max_turns=6)
    llm = SearchO1LLM(hops=1)
    (rec,) = search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), cfg, top_k=1, max_extract_tokens=30))
    assert rec["search_calls"] == 1 and rec["refined"] == [NO_INFO] and llm.rid_prompts == []

    class Nothing:
        def search(self, queries, k):
            return [[] for _ in queries]

    llm = SearchO1LLM(hops=1)
    (rec,) = search_o1(examples(1), MethodContext(llm, Nothing(), top_k=1, max_steps=3))
    assert rec["search_calls"] == 1 and rec["refined"] == [NO_INFO] and llm.rid_prompts == []


def test_reasoning_cut_by_the_turn_budget_continues():
    llm = SearchO1LLM(hops=1, ramble=1)
    cfg = AgentConfig(max_new_tokens=64, max_total_tokens=2000)
    (rec,) = search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), cfg, top_k=1, max_steps=4))
    assert len(llm.reason_prompts) == 3 and "ramble" in llm.reason_prompts[1]  # continued after the cut turn
    assert rec["search_calls"] == 1 and rec["prediction"] == "Berlin"
    # a turn that stops without any action ends the reasoning: forced answer
    class Quiet(SearchO1LLM):
        def _respond(self, ctx):
            kind, text = super()._respond(ctx)
            return (kind, "I am done.") if kind == "reason" else (kind, text)

    llm = Quiet(hops=1)
    (rec,) = search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), top_k=1, max_steps=4))
    assert len(llm.reason_prompts) == 1 and len(llm.forced_prompts) == 1 and rec["search_calls"] == 0
    assert llm.forced_prompts[0].endswith("I am done.<answer>")


def test_open_think_is_closed_before_the_forced_answer():
    class Thinker(SearchO1LLM):
        def _respond(self, ctx):
            kind, text = super()._respond(ctx)
            return (kind, "<think>hmm") if kind == "reason" else (kind, text)

    llm = Thinker()
    search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), top_k=1, max_steps=2))
    assert llm.forced_prompts[0].endswith("<think>hmm </think>\n<answer>")


@pytest.mark.parametrize("budget", [450, 500, 550])
@pytest.mark.parametrize("top_k", [1, 4])
def test_every_prompt_fits_the_episode_budget(top_k, budget):
    """Six hops do not fit the budget: the chain searches, is cut by the budget, and every prompt (reasoning,
    Reason-in-Documents and the forced answer) leaves room for its own generation."""
    cfg = AgentConfig(max_total_tokens=budget, max_new_tokens=60, max_obs_tokens=300, max_turns=6)
    llm = SearchO1LLM(hops=6)
    recs = search_o1(examples(2), MethodContext(llm, KeywordRetriever(PASSAGES), cfg, top_k=top_k, max_extract_tokens=30))
    assert all(0 < r["search_calls"] < 6 for r in recs)  # it searched, and the budget cut the chain
    assert llm.rid_prompts and llm.forced_prompts
    assert all(len(p) <= cfg.max_total_tokens - 30 for p in llm.rid_prompts)
    assert all(len(p) <= cfg.max_total_tokens - cfg.max_new_tokens for p in llm.reason_prompts + llm.forced_prompts)
    assert all("Current search query:" in p and "Helpful information:" in p for p in llm.rid_prompts)
    # the answer is the last fact that made it into the chain (cut to the room left), not 'unknown'
    assert all(r["prediction"] and any(f.split()[1].startswith(r["prediction"]) for f in r["refined"]) for r in recs)


def test_registered_and_runs_through_the_runner(tmp_path):
    assert EVAL_METHODS.get("search_o1").run is search_o1 and EVAL_METHODS.get("search_o1").tags
    with pytest.raises(ValueError, match="needs a retriever"):
        make_method("search_o1", SearchO1LLM(), None)
    fn = make_method("search_o1", SearchO1LLM(hops=1), KeywordRetriever(PASSAGES), top_k=1, max_steps=2)
    assert fn(examples(1))[0]["retrieved_ids"] == ["p2"]
    s = run_benchmarks(["sample"], "search_o1", 4, 0, tmp_path, SearchO1LLM(hops=1), KeywordRetriever(PASSAGES),
                       AgentConfig(), top_k=1, method_options={"max_steps": 2}, progress=False)
    m = s["benchmarks"]["sample"]
    assert m["n"] == 4 and m["search_calls"] == 1.0 and m["turns"] == 3.0 and s["run_dir"].endswith(s["fingerprint"])
    assert search_o1([], MethodContext(SearchO1LLM(), KeywordRetriever(PASSAGES))) == []


def test_thinking_cut_by_the_turn_budget_continues():
    """A turn cut by the token budget inside ``<think>`` (a long reasoning step, the usual case for a
    reasoning model) continues at the next step; only an action tag in a cut turn ends the reasoning."""

    class LongThinker(SearchO1LLM):
        def _respond(self, ctx):
            kind, text = super()._respond(ctx)
            return (kind, "<think>" + text) if kind == "reason" and text.startswith("ramble") else (kind, text)

    llm = LongThinker(hops=1, ramble=1)
    cfg = AgentConfig(max_new_tokens=64, max_total_tokens=2000)
    (rec,) = search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), cfg, top_k=1, max_steps=4))
    assert len(llm.reason_prompts) == 3 and "<think>ramble" in llm.reason_prompts[1] and not llm.forced_prompts
    assert rec["search_calls"] == 1 and rec["prediction"] == "Berlin"

    class CutSearch(SearchO1LLM):  # a cut turn with an unclosed action is not continued
        def _respond(self, ctx):
            kind, text = super()._respond(ctx)
            return (kind, "<search> " + "long " * 100) if kind == "reason" else (kind, text)

    llm = CutSearch(hops=1)
    (rec,) = search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), cfg, top_k=1, max_steps=4))
    assert len(llm.reason_prompts) == 1 and len(llm.forced_prompts) == 1 and rec["search_calls"] == 0


def test_function_calling_policy_is_refused_not_run_without_searches():
    """With agent.protocol=function_call the policy searches through <tool_call> JSON, which search_o1 (it
    parses <search> tags) never saw: every question ran with 0 searches and a forced answer, silently. It is
    a ValueError naming agent.protocol now, when the method is bound and when it is called."""
    cfg = AgentConfig(protocol="function_call")
    with pytest.raises(ValueError, match="agent.protocol"):
        make_method("search_o1", SearchO1LLM(), KeywordRetriever(PASSAGES), cfg)
    with pytest.raises(ValueError, match="agent.protocol"):
        search_o1(examples(), MethodContext(SearchO1LLM(), KeywordRetriever(PASSAGES), cfg))
    make_method("search_o1", SearchO1LLM(), KeywordRetriever(PASSAGES), AgentConfig())  # the tag protocol runs


def test_zero_extraction_tokens_is_refused_not_the_whole_budget():
    """``max_extract_tokens=0`` (and ``sampling(max_new=0)``) used to read as "not given" (``0 or default``) and
    got the whole ``cfg.max_new_tokens``; asking for no tokens is a caller's bug: ValueError, before any call."""
    from eval.prompting import sampling

    cfg = AgentConfig(max_new_tokens=60)
    with pytest.raises(ValueError, match="at least 1"):
        sampling(cfg, 0.0, 0, ("</answer>",), 0)
    assert sampling(cfg, 0.0, 0, ("</answer>",)).max_new_tokens == 60
    assert sampling(cfg, 0.0, 0, ("</answer>",), 7).max_new_tokens == 7
    llm = SearchO1LLM(hops=1)
    with pytest.raises(ValueError, match="max_extract_tokens"):
        search_o1(examples(1), MethodContext(llm, KeywordRetriever(PASSAGES), cfg, top_k=1, max_extract_tokens=0))
    assert llm.batches == []
