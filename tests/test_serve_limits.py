"""Every request bound of ``sleuth serve`` (agent.serve), on both sides, over HTTP: a request exactly at a limit
is answered, one past it gets the status that names the limit. Bounds: body bytes (declared and streamed),
question characters, the prompt's tokens against ``agent.max_total_tokens``, ``top_k``, ``max_turns``, ``n``,
episodes in flight, ``temperature``, ``top_p``, ``max_tokens``, and the API key."""

from __future__ import annotations

import json

import httpx2
import pytest

from agent.protocols.build import prompt_ids
from agent.serve.app import create_app
from agent.serve.service import ServeLimits
from tests.test_agent_fakes import ScriptLLM, ServerThread

SCRIPTS = {"": ["<answer> Paris </answer>"]}  # every question: answer at once
LIMITS = ServeLimits(max_body_bytes=3000, max_question_chars=40, request_timeout_s=20, max_inflight=3, max_top_k=4,
                     max_n=4)


@pytest.fixture()
def server(tiny_llm, retriever, agent_cfg):
    app = create_app(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, agent_cfg, top_k=2, limits=LIMITS,
                     api_key="k3y")
    with ServerThread(app) as srv:
        yield srv


AUTH = {"Authorization": "Bearer k3y"}


def ask(url, payload, **kw):
    kw.setdefault("headers", AUTH)
    if not isinstance(payload, dict):  # bytes, or an iterator of chunks (sent chunked, without a length)
        return httpx2.post(url + "/ask", content=payload, timeout=30, **kw)
    return httpx2.post(url + "/ask", json=payload, timeout=30, **kw)


def chat(url, question="What is the capital of France?", **fields):
    body = {"messages": [{"role": "user", "content": question}], **fields}
    return httpx2.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)


def answered(r):
    assert r.status_code == 200, r.text
    return r.json()


def refused(r, status, needle):
    assert r.status_code == status, (r.status_code, r.text)
    assert needle in r.json()["error"]["message"], r.json()["error"]["message"]


def test_body_bytes_both_sides(server):
    def body(n):
        base = json.dumps({"question": "Who?", "pad": ""}).encode()
        out = json.dumps({"question": "Who?", "pad": "x" * (n - len(base))}).encode()
        assert len(out) == n
        return out

    assert answered(ask(server.url, body(3000)))["answer"] == "Paris"
    refused(ask(server.url, body(3001)), 413, "request body of 3001 bytes exceeds the size limit; the limit is 3000")
    at, over = body(3000), body(3001)
    assert answered(ask(server.url, iter([at[:1000], at[1000:]])))["answer"] == "Paris"  # chunked
    refused(ask(server.url, iter([over[:1000], over[1000:]])), 413, "request body exceeds the size limit (over 3000 bytes sent); the limit is 3000")
    refused(ask(server.url, b"{"), 400, "request body is not valid JSON")
    refused(ask(server.url, b"[]"), 400, "request body must be a JSON object")
    refused(ask(server.url, b"[" * 1200 + b"]" * 1200), 400, "nested too deeply")


def test_question_characters_both_sides(server):
    answered(ask(server.url, {"question": "  " + "q" * 40 + "  "}))  # 40 after stripping
    refused(ask(server.url, {"question": "q" * 41}), 422, "the question has 41 characters; the limit is 40")
    refused(ask(server.url, {"question": "   "}), 422, "the question is empty")
    refused(ask(server.url, {"question": 3}), 422, "the question must be a string")
    refused(ask(server.url, b'{"question": "a \\ud800 b"}'), 422, "lone surrogate")
    refused(chat(server.url, "q" * 41), 422, "the question has 41 characters; the limit is 40")
    answered(chat(server.url, "q" * 40))


