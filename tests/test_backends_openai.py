"""The OpenAI-compatible HTTP backend against a local fake server (127.0.0.1): token-exact completions,
retries, timeouts, garbage, and the text-only fallback."""

from __future__ import annotations

import pytest

from agent.backends.openai import BackendError, OpenAICompatibleLLM
from agent.llm import SamplingParams, encode
from agent.loop.batch import run_episodes
from tests.test_agent_exactness import EIFFEL, FRANCE, assert_exact
from tests.test_agent_fakes import Recorder, ScriptLLM, ServerThread, fake_openai_completions_app


@pytest.fixture()
def scripted(tiny_llm):
    return ScriptLLM(tiny_llm.tokenizer, {"capital of France": ["<search> capital of France </search>", "<answer> Paris </answer>"],
                                          "Eiffel": ["<search> Gustave Eiffel </search>", "<answer> Dijon </answer>"]})


def _client(url, tok, **kw):
    return OpenAICompatibleLLM(url + "/v1", "tiny", tok, api_key="k", backoff_s=0.01, **kw)


def test_agent_over_http_is_token_exact(tiny_llm, retriever, agent_cfg):
    mode: dict = {}
    with ServerThread(fake_openai_completions_app(tiny_llm, mode)) as srv:
        rec = Recorder(_client(srv.url, tiny_llm.tokenizer))
        trajs = run_episodes([FRANCE, EIFFEL], rec, retriever, agent_cfg, n_samples=2, temperature=1.0, seed=0)
    assert_exact(rec, trajs)
    assert all(isinstance(b["prompt"], list) and b["return_tokens_as_token_ids"] for b in mode["seen"])
    # every knob a vLLM server would otherwise fill from the model's generation_config is sent, neutral
    assert all((b["top_k"], b["min_p"], b["repetition_penalty"]) == (-1, 0.0, 1.0) for b in mode["seen"])
    assert all(t.logprobs is not None for t in trajs) and all(t.stop_reason != "error" for t in trajs)


def test_scripted_episode_over_http(scripted, retriever, agent_cfg):
    with ServerThread(fake_openai_completions_app(scripted, {})) as srv:
        (t,) = run_episodes([FRANCE], _client(srv.url, scripted.tokenizer), retriever, agent_cfg)
    assert t.answer == "Paris" and t.reward == 1.0 and t.num_search_calls == 1


def test_retries_transient_errors(scripted):
    mode = {"fail_first": 2}
    with ServerThread(fake_openai_completions_app(scripted, mode)) as srv:
        llm = _client(srv.url, scripted.tokenizer, max_retries=3)
        (g,) = llm.generate([encode(scripted.tokenizer, "Question: capital of France?\n")], SamplingParams(max_new_tokens=40))
    assert g.text == "<search> capital of France </search>" and llm.stats["retries"] == 2


def test_a_rate_limit_waits_as_long_as_retry_after_says(scripted):
    """A hosted API answering 429 with Retry-After must not be retried after backoff_s (0.01 s here, doubling),
    which used up every attempt within a fraction of a second and failed the episode."""
    with ServerThread(fake_openai_completions_app(scripted, {"fail_first": 2, "retry_after": 0.5})) as srv:
        llm = _client(srv.url, scripted.tokenizer, max_retries=3)
        (g,) = llm.generate([encode(scripted.tokenizer, "Question: capital of France?\n")], SamplingParams(max_new_tokens=40))
    assert g.text == "<search> capital of France </search>" and llm.stats["retries"] == 2
    assert llm.stats["backoff_s"] == pytest.approx(1.0)  # max(0.01, 0.5) + max(0.02, 0.5)


def test_gives_up_with_a_reason(scripted, retriever, agent_cfg):
    with ServerThread(fake_openai_completions_app(scripted, {"fail_first": 10})) as srv:
        llm = _client(srv.url, scripted.tokenizer, max_retries=1)
        with pytest.raises(BackendError, match="after 2 attempts .*HTTP 503"):
            llm.generate([[1, 2]], SamplingParams())
        # inside the agent loop the episode fails cleanly with the reason
        (t,) = run_episodes([FRANCE], llm, retriever, agent_cfg)
    assert t.stop_reason == "error" and "HTTP 503" in t.metadata["error"]


def test_timeout_and_garbage_fail_cleanly(scripted, retriever, agent_cfg):
    mode = {"sleep": 2.0}
    with ServerThread(fake_openai_completions_app(scripted, mode)) as srv:
        llm = _client(srv.url, scripted.tokenizer, timeout_s=0.2, max_retries=0)
        with pytest.raises(BackendError, match="ReadTimeout"):
            llm.generate([[1]], SamplingParams())
        mode.pop("sleep")
        mode["garbage"] = True
        (t,) = run_episodes([FRANCE], llm, retriever, agent_cfg)
    assert t.stop_reason == "error" and "malformed completion" in t.metadata["error"]


