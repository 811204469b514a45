"""ZeroSearch simulated search: curriculum schedule, useful/noisy documents, interchangeability with real
search in the agent loop, and the simulator fine-tuning data built from the real retriever."""

from __future__ import annotations

import json

import pytest

from agent.llm import SamplingParams, complete
from agent.loop.batch import run_episodes
from retrieval.base import Retriever
from retrieval.simulated import NOISY, USEFUL, SimulatedSearch, curriculum_noise, simulator_prompt
from tests.conftest import PASSAGES, QUESTIONS
from tests.test_agent_exactness import FRANCE
from tests.test_agent_fakes import ScriptLLM


def test_curriculum_matches_zerosearch_formula():
    assert curriculum_noise(0, 100, 0.1, 0.7, 4.0) == pytest.approx(0.1)
    assert curriculum_noise(100, 100, 0.1, 0.7, 4.0) == pytest.approx(0.7)
    # halfway: (4**0.5 - 1) / 3 = 1/3 of the way
    assert curriculum_noise(50, 100, 0.1, 0.7, 4.0) == pytest.approx(0.1 + 0.6 / 3)
    xs = [curriculum_noise(i, 10, 0.0, 1.0, 4.0) for i in range(11)]
    assert xs == sorted(xs) and xs[5] < 0.5  # increasing, slow start (convex for b > 1)
    assert curriculum_noise(5, 10, 0.0, 1.0, 1.0) == pytest.approx(0.5)  # b = 1: linear limit
    assert curriculum_noise(500, 10, 0.0, 1.0) == 1.0  # clamped
    with pytest.raises(ValueError):
        curriculum_noise(0, 0, 0.0, 1.0)
    with pytest.raises(ValueError):
        curriculum_noise(0, 10, 0.0, 1.5)


@pytest.mark.parametrize("base", [float("nan"), float("inf")])
def test_curriculum_rejects_a_base_that_is_not_a_finite_positive_number(base):
    """A NaN base passed the ``base <= 0`` check and made every noise probability NaN (so every document
    useful, whatever the curriculum); an infinite one did so after step 0."""
    with pytest.raises(ValueError, match="base"):
        curriculum_noise(5, 10, 0.0, 1.0, base)
    with pytest.raises(ValueError, match="base"):
        SimulatedSearch(_fake_generate, noise_base=base, total_steps=10)


def _fake_generate(prompts):
    return [("Useful doc\nParis is the capital of France." if "must contain" in p else "Noisy doc\nLyon has a river.")
            for p in prompts]


def test_noise_probability_controls_useful_and_noisy_documents():
    sim = SimulatedSearch(_fake_generate, noise_start=0.0, noise_end=1.0, total_steps=10, seed=0)
    assert isinstance(sim, Retriever)
    (hits,) = sim.search(["capital of France"], 5)
    assert all(h.id.startswith("sim:useful:") and "Paris" in h.contents for h in hits)  # p = 0 at step 0
    sim.set_step(10)
    (hits,) = sim.search(["capital of France"], 5)
    assert all(h.id.startswith("sim:noisy:") and h.title == "Noisy doc" for h in hits)  # p = 1 at the end
    sim = SimulatedSearch(_fake_generate, noise_start=0.5, noise_end=0.5, seed=1)
    labels = [lab for q in range(200) for lab in sim.search([f"q{q}"], 4) and sim.last_labels[0]]
    assert 0.4 < labels.count(NOISY) / len(labels) < 0.6 and set(labels) == {USEFUL, NOISY}
    with pytest.raises(ValueError):
        sim.search(["x"], 0)


def test_simulated_search_is_interchangeable_with_real_search(tiny_llm, agent_cfg):
    # the simulator is itself an LLM backend behind the plain generate callable
    sim_llm = ScriptLLM(tiny_llm.tokenizer, {"must contain": ["Paris\nParis is the capital of France."],
                                            "must not contain": ["Lyon\nLyon is a city."]})
    sim = SimulatedSearch(lambda ps: complete(sim_llm, ps, SamplingParams(max_new_tokens=64, stop=())))
    policy = ScriptLLM(tiny_llm.tokenizer, {"capital of France": ["<search> capital of France </search>", "<answer> Paris </answer>"]})
    (t,) = run_episodes([FRANCE], policy, sim, agent_cfg, top_k=2)
    assert t.answer == "Paris" and t.retrieved_ids[0].startswith("sim:useful:")
    assert "Doc 1(Title: Paris) Paris is the capital of France." in t.turns[0].observation