def test_the_prompt_must_leave_one_token_to_generate(tiny_llm, retriever, agent_cfg):
    q = "What is the capital of France?"
    n = len(prompt_ids(tiny_llm.tokenizer, q, agent_cfg))
    llm = ScriptLLM(tiny_llm.tokenizer, SCRIPTS)
    for budget, status in ((n + 1, 200), (n, 422)):
        cfg = agent_cfg.model_copy(update={"max_total_tokens": budget})
        with ServerThread(create_app(llm, retriever, cfg, limits=LIMITS)) as srv:
            r = httpx2.post(srv.url + "/ask", json={"question": q}, timeout=30)
            assert r.status_code == status, r.text
            if status == 422:
                assert r.json()["error"]["message"] == (f"the prompt of this question is {n} tokens, 1 more than fit "
                                                        f"agent.max_total_tokens={n} with one token left to generate")


@pytest.mark.parametrize("field,good,bad,needle", [
    ("top_k", (1, 4), (0, 5, True, 2.0), "top_k must be an integer in [1, 4]"),
    ("max_turns", (1, 3), (0, 4, False, "2"), "max_turns must be an integer in [1, 3]"),
])
def test_episode_options_both_ends(server, field, good, bad, needle):
    for v in good:
        answered(ask(server.url, {"question": "Who?", field: v}))
        answered(chat(server.url, **{field: v}))
    for v in bad:
        refused(ask(server.url, {"question": "Who?", field: v}), 422, needle)
        refused(chat(server.url, **{field: v}), 422, needle)


def test_golden_answers_shape(server):
    r = answered(ask(server.url, {"question": "Who?", "golden_answers": ["Paris"]}))
    assert r["verdict"]["em"] == 1.0
    refused(ask(server.url, {"question": "Who?", "golden_answers": "Paris"}), 422, "golden_answers must be a list")
    refused(ask(server.url, {"question": "Who?", "golden_answers": [1]}), 422, "golden_answers must be a list")
    refused(ask(server.url, b'{"question": "Who?", "golden_answers": ["\\udfff"]}'), 422, "a golden answer holds a lone")


def test_choices_and_episodes_in_flight_both_sides(server):
    assert len(answered(chat(server.url, n=3))["choices"]) == 3  # 3 episodes: max_inflight, all taken at once
    refused(chat(server.url, n=4), 503, "server busy: 3 episodes in flight")  # max_n allows 4; slots do not
    refused(chat(server.url, n=5), 400, "n must be an integer between 1 and 4")
    refused(chat(server.url, n=0), 400, "n must be an integer between 1 and 4")
    r = chat(server.url, n=4, stream=True)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    h = httpx2.get(server.url + "/health").json()
    assert h["inflight"] == 0 and h["limits"]["max_top_k"] == 4 and h["limits"]["max_question_chars"] == 40


@pytest.mark.parametrize("field,good,bad,needle", [
    ("temperature", (0, 0.0, 2, 2.0), (-0.01, 2.01, True, "1"), "temperature must be a number at least 0 and at most 2"),
    ("top_p", (0.001, 1, 1.0), (0, 0.0, 1.01, -1), "top_p must be a number above 0 and at most 1"),
    ("max_tokens", (1, 100000), (0, -1, 1.5, True), "max_tokens must be an integer at least 1"),
    ("max_completion_tokens", (1,), (0,), "max_completion_tokens must be an integer at least 1"),
])
def test_sampling_fields_both_ends(server, field, good, bad, needle):
    for v in good:
        answered(chat(server.url, **{field: v}))
    for v in bad:
        refused(chat(server.url, **{field: v}), 400, needle)


def test_api_key(server):
    refused(ask(server.url, {"question": "Who?"}, headers={}), 401, "missing or wrong API key")
    refused(ask(server.url, {"question": "Who?"}, headers={"Authorization": "Bearer k3"}), 401, "missing or wrong")
    refused(ask(server.url, {"question": "Who?"}, headers={"Authorization": "Bearer k3y!"}), 401, "missing or wrong")
    r = httpx2.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Who?"}]})
    refused(r, 401, "missing or wrong API key")
    assert httpx2.get(server.url + "/health").status_code == 200  # open