def test_one_rejected_prompt_fails_only_its_episode_and_a_refusing_server_fails_all_at_once(scripted, retriever,
                                                                                          agent_cfg):
    # one prompt over the served model's context (HTTP 400) failed every episode batched with it
    from agent.llm import BackendUnavailable
    from corpora.formats import QAExample

    long = QAExample("long", "capital of France? " + "very " * 40, ["Paris"])  # 171 prompt tokens
    mode: dict = {"max_prompt": 150}  # the others' prompts stay under 120 tokens
    with ServerThread(fake_openai_completions_app(scripted, mode)) as srv:
        llm = _client(srv.url, scripted.tokenizer, max_retries=0)
        trajs = run_episodes([FRANCE, long, EIFFEL], llm, retriever, agent_cfg)
        assert [t.answer for t in trajs] == ["Paris", None, "Dijon"]
        assert trajs[1].stop_reason == "error" and "maximum context length" in trajs[1].metadata["error"]
        # the batch's other answers were kept (BackendPartlyFailed): nothing was sent twice
        first_turn = [b["prompt"] for b in mode["seen"][:3]]
        assert all(sum(b["prompt"] == p for b in mode["seen"]) == 1 for p in first_turn)
        # a server refusing every request (a wrong key: 401) fails the batch without one call per episode
        mode.update(status=401, seen=[])
        with pytest.raises(BackendUnavailable, match="HTTP 401"):
            llm.generate([[1], [2]], SamplingParams())
        trajs = run_episodes([FRANCE, EIFFEL, FRANCE], llm, retriever, agent_cfg)
    assert all(t.stop_reason == "error" and "HTTP 401" in t.metadata["error"] for t in trajs)
    assert len(mode["seen"]) == 2 + 3


def test_each_request_keeps_its_own_token_budget_so_a_server_does_not_refuse_it(scripted, retriever, agent_cfg):
    """The scheduler sent every prompt of a batch the batch's largest max_new_tokens; `vllm serve` refuses
    prompt + max_tokens over its context (400), so an episode near the end of its token budget failed its
    batch, which only the one-by-one retry recovered. Each request now carries its own budget."""
    from corpora.formats import QAExample

    long = QAExample("long", "capital of France? " + "very " * 40, ["Paris"])  # 171 prompt tokens
    cfg = agent_cfg.model_copy(update={"max_total_tokens": 180})  # its first turn may generate 9 tokens, the others 24
    mode: dict = {"max_context": 180}
    with ServerThread(fake_openai_completions_app(scripted, mode)) as srv:
        llm = _client(srv.url, scripted.tokenizer, max_retries=0)
        trajs = run_episodes([FRANCE, long, EIFFEL], llm, retriever, cfg)
    assert mode.get("rejected", []) == []
    assert [t.answer for t in trajs][::2] == ["Paris", "Dijon"] and trajs[1].stop_reason != "error"
    assert sorted(b["max_tokens"] for b in mode["seen"][:3]) == [9, 24, 24]  # the first turn's batch


def test_unreachable_server(scripted):
    llm = OpenAICompatibleLLM("http://127.0.0.1:9/v1", "tiny", scripted.tokenizer, max_retries=0)
    with pytest.raises(BackendError, match="ConnectError"):
        llm.generate([[1]], SamplingParams())


@pytest.mark.parametrize("mode", [{"drop_stop": True}, {"drop_stop": True, "stop_reason": True}])
def test_text_only_server_that_leaves_out_the_stop_string(scripted, retriever, agent_cfg, mode):
    """A hosted API leaves the matched stop string out of the text (vLLM names it in ``stop_reason``); the
    backend puts it back, so ``<search> q`` is a search, not an unclosed tag, and the episode answers."""
    with ServerThread(fake_openai_completions_app(scripted, {"text_only": True, **mode})) as srv:
        llm = _client(srv.url, scripted.tokenizer)
        (g,) = llm.generate([encode(scripted.tokenizer, "Question: capital of France?\n")],
                            SamplingParams(max_new_tokens=40, stop=("</search>", "</answer>")))
        (t,) = run_episodes([FRANCE], llm, retriever, agent_cfg)
    assert g.text == "<search> capital of France </search>" and g.finish_reason == "stop"
    assert t.num_search_calls == 1 and t.answer == "Paris" and t.stop_reason != "error"


