"""The fleet client (agent.backends.fleet) on fakes and in-process engines: least-loaded routing with episode
affinity (the episode id comes from the agent loop), an engine that goes down taken out of rotation and its
requests sent to the others, all engines down, and the bad inputs refused at construction (an empty list, an
unreachable URL, an engine serving another model or tokenizer)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI

from agent.backends.fleet import Fleet, FleetError, FleetUnavailable, root_url
from agent.llm import SamplingParams, decode, encode
from agent.loop.batch import run_episodes
from corpora.formats import QAExample
from tests.test_agent_fakes import ScriptLLM, ServerThread, fake_openai_completions_app

QS = [QAExample(f"q{i}", f"What is fact {i}?", ["Paris"]) for i in range(4)]


@pytest.fixture()
def scripted(tiny_llm):
    # fact 1 answers at once; the others search first: the second turn is a batch of 3 of the 4 episodes
    scripts = {f"fact {i}": ["<search> Paris </search>", "<answer> Paris </answer>"] for i in (0, 2, 3)}
    scripts["fact 1"] = ["<answer> Paris </answer>"]
    return ScriptLLM(tiny_llm.tokenizer, scripts)


def _fleet(urls, tok, **kw):
    return Fleet(urls, tok, "tiny", backoff_s=0.01, max_retries=1, retry_waits=(0.05, 0.1), connect=False, **kw)


def test_pick_is_least_loaded_with_episode_affinity(tiny_llm):
    fleet = _fleet(["http://127.0.0.1:1", "http://127.0.0.1:2/v1/", "http://127.0.0.1:3"], tiny_llm.tokenizer)
    a, b, c = fleet.engines.values()
    assert b.url == "http://127.0.0.1:2"
    a.inflight, b.inflight, c.inflight = 2, 1, 1
    c.served = 5
    e = fleet.pick("ep-1")  # least in flight; of the equals, the one that served fewer
    assert e is b and b.inflight == 2
    b.inflight = 9
    assert fleet.pick("ep-1") is b  # the episode's engine, however loaded
    assert fleet.pick(None) is c and fleet.pick("ep-2") is a  # the others go by load (a: 2, c: 2 -> a first)
    fleet.take_out(b.url, "gone")
    assert fleet.pick("ep-1") in (a, c) and fleet.affinity["ep-1"] != b.url  # rerouted, remembered anew
    assert fleet.stats["affinity_hits"] == 1
    fleet.max_affinity = 2
    fleet.pick("ep-3")
    assert list(fleet.affinity) == ["ep-1", "ep-3"]  # oldest forgotten past max_affinity


def test_every_turn_of_an_episode_goes_to_one_engine(scripted, retriever, agent_cfg):
    """Four episodes over two fakes: the first turns spread by load; the second turns (three episodes, one
    answered at once) each follow their episode. Least-loaded alone would send the third episode's second
    turn to the other engine."""
    modes = [{}, {}]
    with ServerThread(fake_openai_completions_app(scripted, modes[0])) as s0, \
            ServerThread(fake_openai_completions_app(scripted, modes[1])) as s1:
        fleet = _fleet([s0.url, s1.url], scripted.tokenizer)
        trajs = run_episodes(QS, fleet, retriever, agent_cfg)
    assert [t.answer for t in trajs] == ["Paris"] * 4
    served = {}
    for i, mode in enumerate(modes):
        for body in mode["seen"]:
            fact = decode(scripted.tokenizer, body["prompt"]).split("fact ")[1][0]
            served.setdefault(fact, set()).add(i)
    assert served == {"0": {0}, "1": {1}, "2": {0}, "3": {1}}
    assert len(modes[0]["seen"]) + len(modes[1]["seen"]) == 7 and fleet.stats["affinity_hits"] == 3


def test_an_engine_that_goes_down_is_taken_out_and_its_requests_go_to_the_other(scripted, caplog):
    good, bad = {}, {"status": 503}  # a server whose every answer is 503 is down once its retries are spent
    with ServerThread(fake_openai_completions_app(scripted, good)) as s0, \
            ServerThread(fake_openai_completions_app(scripted, bad)) as s1:
        fleet = _fleet([s0.url, s1.url], scripted.tokenizer)
        prompts = [encode(scripted.tokenizer, f"What is fact {i}?") for i in range(4)]
        with caplog.at_level(logging.WARNING, "agent.backends.fleet"):
            gens = fleet.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [g.text for g in gens] == ["<search> Paris </search>", "<answer> Paris </answer>",
                                      "<search> Paris </search>", "<search> Paris </search>"]
    assert {g.meta["engine"] for g in gens} == {s0.url}
    assert len(good["seen"]) == 4 and len(bad["seen"]) == 2 * 2  # two requests, each tried twice
    state = fleet.describe()[s1.url]
    assert not state["in_rotation"] and "HTTP 503" in state["reason"] and fleet.stats["rerouted"] == 2
    assert f"rollout engine {s1.url} taken out of rotation" in caplog.text
    assert fleet.in_rotation() == [s0.url]


def test_all_engines_down_is_a_clear_error_after_the_waits(scripted):
    with ServerThread(fake_openai_completions_app(scripted, {})) as s0:
        url0 = s0.url
    with ServerThread(fake_openai_completions_app(scripted, {})) as s1:
        url1 = s1.url
    fleet = _fleet([url0, url1], scripted.tokenizer)
    with pytest.raises(FleetUnavailable) as e:
        fleet.generate([[1, 2]], SamplingParams(max_new_tokens=4))
    msg = str(e.value)
    assert "all 2 rollout engines are out of rotation" in msg and url0 in msg and url1 in msg
    assert "ConnectError" in msg and "waited 0.15 s (0.05 + 0.1)" in msg
    fleet.admit(url0, 3)  # what the trainer does after a verified sync of a restarted engine
    assert fleet.in_rotation() == [url0] and fleet.describe()[url0]["weight_version"] == 3


def test_a_request_that_fails_on_its_own_fails_alone(scripted):
    mode = {"max_prompt": 6}
    with ServerThread(fake_openai_completions_app(scripted, mode)) as s0:
        fleet = _fleet([s0.url], scripted.tokenizer)
        from agent.llm import BatchPartlyFailed

        with pytest.raises(BatchPartlyFailed) as e:
            fleet.generate([encode(scripted.tokenizer, "fact 1"), encode(scripted.tokenizer, "What is fact 1? " * 3)],
                           SamplingParams(max_new_tokens=8))
    ok, failed = e.value.results
    assert ok.text == "<answer> Paris </answer>" and "maximum context length" in str(failed)
    assert fleet.in_rotation() == [s0.url]  # a 400 is the request's fault, not the engine's


# -- bad input ------------------------------------------------------------------------------------------
def test_bad_lists_are_refused(tiny_llm):
    tok = tiny_llm.tokenizer
    with pytest.raises(ValueError, match="at least one engine URL"):
        Fleet([], tok)
    with pytest.raises(ValueError, match="at least one engine URL"):
        Fleet("http://127.0.0.1:1", tok)
    with pytest.raises(ValueError, match="listed twice"):
        Fleet(["http://127.0.0.1:1/v1", "http://127.0.0.1:1"], tok)
    with pytest.raises(ValueError, match="http://"):
        Fleet(["127.0.0.1:1"], tok)
    assert root_url(" http://h:8100/v1/ ") == "http://h:8100"


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory):
    """A tiny policy whose tokenizer has another vocabulary (300 tokens, not 400)."""
    from sleuth.config import TinyPolicyConfig
    from tests.conftest import PASSAGES, QUESTIONS
    from training.model.tiny import create_tiny_policy

    cfg = TinyPolicyConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, max_position_embeddings=1024)
    return create_tiny_policy(tmp_path_factory.mktemp("other_tok"), PASSAGES, QUESTIONS, cfg, seed=0)


def test_unreachable_other_model_and_other_tokenizer_are_refused_at_start(tiny_policy_dir, other_tokenizer_dir,
                                                                          tiny_llm):
    from tests.test_fleet_engine import make_engine

    right, other_name, other_tok = (make_engine(tiny_policy_dir), make_engine(tiny_policy_dir, name="other"),
                                    make_engine(other_tokenizer_dir))
    tok = tiny_llm.tokenizer
    with ServerThread(right.app) as s0, ServerThread(other_name.app) as s1, ServerThread(other_tok.app) as s2:
        fleet = Fleet([s0.url], tok, "tiny")
        assert fleet.in_rotation() == [s0.url] and fleet.engines[s0.url].weight_version == 0
        assert Fleet([s0.url], tok).model == "tiny"  # the served name, when none is given
        with pytest.raises(FleetError) as e:
            Fleet([s0.url, "http://127.0.0.1:9", s1.url, s2.url], tok, "tiny", connect_timeout_s=2)
        msg = str(e.value)
        assert msg.startswith("3 of 4 rollout engines cannot join the fleet")
        assert "http://127.0.0.1:9 is unreachable (ConnectError" in msg
        assert f"{s1.url} serves model 'other', not 'tiny'" in msg
        assert f"{s2.url} serves 'tiny' with another tokenizer" in msg
        with pytest.raises(FleetError, match="the engines serve different models"):
            Fleet([s0.url, s1.url], tok)


def test_an_engine_without_a_fingerprint_is_checked_by_tokenize(tiny_llm, other_tokenizer_dir):
    """``vllm serve`` reports no tokenizer fingerprint: its POST /tokenize of a fixed text must give the
    trainer's ids."""
    from transformers import AutoTokenizer

    from agent.backends.engine_protocol import IDENTITY_TEXT

    def vllm_like(tok):
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]}

        @app.post("/tokenize")
        async def tokenize(body: dict):
            return {"tokens": list(tok.encode(body["prompt"], add_special_tokens=body["add_special_tokens"]))}

        return app

    other = AutoTokenizer.from_pretrained(str(other_tokenizer_dir))
    assert other.encode(IDENTITY_TEXT, add_special_tokens=False) != tiny_llm.tokenizer.encode(
        IDENTITY_TEXT, add_special_tokens=False)
    with ServerThread(vllm_like(tiny_llm.tokenizer)) as same, ServerThread(vllm_like(other)) as diff:
        assert Fleet([same.url], tiny_llm.tokenizer).engines[same.url].owned_by == "vllm"
        with pytest.raises(FleetError, match="tokenises differently from the trainer's tokenizer"):
            Fleet([diff.url], tiny_llm.tokenizer)


def test_a_fleet_is_not_verified_as_one_engine(tiny_llm):
    """training.rollout.weight_sync.verify_engine calls probe_logprobs on a backend that has it: on a fleet
    that must fail loudly, not pass or check one engine of many."""
    from training.rollout.weight_sync import verify_engine

    fleet = _fleet(["http://127.0.0.1:1"], tiny_llm.tokenizer)
    from training.config import TrainConfig

    tc = TrainConfig().updated({"rollout.sync_probe_tol": 1e-3})
    with pytest.raises(NotImplementedError, match="verified one by one"):
        verify_engine(fleet, tiny_llm.model, None, tc, [1, 2, 3])
