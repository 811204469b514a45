"""The training proxy's API: OpenAI chat completions with tools (streamed and not) and completions, episode
ids from the URL, a header or ``user``, forced sampling, limits and errors, and the built-in loop run through
the proxy with an OpenAI-compatible client in place of the in-process backend."""

from __future__ import annotations

import json

import httpx2
import pytest

from agent.external.proxy import Proxy, ProxyLimits, ProxyServer, ProxySettings
from agent.llm import encode
from agent.protocols.function_call import SEARCH_TOOL
from agent.trajectory import Role
from tests.chat_templates import CALLS, CHATML_TOOLS, Recording, ScriptedSampler
from training.algos.advantages import to_token_advantages

MSGS = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture()
def scripted(tiny_llm):
    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    return Recording(ScriptedSampler(tiny_llm.tokenizer, [CALLS["chatml"], "<answer> Paris </answer>"]))


def tool_message(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "Doc 1(Title: Paris) Paris is the capital of France."}


def test_tool_calls_streamed_or_not_and_one_stitched_sequence(scripted):
    from openai import OpenAI

    proxy = Proxy(scripted, ProxySettings(max_new_tokens=64, max_total_tokens=2000))
    with ProxyServer(proxy) as server:
        client = OpenAI(base_url=server.base_url("e1"), api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="policy", messages=MSGS, tools=[SEARCH_TOOL])
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "search" and json.loads(tc.function.arguments) == {"query": "capital of France"}
        assert r.usage.completion_tokens == len(scripted.calls[0][1])
        msgs = MSGS + [choice.message.model_dump(exclude_none=True), tool_message(tc.id)]
        chunks = list(client.chat.completions.create(model="policy", messages=msgs, tools=[SEARCH_TOOL], stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "<answer> Paris </answer>"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == len(scripted.calls[1][1])
        # a streamed tool call arrives as one delta with its id, name and arguments
        plain = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        streamed = list(plain.chat.completions.create(model="policy", messages=MSGS, tools=[SEARCH_TOOL], stream=True,
                                                      user="e2"))
        calls = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
        assert len(calls) == 1 and calls[0].function.name == "search" and calls[0].id.startswith("call_")
    (t,) = proxy.take("e1").trajectories("q0", "What is the capital of France?", answer="Paris")
    assert proxy.stats["splits"] == 0 and proxy.stats["calls"] == 3
    (p1, o1, l1), (p2, o2, l2) = scripted.calls[:2]
    assert t.token_ids == p2 + o2 and p2[: len(p1) + len(o1)] == p1 + o1
    assert t.roles == [Role.PROMPT] * len(p1) + [Role.POLICY] * len(o1) + [Role.TOOL] * (len(p2) - len(p1) - len(o1)) \
        + [Role.POLICY] * len(o2)
    assert t.turn_ids[len(p1):] == [1] * (len(p2) - len(p1)) + [2] * len(o2)
    assert [x.action for x in t.turns] == ["search", "answer"] and t.turns[0].query == "capital of France"
    assert t.turns[0].n_tool_tokens == len(p2) - len(p1) - len(o1)
    assert t.logprobs == [0.0] * len(p1) + l1 + [0.0] * (len(p2) - len(p1) - len(o1)) + l2
    assert len(proxy.take("e2").calls) == 1 and proxy.take("nothing").calls == []


def test_episode_ids_from_the_url_a_header_or_user_and_untagged_calls(scripted):
    proxy = Proxy(scripted)
    with ProxyServer(proxy) as server, httpx2.Client(base_url=server.url, timeout=30) as http:
        body = {"model": "m", "messages": MSGS}
        assert http.post("/v1/chat/completions", json=body, headers={"X-Sleuth-Episode": "h"}).status_code == 200
        assert http.post("/v1/chat/completions", json={**body, "user": "u"}).status_code == 200
        assert http.post("/ep/p/v1/chat/completions", json={**body, "user": "ignored"}).status_code == 200
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        health = http.get("/health").json()
    assert health["calls"] == 3 and health["untagged_calls"] == 1 and health["open_episodes"] == 3
    assert [len(proxy.take(e).calls) for e in ("h", "u", "p", "ignored")] == [1, 1, 1, 0]


def test_forced_sampling_budget_and_request_errors(tiny_llm):
    tiny_llm.tokenizer.chat_template = CHATML_TOOLS
    backend = Recording(tiny_llm)
    seen = []
    inner = backend.generate
    backend.generate = lambda prompts, params: (seen.append(params), inner(prompts, params))[1]
    n_prompt = len(encode(tiny_llm.tokenizer, tiny_llm.tokenizer.apply_chat_template(MSGS, tokenize=False,
                                                                                    add_generation_prompt=True)))
    proxy = Proxy(backend, ProxySettings(max_new_tokens=8, max_total_tokens=n_prompt + 5, temperature=0.5, top_p=0.9),
                  ProxyLimits(max_body_bytes=20_000, max_messages=4), api_key="k")
    auth = {"Authorization": "Bearer k"}
    with ProxyServer(proxy) as server, httpx2.Client(base_url=server.url, timeout=30, headers=auth) as http:
        ok = http.post("/ep/a/v1/chat/completions", json={"messages": MSGS, "temperature": 0, "max_tokens": 50})
        assert ok.status_code == 200, ok.text
        assert (seen[-1].temperature, seen[-1].top_p, seen[-1].max_new_tokens) == (0.5, 0.9, 5)  # forced; budget
        assert ok.json()["usage"]["completion_tokens"] <= 5

        def err(path, body=None, content=None, headers=None):
            r = http.post(path, json=body, content=content, headers=headers)
            return r.status_code, r.json()["error"]["message"]

        assert err("/v1/chat/completions", {"messages": MSGS}, headers={"Authorization": "Bearer no"})[0] == 401
        assert err("/v1/chat/completions", content=b"{not json")[0] == 400
        assert err("/v1/chat/completions", content=b"x" * 30_000)[0] == 413
        assert err("/v1/chat/completions", {"messages": []})[0] == 422
        assert err("/v1/chat/completions", {"messages": MSGS * 3})[1].startswith("6 messages exceed")
        assert "n must be 1" in err("/v1/chat/completions", {"messages": MSGS, "n": 2})[1]
        assert "stop must be" in err("/v1/chat/completions", {"messages": MSGS, "stop": [1]})[1]
        assert "max_tokens" in err("/v1/chat/completions", {"messages": MSGS, "max_tokens": 0})[1]
        long = [MSGS[0], {"role": "user", "content": "capital " * 40}]
        r = http.post("/v1/chat/completions", json={"messages": long})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        tiny_llm.tokenizer.chat_template = "{{ raise_exception('no tools here') }}"
        assert "chat template failed" in err("/v1/chat/completions", {"messages": MSGS})[1]
        assert err("/v1/completions", {"prompt": [10**9]})[0] == 422

        def broken(prompts, params):
            raise RuntimeError("CUDA out of memory")

        backend.generate = broken
        status, message = err("/v1/completions", {"prompt": [5, 6, 7]})
        assert status == 502 and "CUDA out of memory" in message
        assert http.get("/health").json()["status"] == "ok"  # still serving
    assert len(proxy.take("a").calls) == 1


def test_the_built_in_loop_through_the_proxy_is_token_identical(tiny_llm, retriever, agent_cfg):
    """The same loop with an OpenAI-compatible client (the completions endpoint, token ids in and out) in place
    of the in-process backend: greedy, the trajectories equal the native ones token for token (rewards too),
    the proxy's own stitched record of each episode equals the loop's, and one policy update on either gives
    the same loss statistics and weights."""
    from agent.backends.openai import OpenAICompatibleLLM
    from agent.llm import run_sync
    from agent.loop.batch import run_episodes
    from agent.loop.episode import run_episode
    from agent.loop.nodes import make_context
    from corpora.formats import QAExample

    examples = [QAExample("q0", "What is the capital of France?", ["Paris"]),
                QAExample("q1", "Where was the designer of the Eiffel Tower born?", ["Dijon"])]
    native = run_episodes(examples, tiny_llm, retriever, agent_cfg, temperature=0.0)
    proxy = Proxy(tiny_llm, ProxySettings(max_new_tokens=agent_cfg.max_new_tokens,
                                          max_total_tokens=agent_cfg.max_total_tokens))
    with ProxyServer(proxy) as server:
        async def one(i, ex):
            client = OpenAICompatibleLLM(server.base_url(ex.id), "policy", tiny_llm.tokenizer, max_retries=0)
            return await run_episode(make_context(client, retriever, agent_cfg, temperature=0.0), ex, group=i)

        async def both():
            import asyncio
            return await asyncio.gather(*(one(i, ex) for i, ex in enumerate(examples)))
        remote = run_sync(both())
    for n, r in zip(native, remote, strict=True):
        assert r.stop_reason != "error", r.metadata
        assert (r.token_ids, r.roles, r.turn_ids) == (n.token_ids, n.roles, n.turn_ids)
        assert (r.answer, r.reward, [t.action for t in r.turns]) == (n.answer, n.reward, [t.action for t in n.turns])
        (rec,) = proxy.take(n.question_id).trajectories(n.question_id, n.question)
        assert (rec.token_ids, rec.roles, rec.turn_ids) == (n.token_ids, n.roles, n.turn_ids)
        assert r.logprobs == pytest.approx(rec.logprobs) and n.logprobs == pytest.approx(rec.logprobs, abs=1e-5)
    assert proxy.stats["splits"] == 0 and proxy.stats["calls"] == sum(t.num_turns for t in native)
    # one training step on each record: the same batch, hence the same loss and the same updated weights
    import copy

    import torch

    from training.batch import collate
    from training.config import TrainConfig
    from training.model.actor import update_policy

    def step(trajs):
        model = copy.deepcopy(tiny_llm.model).train()
        batch = collate(trajs, tiny_llm.tokenizer.pad_token_id, agent_cfg.max_total_tokens)
        batch.token_advantages = to_token_advantages(torch.tensor([1.0, -0.5]), batch.loss_mask)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stats = update_policy(model, None, opt, batch, TrainConfig(optim={"micro_batch": 2, "bf16": False}))
        return stats, torch.cat([p.detach().flatten() for p in model.parameters()])

    (s_native, w_native), (s_remote, w_remote) = step(native), step(remote)
    assert s_native == s_remote and s_native["grad_norm"] > 0  # every loss statistic, exactly
    assert torch.equal(w_native, w_remote) and not torch.equal(w_native, torch.cat(
        [p.detach().flatten() for p in tiny_llm.model.parameters()]))
