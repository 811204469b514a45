"""Token exactness of the training proxy across chat-template families (ChatML with tool calls, Qwen3-style
reasoning that is dropped from earlier rounds, Llama-3-style headers), with and without tools: an agent
talks to the proxy with the real ``openai`` client, and every trained token of every stitched sequence is
one the backend sampled, at the place it sampled it, with its log-probability. The split counter says how
often a template rewrote history (Qwen3-style, once per new user round), and a split never trains a token
that was re-tokenised."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from agent.external.proxy import Proxy, ProxyServer, ProxySettings
from agent.llm import decode
from agent.protocols.base import format_docs
from agent.protocols.function_call import SEARCH_TOOL
from agent.trajectory import Role
from tests.chat_templates import CALLS, FAMILIES, Recording, ScriptedSampler

QUESTIONS = ["What is the capital of France?", "Where was the designer of the Eiffel Tower born?"]
FOLLOW_UP = "And which country is that in?"


async def agent(base_url: str, question: str, retriever, tools: bool, rounds: int) -> str:
    """A plain tool-calling agent: call the model, run its search calls, repeat; ``rounds`` user turns."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
    answer = ""
    for r in range(rounds):
        for _ in range(3):
            kw = {"tools": [SEARCH_TOOL]} if tools else {}
            resp = await client.chat.completions.create(model="policy", messages=msgs, **kw)
            m = resp.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            answer = m.content or ""
            if not m.tool_calls:
                break
            for tc in m.tool_calls:
                hits = retriever.search([json.loads(tc.function.arguments)["query"]], 2)[0]
                msgs.append({"role": "tool", "tool_call_id": tc.id, "content": format_docs(hits, 80)})
        if r + 1 < rounds:
            msgs.append({"role": "user", "content": FOLLOW_UP})
    await client.close()
    return answer


def run_agents(backend, retriever, tools: bool, rounds: int, n: int = 2):
    """Run ``n`` episodes per question concurrently through a proxy over ``backend``; returns the stitched
    sequences, the proxy's counters and the episode records."""
    proxy = Proxy(backend, ProxySettings(max_new_tokens=24, max_total_tokens=4000, temperature=1.0))
    ids = [f"ep{i}" for i in range(n * len(QUESTIONS))]
    with ProxyServer(proxy) as server:
        async def main():
            return await asyncio.gather(*(agent(server.base_url(e), QUESTIONS[i % len(QUESTIONS)], retriever, tools,
                                                rounds) for i, e in enumerate(ids)))
        answers = asyncio.run(main())
    seqs, logs = [], []
    for e, a in zip(ids, answers, strict=True):
        logs.append(proxy.take(e))
        seqs += logs[-1].trajectories(e, "q", answer=a)
    return seqs, proxy.stats, logs


def rewrites(tok, logs) -> int:
    """How many calls' rendered conversations do not continue, *in text*, the previous call's rendered prompt
    plus its sampled output (the template rewrote history): the splits a proxy that keeps the sampled ids
    must count, no more (re-tokenising the history splits wherever the sampled ids are not the tokenizer's
    own split of their text) and no fewer."""
    return sum(not b.text.startswith(a.text + decode(tok, a.output_ids))
               for log in logs for a, b in zip(log.calls, log.calls[1:]))


def assert_every_trained_token_was_sampled(seqs, calls) -> None:
    """Each turn's policy tokens are one backend call's sampled ids, right after that call's prompt, with
    its log-probabilities; every backend call is one turn of one sequence; nothing else is trainable."""
    pool = list(calls)
    for t in seqs:
        t.check()
        assert t.roles[0] == Role.PROMPT and t.logprobs is not None
        for k in sorted({k for k, r in zip(t.turn_ids, t.roles) if r == Role.POLICY}):
            pos = [i for i in range(len(t)) if t.turn_ids[i] == k and t.roles[i] == Role.POLICY]
            a, b = pos[0], pos[-1] + 1
            assert pos == list(range(a, b))
            call = (t.token_ids[:a], t.token_ids[a:b], t.logprobs[a:b])
            assert call in pool, f"turn {k}: trained tokens or log-probs that no backend call sampled after this prefix"
            pool.remove(call)  # each sampled turn is trained once
        assert all(lp == 0.0 for lp, r in zip(t.logprobs, t.roles) if r != Role.POLICY)
    assert not pool, f"{len(pool)} sampled turns are in no sequence"


