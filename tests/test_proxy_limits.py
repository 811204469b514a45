"""Every request bound of the training proxy (agent.external.proxy), on both sides, over HTTP: a request exactly
at a limit is served, one past it gets the status that names the limit. Bounds: body bytes (declared and
streamed), messages per conversation, the sequence's token budget (``max_total_tokens``: one token left to
generate), ``max_tokens``, ``temperature``, ``top_p``, the episode id's length, prompt token ids within the
vocabulary, ``n``, the episode records kept, and the API key."""

from __future__ import annotations

import json

import httpx2
import pytest

from agent.external.proxy import Proxy, ProxyLimits, ProxyServer, ProxySettings
from agent.llm import encode
from tests.chat_templates import CHATML_TOOLS, Recording, ScriptedSampler

MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture()
def tok(tiny_llm):
    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    return tiny_llm.tokenizer


def n_prompt(tok, msgs=MSGS):
    return len(encode(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)))


@pytest.fixture()
def proxy(tok):
    backend = Recording(ScriptedSampler(tok, ["<answer> Paris </answer>"]))
    settings = ProxySettings(max_new_tokens=64, max_total_tokens=n_prompt(tok) + 1)
    p = Proxy(backend, settings, ProxyLimits(max_body_bytes=3000, max_messages=3, max_episodes=2), api_key="k")
    with ProxyServer(p) as server, httpx2.Client(base_url=server.url, timeout=30,
                                                 headers={"Authorization": "Bearer k"}) as http:
        p.http, p.backend = http, backend
        yield p


def served(r):
    assert r.status_code == 200, r.text
    return r.json()


def refused(r, status, needle):
    assert r.status_code == status, (r.status_code, r.text)
    assert needle in r.json()["error"]["message"], r.json()["error"]["message"]


def chat(proxy, path="/v1/chat/completions", **fields):
    return proxy.http.post(path, json={"messages": MSGS, **fields})


def test_the_token_budget_leaves_one_token_both_sides(proxy, tok):
    r = served(chat(proxy))  # the prompt is max_total_tokens - 1: exactly one token to generate
    assert r["usage"]["completion_tokens"] == 1 and len(proxy.backend.calls[-1][1]) == 1
    longer = [{"role": "user", "content": MSGS[0]["content"] + " Paris"}]
    assert n_prompt(tok, longer) > n_prompt(tok)
    r = proxy.http.post("/v1/chat/completions", json={"messages": longer})
    refused(r, 400, f"the prompt is {n_prompt(tok, longer)} tokens; this proxy's sequences hold "
                    f"{n_prompt(tok) + 1} (max_total_tokens) with one token left to generate")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    ids = encode(tok, "capital")
    room = n_prompt(tok) + 1 - len(ids)
    assert served(proxy.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}))["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    assert room >= 1


def test_body_bytes_both_sides(proxy):
    def body(n):
        base = json.dumps({"messages": MSGS, "pad": ""}).encode()
        out = json.dumps({"messages": MSGS, "pad": "x" * (n - len(base))}).encode()
        assert len(out) == n
        return out

    served(proxy.http.post("/v1/chat/completions", content=body(3000)))
    refused(proxy.http.post("/v1/chat/completions", content=body(3001)), 413, "request body of 3001 bytes exceeds the size limit; the limit is 3000")
    at, over = body(3000), body(3001)
    served(proxy.http.post("/v1/chat/completions", content=iter([at[:1000], at[1000:]])))
    refused(proxy.http.post("/v1/chat/completions", content=iter([over[:1000], over[1000:]])), 413,
            "request body exceeds the size limit (over 3000 bytes sent); the limit is 3000")
    refused(proxy.http.post("/v1/chat/completions", content=b"{"), 400, "request body is not valid JSON")
    refused(proxy.http.post("/v1/chat/completions", content=b"[1]"), 400, "request body must be a JSON object")
    refused(proxy.http.post("/v1/chat/completions", content=b"[" * 1200 + b"]" * 1200), 400, "nested too deeply")


def test_messages_per_conversation_both_sides(proxy, tok):
    proxy.settings.max_total_tokens = 4000
    three = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "user", "content": "Capital of France?"}]
    served(proxy.http.post("/v1/chat/completions", json={"messages": three}))
    refused(proxy.http.post("/v1/chat/completions", json={"messages": three + [three[1]]}), 422,
            "4 messages exceed the limit of 3")
    refused(proxy.http.post("/v1/chat/completions", json={"messages": []}), 422, "messages must be a non-empty list")
    refused(proxy.http.post("/v1/chat/completions", json={"messages": [{"content": "x"}]}), 422, "with a role")