def test_restore_stop_only_adds_what_the_server_stopped_at():
    from agent.backends.openai import restore_stop

    stop = ("</search>", "</answer>")
    assert restore_stop("<search> q", {"finish_reason": "stop"}, stop) == "<search> q</search>"
    assert restore_stop("<answer> a", {"finish_reason": "stop", "stop_reason": "</answer>"}, stop) == "<answer> a</answer>"
    # vLLM says it stopped at EOS (stop_reason None): nothing was left out, even with a tag open
    assert restore_stop("<search> q", {"finish_reason": "stop", "stop_reason": None}, stop) == "<search> q"
    assert restore_stop("<search> q", {"finish_reason": "length"}, stop) == "<search> q"
    assert restore_stop("<search> q </search>", {"finish_reason": "stop"}, stop) == "<search> q </search>"
    assert restore_stop("just text", {"finish_reason": "stop"}, stop) == "just text"


def test_text_only_server_is_marked_inexact(scripted):
    with ServerThread(fake_openai_completions_app(scripted, {"text_only": True})) as srv:
        llm = _client(srv.url, scripted.tokenizer)
        (g,) = llm.generate([encode(scripted.tokenizer, "Question: capital of France?\n")], SamplingParams(max_new_tokens=40))
    assert g.meta["exact"] is False and g.text == "<search> capital of France </search>" and llm.stats["inexact"] == 1


def test_make_llm_sends_only_the_configured_api_key(tiny_policy_dir, monkeypatch):
    """agent.backend.api_key_env names the key's variable; when it is unset, $OPENAI_API_KEY must not be sent
    to agent.backend.base_url instead (another provider's server would receive the OpenAI key)."""
    from agent.backends.build import make_llm
    from agent.config import BackendConfig

    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    monkeypatch.delenv("SLEUTH_TEST_OTHER_KEY", raising=False)
    cfg = BackendConfig(kind="openai", base_url="http://127.0.0.1:9/v1", api_key_env="SLEUTH_TEST_OTHER_KEY")
    assert not make_llm(cfg, str(tiny_policy_dir)).api_key
    monkeypatch.setenv("SLEUTH_TEST_OTHER_KEY", "other")
    assert make_llm(cfg, str(tiny_policy_dir)).api_key == "other"
    assert make_llm(BackendConfig(kind="openai"), str(tiny_policy_dir)).api_key == "sk-openai-secret"


def test_a_retry_after_wait_is_not_carried_to_retries_for_other_failures(scripted, monkeypatch):
    """After a 429 asking for Retry-After, a later failure of another kind (a dropped connection) waited the
    429's delay again instead of the backoff; each wait now follows the failure just before it."""
    import asyncio

    import httpx2

    from agent.llm import SamplingParams

    answers = iter(["429", "drop", "ok"])

    def handler(request):
        what = next(answers)
        if what == "429":
            return httpx2.Response(429, headers={"retry-after": "0.3"}, text="slow down")
        if what == "drop":
            raise httpx2.ConnectError("connection dropped", request=request)
        return httpx2.Response(200, json={"choices": [{"text": "<answer> Paris </answer>", "finish_reason": "stop"}]})

    slept = []
    real_sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda s, *a: slept.append(s) or real_sleep(0))
    llm = _client("http://fake", scripted.tokenizer, max_retries=3)

    async def run():
        async with httpx2.AsyncClient(base_url="http://fake/v1", transport=httpx2.MockTransport(handler)) as c:
            return await llm._one(c, asyncio.Semaphore(1), [1, 2], SamplingParams(max_new_tokens=8), 0)

    g = asyncio.run(run())
    assert g.text == "<answer> Paris </answer>"
    assert slept == [pytest.approx(0.3), pytest.approx(0.02)]  # the 429's wait, then the plain backoff


@pytest.mark.parametrize("body", [
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["token_id:5"], "token_logprobs": ["abc"]}}]}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [{"x": 1}]}}]}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["token_id:-5"], "token_logprobs": [-1.0]}}]}',
    b'{"choices": [{"text": "a\xff"}]}',  # not UTF-8
])
def test_a_malformed_completion_body_is_a_backend_error(tiny_llm, body):
    """Junk log-probs, a negative token id or a body that is not UTF-8 escaped as ValueError, TypeError,
    OverflowError or UnicodeDecodeError instead of the promised BackendError naming the server."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        return Response(body, media_type="application/json")

    with ServerThread(app) as srv:
        llm = _client(srv.url, tiny_llm.tokenizer, max_retries=0)
        with pytest.raises(BackendError, match="malformed completion"):
            llm.generate([[1, 2]], SamplingParams(max_new_tokens=4, stop=("</search>",)))