@pytest.mark.parametrize("tools", [True, False], ids=["tools", "no-tools"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scripted_tool_calls_are_exact(tiny_llm, retriever, family, tools):
    tok = tiny_llm.tokenizer
    tok.chat_template = FAMILIES[family]
    backend = Recording(ScriptedSampler(tok, [CALLS[family], "<answer> Paris </answer>"]))
    seqs, stats, _ = run_agents(backend, retriever, tools, rounds=1)
    assert_every_trained_token_was_sampled(seqs, backend.calls)
    if tools:  # search, then answer, in one sequence per episode: the templates render the calls back as sampled
        assert stats["splits"] == 0 and len(seqs) == 4
        assert all([x.action for x in t.turns] == ["search", "answer"] for t in seqs)
        assert all(t.turns[0].query == "capital of France" for t in seqs)
        tool_text = decode(tok, [i for i, r in zip(seqs[0].token_ids, seqs[0].roles) if r == Role.TOOL])
        assert "Doc 1(Title: Paris)" in tool_text
    else:  # no tools declared: the call is plain text, the answer
        assert all(t.num_turns == 1 and t.turns[0].action == "answer" for t in seqs)
    print(f"{family} tools={tools}: {len(seqs)} sequences, splits={stats['splits']}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_new_user_round_splits_only_where_the_template_rewrites_history(tiny_llm, retriever, family):
    """Qwen3-style: the first round's reasoning is dropped once the user speaks again, so the second round is
    a new sequence (one split per episode), its prompt holding the rewritten history as masked tokens;
    the other families render history as it was sampled and stay one sequence."""
    tok = tiny_llm.tokenizer
    tok.chat_template = FAMILIES[family]
    backend = Recording(ScriptedSampler(tok, [CALLS[family], "<think>\nok\n</think>\n\n<answer> Paris </answer>",
                                              "<answer> France </answer>"]))
    seqs, stats, _ = run_agents(backend, retriever, True, rounds=2)
    assert_every_trained_token_was_sampled(seqs, backend.calls)
    episodes = 4
    if family == "qwen3":
        assert stats["splits"] == episodes and len(seqs) == 2 * episodes
        second = [t for t in seqs if t.metadata["segment"] == 1]
        assert all(t.metadata["segments"] == 2 for t in seqs)
        prompt = decode(tok, second[0].token_ids[: second[0].prompt_len])
        assert "I should look it up" not in prompt and FOLLOW_UP in prompt  # history rewritten, masked
    else:
        assert stats["splits"] == 0 and len(seqs) == episodes
    print(f"{family} two rounds: {len(seqs)} sequences, splits={stats['splits']}")


@pytest.mark.parametrize("tools", [True, False], ids=["tools", "no-tools"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_sampling_is_exact_with_its_logprobs(tiny_llm, retriever, family, tools):
    """The tiny policy sampling at temperature 1 (any bytes, cut turns, stray EOS): the trained tokens are still
    exactly the sampled ones with the backend's own log-probabilities, however often the template split."""
    tok = tiny_llm.tokenizer
    tok.chat_template = FAMILIES[family]
    backend = Recording(tiny_llm)
    seqs, stats, logs = run_agents(backend, retriever, tools, rounds=2)
    assert_every_trained_token_was_sampled(seqs, backend.calls)
    assert all(math.isfinite(x) and x <= 0 for t in seqs for x in t.logprobs)
    assert stats["calls"] == len(backend.calls) >= 8
    # a split exactly where the template rewrote the history's text: ChatML renders every turn as sampled (0);
    # Llama 3 trims contents, so a sampled turn with surrounding whitespace is rewritten
    expected = rewrites(tok, logs)
    assert stats["splits"] == expected, f"{stats['splits']} splits where the template rewrote history {expected} times"
    assert len(seqs) == 4 + expected
    if family == "chatml":
        assert expected == 0
    print(f"{family} tools={tools} sampled: {len(seqs)} sequences, splits={stats['splits']}")
