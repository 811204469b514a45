"""``/v1/chat/completions`` honours or refuses each OpenAI field: ``max_tokens``, ``n``, ``temperature`` and
``top_p``, ``stream_options.include_usage``, the ``model`` name, and the fields it cannot honour. Before,
``max_tokens`` (5 asked, up to 160 generated), ``n`` (2 asked, 1 returned), an invalid temperature (-1, a
string) and ``include_usage`` were ignored, and any model name was echoed."""

from __future__ import annotations

import json

import httpx2
import pytest

from agent.serve.app import create_app
from agent.serve.service import ServeLimits
from tests.test_agent_fakes import ScriptLLM, ServerThread
from tests.test_serve import SCRIPTS, _sse

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class ParamsLLM(ScriptLLM):
    """The scripted policy, recording the sampling parameters of every prompt it is asked to continue."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, SCRIPTS)
        self.params = []

    def generate(self, prompts, params):
        self.params.extend([params] * len(prompts))
        return super().generate(prompts, params)


@pytest.fixture()
def srv(tiny_llm, retriever, agent_cfg):
    llm = ParamsLLM(tiny_llm.tokenizer)
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=20, max_n=4))
    with ServerThread(app) as s:
        s.llm, s.app = llm, app
        yield s


def _chat(srv, **body):
    return httpx2.post(srv.url + "/v1/chat/completions", json={"messages": FRANCE, **body}, timeout=60)


def test_max_tokens_caps_the_tokens_the_episode_generates(srv):
    r = _chat(srv)
    full = r.json()["usage"]["completion_tokens"]
    assert r.json()["choices"][0]["message"]["content"] == "Paris" and full > 5
    for field in ("max_tokens", "max_completion_tokens"):
        r = _chat(srv, **{field: 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert 0 < body["usage"]["completion_tokens"] <= 5, body["usage"]
        assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"] == ""
    r = _chat(srv, max_tokens=100_000)  # above the server's budget: the server's budget holds
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == full
    for bad in (0, -1, "5", True, 2.5):
        r = _chat(srv, max_tokens=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", (bad, r.text)


def test_n_runs_that_many_episodes(srv):
    r = _chat(srv, n=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["Paris"] * 3
    assert all(c["sleuth"]["evidence"][0]["id"] == "p0" for c in body["choices"])
    one = _chat(srv).json()["usage"]
    assert body["usage"]["completion_tokens"] == 3 * one["completion_tokens"]
    assert body["usage"]["prompt_tokens"] == one["prompt_tokens"]
    for bad in (0, 5, "2", True):  # max_n is 4 here
        r = _chat(srv, n=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", (bad, r.text)
    assert httpx2.get(srv.url + "/health").json()["inflight"] == 0


def test_n_streamed_tags_each_choice_and_openai_reads_them(srv):
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="sleuth-agent", messages=FRANCE, n=2, stream=True))
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {0: "Paris", 1: "Paris"} and finish == {0: "stop", 1: "stop"}


def test_temperature_and_top_p_are_validated_and_sample_the_episode(srv):
    for field, bad in (("temperature", -1), ("temperature", "hot"), ("temperature", 2.5), ("temperature", True),
                       ("top_p", 0), ("top_p", 1.5), ("top_p", "x")):
        r = _chat(srv, **{field: bad})
        assert r.status_code == 400, (field, bad, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"]
    r = httpx2.post(srv.url + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "France?"}],'
                    b' "temperature": NaN}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert srv.llm.params == []  # nothing was generated for a refused request
    assert _chat(srv, temperature=0.7, top_p=0.9).status_code == 200
    assert {(p.temperature, p.top_p) for p in srv.llm.params} == {(0.7, 0.9)}
    srv.llm.params.clear()
    assert _chat(srv, temperature=None).status_code == 200  # null: the server's own
    assert {p.temperature for p in srv.llm.params} == {0.0}


def test_stream_options_include_usage_sends_the_usage_chunk(srv):
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="sleuth-agent", messages=FRANCE, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "Paris"
    with httpx2.stream("POST", srv.url + "/v1/chat/completions",
                       json={"messages": FRANCE, "stream": True}) as r:  # without it: no usage anywhere
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    for body in ({"stream_options": {"include_usage": True}}, {"stream": True, "stream_options": "yes"},
                 {"stream": True, "stream_options": {"include_usage": "yes"}}):
        r = _chat(srv, **body)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("stream_options"), (body, r.text)


def test_an_unknown_model_name_is_404_model_not_found(srv):
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE)
    assert e.value.code == "model_not_found" and "sleuth-agent" in e.value.message
    r = _chat(srv)  # left out: the served model
    assert r.status_code == 200 and r.json()["model"] == "sleuth-agent"
    assert httpx2.get(srv.url + "/v1/models").json()["data"][0]["id"] == "sleuth-agent"


@pytest.mark.parametrize("field,value", [("stop", ["\n"]), ("seed", 1), ("logprobs", True), ("top_logprobs", 2),
                                         ("presence_penalty", 0.5), ("frequency_penalty", 1), ("logit_bias", {"1": 5}),
                                         ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("tool_choice", "required"), ("response_format", {"type": "json_object"})])
def test_fields_the_server_cannot_honour_get_400_naming_them(srv, field, value):
    r = _chat(srv, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter" and field in err["message"]


def test_neutral_values_of_those_fields_are_accepted(srv):
    r = _chat(srv, stop=None, seed=None, logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
              tools=[], tool_choice="auto", response_format={"type": "text"}, user="someone", n=1)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris", r.text


def test_n_episodes_over_max_inflight_get_503_and_free_every_slot(tiny_llm, retriever, agent_cfg):
    app = create_app(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, agent_cfg,
                     limits=ServeLimits(max_inflight=2, max_n=4))
    with ServerThread(app) as s:
        for stream in (False, True):
            r = httpx2.post(s.url + "/v1/chat/completions", json={"messages": FRANCE, "n": 3, "stream": stream})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert app.state.inflight == 0
        r = httpx2.post(s.url + "/v1/chat/completions", json={"messages": FRANCE, "n": 2, "stream": True})
        events = _sse(r.text.splitlines())
        assert events[-1] == "[DONE]" and {c["choices"][0]["index"] for c in events[:-1] if c["choices"]} == {0, 1}
        assert app.state.inflight == 0
    assert json.dumps(events[0])  # plain JSON chunks