@pytest.mark.parametrize("field,good,bad,needle", [
    ("max_tokens", (1, 10**6), (0, -1, True, 1.5), "max_tokens must be a positive integer"),
    ("max_completion_tokens", (1,), (0,), "max_tokens must be a positive integer"),
    ("temperature", (0, 2, 2.0), (-0.01, 2.01, True, "1"), "temperature must be a number in [0.0, 2.0]"),
    ("top_p", (0, 1, 1.0), (-0.01, 1.01, False), "top_p must be a number in [0.0, 1.0]"),
    ("top_k", (-1, 0, 5), (1.5, True, "3"), "top_k must be an integer"),
    ("seed", (0, 7), (1.5, False, "7"), "seed must be an integer"),
    ("n", (1,), (0, 2), "n must be 1"),
    ("stop", ("x", ["a", "b"], None), ([""], [1], 5), "stop must be a string or a list of non-empty strings"),
    ("stream", (False, None), ("yes", 1), "stream must be true or false"),
])
def test_request_fields_both_ends(proxy, field, good, bad, needle):
    proxy.settings.max_total_tokens = 4000
    for v in good:
        served(chat(proxy, **{field: v}))
    for v in bad:
        refused(chat(proxy, **{field: v}), 422, needle)


def test_the_request_sampling_reaches_the_backend_within_the_settings(tok):
    seen = []
    backend = Recording(ScriptedSampler(tok, ["<answer> Paris </answer>"]))
    inner = backend.generate
    backend.generate = lambda prompts, params: (seen.append(params), inner(prompts, params))[1]
    proxy = Proxy(backend, ProxySettings(max_new_tokens=6, max_total_tokens=4000, stop=("</answer>",)))
    with ProxyServer(proxy) as server, httpx2.Client(base_url=server.url, timeout=30) as http:
        served(http.post("/v1/chat/completions", json={"messages": MSGS, "temperature": 0.3, "top_p": 0.5,
                                                       "top_k": 7, "seed": 3, "stop": "x", "max_tokens": 100}))
        p = seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.max_new_tokens) == (0.3, 0.5, 7, 3,
                                                                                        ("x", "</answer>"), 6)
        served(http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "top_k": -1}))
        p = seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.max_new_tokens) == (1.0, 1.0, 0, None,
                                                                                        ("</answer>",), 2)


def test_episode_id_length_both_sides(proxy):
    served(chat(proxy, f"/ep/{'e' * 256}/v1/chat/completions"))
    refused(chat(proxy, f"/ep/{'e' * 257}/v1/chat/completions"), 422,
            "the episode id (path, X-Sleuth-Episode or user) must be 1-256 characters")
    served(proxy.http.post("/v1/chat/completions", json={"messages": MSGS}, headers={"X-Sleuth-Episode": "h"}))
    refused(chat(proxy, user=""), 422, "must be 1-256 characters")
    refused(chat(proxy, user=5), 422, "must be 1-256 characters")
    served(chat(proxy, user="u"))
    assert proxy.stats["untagged_calls"] == 0


def test_prompt_token_ids_within_the_vocabulary(proxy, tok):
    V = len(tok)
    served(proxy.http.post("/v1/completions", json={"prompt": [0, V - 1], "max_tokens": 1}))
    served(proxy.http.post("/v1/completions", json={"prompt": [[5, 6]], "max_tokens": 1}))
    for bad in ([V], [-1], [], [True], [1.0], "", [[5], [6]]):
        refused(proxy.http.post("/v1/completions", json={"prompt": bad, "max_tokens": 1}), 422,
                f"prompt must be a string or a non-empty list of token ids in [0, {V})")
    refused(proxy.http.post("/v1/completions", json={"prompt": [5], "stream": True}), 422,
            "stream is not supported on /v1/completions")


def test_episode_records_kept_both_sides(proxy):
    for e in ("a", "b"):
        served(chat(proxy, f"/ep/{e}/v1/chat/completions"))
    assert proxy.stats["dropped_episodes"] == 0 and list(proxy.episodes) == ["a", "b"]  # at max_episodes: kept
    served(chat(proxy, "/ep/c/v1/chat/completions"))
    assert proxy.stats["dropped_episodes"] == 1 and list(proxy.episodes) == ["b", "c"]  # past it: the oldest goes
    assert proxy.take("a").calls == [] and len(proxy.take("b").calls) == 1
    health = proxy.http.get("/health").json()
    assert health["open_episodes"] == 1 and health["episodes"] == 3 and health["calls"] == 3


def test_api_key(proxy):
    refused(proxy.http.post("/v1/chat/completions", json={"messages": MSGS}, headers={"Authorization": ""}), 401,
            "missing or wrong API key")
    refused(proxy.http.post("/v1/chat/completions", json={"messages": MSGS}, headers={"Authorization": "Bearer kk"}),
            401, "missing or wrong API key")
    refused(proxy.http.get("/v1/models", headers={"Authorization": "Bearer kx"}), 401, "missing or wrong")
    assert served(proxy.http.get("/v1/models"))["data"][0]["id"] == "sleuth-policy"
    assert proxy.http.get("/health", headers={"Authorization": ""}).status_code == 200