def test_simulator_failure_fails_the_episode_cleanly(tiny_llm, agent_cfg):
    def broken(prompts):
        raise TimeoutError("simulator timed out")

    policy = ScriptLLM(tiny_llm.tokenizer, {"capital of France": ["<search> capital of France </search>"]})
    (t,) = run_episodes([FRANCE], policy, SimulatedSearch(broken), agent_cfg)
    assert t.stop_reason == "error" and "simulator timed out" in t.metadata["error"]


def test_simulator_data_matches_gold_answers_as_whole_words():
    """Gold "2" is not in "1925" and "no" is not in "North"; a yes/no gold labels nothing by itself."""
    from corpora.formats import QAExample
    from retrieval.base import Hit
    from sleuth.commands.simulator_data import simulator_examples

    docs = [Hit("a", "A", "A\nBuilt in 1925 in the North.", 1.0), Hit("b", "B", "B\nIt has 2 towers.", 0.5),
            Hit("c", "C", "C\nNo, it was not.", 0.2)]

    class Fixed:
        def search(self, queries, k):
            return [docs[:k] for _ in queries]

    qs = [QAExample("n", "How many towers?", ["2"]), QAExample("y", "Was it red?", ["no"], {"supporting_ids": ["a"]})]
    labels = {(r["question_id"], r["doc_id"]): r["label"] for r in simulator_examples(qs, Fixed(), 3)}
    assert labels == {("n", "a"): NOISY, ("n", "b"): USEFUL, ("n", "c"): NOISY,
                      ("y", "a"): USEFUL, ("y", "b"): NOISY, ("y", "c"): NOISY}


def test_simulator_data_labels_documents_by_the_gold_answer(retriever, tiny_data, bm25_index, tmp_path):
    from sleuth.cli import main
    from sleuth.commands.simulator_data import simulator_examples

    titles = {p.id: p.title for p in PASSAGES}
    recs = simulator_examples(QUESTIONS[:2], retriever, 3, titles)
    by = {(r["question_id"], r["doc_id"]): r for r in recs}
    assert by[("q0", "p0")]["label"] == USEFUL  # the Paris paragraph contains the answer
    assert by[("q1", "p3")]["label"] == USEFUL  # supporting paragraph (and contains "Dijon")
    assert any(r["label"] == NOISY for r in recs)
    r = by[("q0", "p0")]
    assert r["prompt"] == simulator_prompt(r["query"], USEFUL) and r["completion"].startswith("Paris\n")
    out = tmp_path / "sim.jsonl"
    rc = main(["simulator-data", f"data.corpus={tiny_data / 'corpus.jsonl'}", f"data.train={tiny_data / 'train.jsonl'}",
               f"retrieval.index_dir={bm25_index}", "--out", str(out), "-k", "2"])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert rc == 0 and lines and {x["label"] for x in lines} <= {USEFUL, NOISY}


def _recording_search() -> tuple[SimulatedSearch, list[str]]:
    """A simulated search over :func:`_fake_generate` and the list of every prompt it sends the LLM."""
    prompts_seen: list[str] = []

    def gen(prompts):
        prompts_seen.extend(prompts)
        return _fake_generate(prompts)

    return SimulatedSearch(gen), prompts_seen


def test_search_arguments_are_checked_like_every_retriever():
    sim, prompts_seen = _recording_search()
    with pytest.raises(TypeError, match="one string"):
        sim.search("capital of France", 2)  # was searched character by character: 17 queries, 34 LLM calls
    with pytest.raises(TypeError, match="expected str"):
        sim.search([None], 2)
    for k in (2.0, 0):
        with pytest.raises(ValueError, match="k must be"):
            sim.search(["x"], k)
    assert prompts_seen == []


def test_blank_queries_get_no_hits_and_no_simulator_calls():
    sim, prompts_seen = _recording_search()
    res = sim.search(["", "capital of France", " \n "], 2)
    assert res[0] == res[2] == [] and len(res[1]) == 2 and len(prompts_seen) == 2
    assert all("capital of France" in p for p in prompts_seen)
    assert sim.last_labels[0] == sim.last_labels[2] == [] and len(sim.last_labels[1]) == 2
    assert sim.search(["  "], 3) == [[]] and len(prompts_seen) == 2


def test_simulator_data_refuses_the_simulated_engine_as_its_retriever(tiny_data, bm25_index, tmp_path, capsys):
    """With the training config's ``retrieval.method: simulated`` the command built the simulator's
    fine-tuning data from the simulator itself (the policy writing documents, labelled by the gold answer)
    and said it wrote them; it needs a real retriever and now says so before loading any model."""
    from sleuth.cli import main

    out = tmp_path / "sim.jsonl"
    rc = main(["simulator-data", "retrieval.method=simulated", "policy.model=/no/such/model",
               f"data.corpus={tiny_data / 'corpus.jsonl'}", f"data.train={tiny_data / 'train.jsonl'}",
               f"retrieval.index_dir={bm25_index}", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "retrieval.method" in err and "real retriever" in err and not out.exists()


@pytest.mark.parametrize("empty", ["", "  \n\t ", None])
def test_an_empty_simulated_document_is_an_error_naming_the_query(empty):
    """An empty (or blank) completion became a hit titled with the query itself and no text, labelled useful
    or noisy as drawn: the policy read its own query back as a document, silently. It is now a RuntimeError
    naming the query and the document, which the agent loop reports as the episode's error."""
    def gen(prompts):
        return [empty] + _fake_generate(prompts[1:])

    sim = SimulatedSearch(gen)
    with pytest.raises(RuntimeError, match=r"empty document 1 of 2 .*'capital of France'"):
        sim.search(["capital of France"], 2)


def test_simulator_data_from_an_empty_qa_file_is_an_error(tiny_data, bm25_index, tmp_path, capsys):
    """An empty QA file wrote an empty fine-tuning file and exited 0 ("wrote 0 simulator examples")."""
    from sleuth.cli import main

    qa, out = tmp_path / "empty.jsonl", tmp_path / "sim.jsonl"
    qa.write_text("")
    rc = main(["simulator-data", f"data.corpus={tiny_data / 'corpus.jsonl'}", f"retrieval.index_dir={bm25_index}",
               "--qa", str(qa), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "no questions" in err and str(qa) in err and not out.exists()


def test_repeated_searches_of_a_query_draw_their_noise_independently_and_reproducibly():
    """The G rollouts of a GRPO group often search the same query (the question itself) at the same step;
    its useful/noisy draws were a function of (seed, step, query, rank) alone, so every rollout got the same
    pattern (all useful, or all noisy) where ZeroSearch draws per search call. Each search of a query at a
    step now draws afresh (the n-th search of it is part of the draw), and a run with the same seed and the
    same calls draws the same labels, after a resume too (set_step to the same step)."""
    def draws(sim):
        sim.search(["capital of France", "capital of France"], 8)  # two rollouts in one batch
        first = list(sim.last_labels)
        sim.search(["capital of France"], 8)  # a third, in a later batch
        return first + sim.last_labels

    sim = SimulatedSearch(_fake_generate, noise_start=0.5, noise_end=0.5, total_steps=10, seed=3)
    sim.set_step(4)
    a, b, c = draws(sim)
    assert a != b and b != c and a != c
    again = SimulatedSearch(_fake_generate, noise_start=0.5, noise_end=0.5, total_steps=10, seed=3)
    again.set_step(4)  # a resumed run's first step
    assert draws(again) == [a, b, c]
    again.set_step(5)
    assert draws(again) != [a, b, c]
    other_seed = SimulatedSearch(_fake_generate, noise_start=0.5, noise_end=0.5, total_steps=10, seed=4)
    other_seed.set_step(4)
    assert draws(other_seed) != [a, b, c]


@pytest.mark.parametrize("bad", [0, -5])
def test_max_doc_chars_must_be_positive(bad):
    """``max_doc_chars`` 0 cut every document to nothing, and a negative one cut that many characters off the end
    of each (a Python slice) instead of keeping that many; both are now a ValueError when the engine is built."""
    with pytest.raises(ValueError, match="max_doc_chars"):
        SimulatedSearch(_fake_generate, max_doc_chars=bad)


def test_a_step_draws_the_same_whatever_was_searched_before_it():
    """The SFT oracle searches through the same engine before RL's set_step(0): those searches moved the
    repeated-search counts of step 0, so RL's first step drew otherwise than a run without them (or a run
    resumed at step 0). set_step now always starts the counts afresh."""
    warm = SimulatedSearch(_fake_generate, noise_start=0.5, noise_end=0.5, total_steps=10, seed=0)
    warm.search(["capital of France"] * 3, 8)  # e.g. the SFT oracle's rollouts, before training
    fresh = SimulatedSearch(_fake_generate, noise_start=0.5, noise_end=0.5, total_steps=10, seed=0)
    for sim in (warm, fresh):
        sim.set_step(0, 10)
        sim.search(["capital of France"], 8)
    assert warm.last_labels == fresh.last_labels
