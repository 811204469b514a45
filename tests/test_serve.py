"""``sleuth serve``'s app on 127.0.0.1: the real ``openai`` client (chat, streaming and not), httpx for
/ask, bad input, a failing backend, and 100 concurrent clients sharing the batching scheduler."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx2
import pytest

from agent.llm import Generation
from agent.serve.app import create_app
from agent.serve.service import ServeLimits
from tests.test_agent_fakes import ScriptLLM, ServerThread

SCRIPTS = {"capital of France": ["<search> capital of France </search>", "<answer> Paris </answer>"],
           "Eiffel": ["<search> Gustave Eiffel </search>", "<answer> Dijon </answer>"],
           "rambling": ["<search> never closes the tag and keeps going"]}


@pytest.fixture()
def policy(tiny_llm):
    return ScriptLLM(tiny_llm.tokenizer, SCRIPTS)


@pytest.fixture()
def server(policy, retriever, agent_cfg):
    app = create_app(policy, retriever, agent_cfg, top_k=2, api_key="secret", limits=ServeLimits(request_timeout_s=20))
    with ServerThread(app) as srv:
        yield srv


def _h():
    return {"Authorization": "Bearer secret"}


def test_openai_client_chat_completion(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="secret", max_retries=0)
    r = client.chat.completions.create(model="sleuth-agent",
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content == "Paris" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0
    assert r.model_extra["sleuth"]["evidence"][0]["id"] == "p0"


def test_openai_client_streaming(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="secret", max_retries=0)
    stream = client.chat.completions.create(model="sleuth-agent", stream=True,
                                            messages=[{"role": "user", "content": "Where was the designer of the Eiffel Tower born?"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "Dijon" and chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_wrong_key_is_401(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_ask_with_httpx(server):
    r = httpx2.post(server.url + "/ask", headers=_h(), json={"question": "What is the capital of France?",
                                                           "golden_answers": ["Paris"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["answer"] == "Paris" and body["verdict"]["em"] == 1.0 and body["searches"] == 1
    assert [e["id"] for e in body["evidence"]][:1] == ["p0"] and "capital" in body["evidence"][0]["contents"]
    traj = body["trajectory"]
    assert len(traj["token_ids"]) == len(traj["roles"]) and traj["turns"][0]["action"] == "search"


def test_bad_requests_get_4xx_with_reasons_and_the_server_keeps_serving(server):
    url = server.url
    cases = [
        (httpx2.post(url + "/ask", headers=_h(), content=b"{not json"), 400, "not valid JSON"),
        (httpx2.post(url + "/ask", headers=_h(), json=["a list"]), 400, "JSON object"),
        (httpx2.post(url + "/ask", headers=_h(), json={"question": "   "}), 422, "empty"),
        (httpx2.post(url + "/ask", headers=_h(), json={"question": 3}), 422, "string"),
        (httpx2.post(url + "/ask", headers=_h(), json={"question": "x" * 100_000}), 413, "exceeds"),
        (httpx2.post(url + "/ask", headers=_h(), json={"question": "x" * 5_000}), 422, "limit is"),
        (httpx2.post(url + "/ask", headers=_h(), json={"question": "q", "top_k": 1000}), 422, "top_k"),
        (httpx2.post(url + "/ask", headers=_h(), json={"question": "q", "top_k": True}), 422, "top_k"),
        (httpx2.post(url + "/ask", json={"question": "q"}), 401, "API key"),
        (httpx2.post(url + "/v1/chat/completions", headers=_h(), json={"messages": []}), 422, "messages"),
        (httpx2.post(url + "/v1/chat/completions", headers=_h(), json={"messages": [{"role": "system", "content": "x"}]}), 422, "user"),
    ]
    for r, status, reason in cases:
        assert r.status_code == status, (r.status_code, r.text)
        assert reason in r.json()["error"]["message"]
    # a model that never closes its tag: the episode ends at the turn budget, with the reason
    r = httpx2.post(url + "/ask", headers=_h(), json={"question": "rambling question?"})
    assert r.status_code == 200 and r.json()["answer"] is None and r.json()["stop_reason"] == "max_turns"
    assert "unclosed <search>" in r.json()["trajectory"]["turns"][0]["error"]
    assert httpx2.get(url + "/health").json()["status"] == "ok"
    assert httpx2.post(url + "/ask", headers=_h(), json={"question": "What is the capital of France?"}).json()["answer"] == "Paris"


def test_backend_timeout_and_garbage_fail_the_request_not_the_server(tiny_llm, retriever, agent_cfg):
    class Bad:
        tokenizer = tiny_llm.tokenizer

        def __init__(self):
            self.mode = "hang"

        def generate(self, prompts, params):
            if self.mode == "hang":
                self.mode = "garbage"
                time.sleep(1.5)
            if self.mode == "garbage":
                raise ValueError("backend returned garbage: '<html>'")
            return [Generation([tiny_llm.tokenizer.eos_token_id], "") for _ in prompts]

    bad = Bad()
    app = create_app(bad, retriever, agent_cfg, limits=ServeLimits(request_timeout_s=0.5))
    with ServerThread(app) as srv:
        r = httpx2.post(srv.url + "/ask", json={"question": "anything?"}, timeout=10)
        assert r.status_code == 504 and "longer than 0.5 s" in r.json()["error"]["message"]
        time.sleep(1.2)  # the hung call returns; the next ones get garbage
        r = httpx2.post(srv.url + "/ask", json={"question": "anything?"}, timeout=10)
        assert r.status_code == 502 and "garbage" in r.json()["error"]["message"]
        bad.mode = "ok"
        r = httpx2.post(srv.url + "/ask", json={"question": "anything?"}, timeout=10)
        assert r.status_code == 200 and r.json()["stop_reason"] in ("max_turns", "answer")


def test_100_concurrent_clients_share_batches(policy, retriever, agent_cfg):
    app = create_app(policy, retriever, agent_cfg, top_k=2)
    with ServerThread(app) as srv:
        async def main():
            async with httpx2.AsyncClient(base_url=srv.url, timeout=60,
                                         limits=httpx2.Limits(max_connections=100)) as c:
                qs = ["What is the capital of France?", "Where was the designer of the Eiffel Tower born?"]
                return await asyncio.gather(*(c.post("/ask", json={"question": qs[i % 2] + f" ({i})"}) for i in range(100)))

        rs = asyncio.run(main())
        health = httpx2.get(srv.url + "/health").json()
    assert all(r.status_code == 200 for r in rs)
    assert [r.json()["answer"] for r in rs] == ["Paris", "Dijon"] * 50
    # 100 episodes x 2 turns went through far fewer backend calls than 200
    assert health["prompts"] == 200 and health["batches"] < 100
    assert max(policy.batches) > 1


def test_serve_command_binds_loopback_by_default():
    from sleuth.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000


@pytest.fixture(scope="module", autouse=True)
def threads_before_this_module():
    """The threads alive before this module's first test: other modules' leftovers are not this module's leak."""
    return set(threading.enumerate())


def _threads_started_here(before: set) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


def test_threads_are_not_leaked(threads_before_this_module):
    new = _threads_started_here(threads_before_this_module)
    assert len(new) < 10, new


# -- turn-by-turn streaming ---------------------------------------------------------------------------
def _sse(lines) -> list:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded (``[DONE]`` kept as a string)."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_run_episode_events_leave_the_trajectory_unchanged(policy, tiny_llm, retriever, agent_cfg):
    """``on_event`` streams the graph (astream) instead of ainvoke: the same trajectory, token for token,
    with the scripted policy (search, then answer) and with the tiny model (greedy; mostly invalid
    actions); the events mirror the recorded turns and arrive while the episode runs."""
    from agent.loop.episode import run_episode
    from agent.loop.nodes import make_context
    from tests.conftest import QUESTIONS

    for llm in (policy, tiny_llm):
        for ex in QUESTIONS[:2]:
            events: list[tuple[dict, int]] = []

            async def sink(e, llm=llm, events=events):
                events.append((e, len(getattr(llm, "batches", []))))

            async def both(ex=ex, llm=llm):
                plain = await run_episode(make_context(llm, retriever, agent_cfg, temperature=0.0), ex)
                streamed = await run_episode(make_context(llm, retriever, agent_cfg, temperature=0.0), ex,
                                             on_event=sink)
                return plain, streamed

            plain, streamed = asyncio.run(both())
            assert streamed.stop_reason != "error", streamed.metadata
            assert streamed.to_json() == plain.to_json()
            turns = [e for e, _ in events if e["type"] == "turn"]
            searches = [e for e, _ in events if e["type"] == "search"]
            assert [(e["turn"], e["text"], e["action"]) for e in turns] == [(t.index, t.text, t.action) for t in plain.turns]
            assert [(e["turn"], e["query"], e["doc_ids"]) for e in searches] == [
                (t.index, t.query, t.hit_ids) for t in plain.turns if t.action == "search"]
            if llm is policy:  # search then answer; the first turn's events come before the second generation
                assert [e["type"] for e, _ in events] == ["turn", "search", "turn"]
                assert searches[0]["query"] and searches[0]["doc_ids"]
                n_before = len(policy.batches) - 2  # the streamed episode's two generate calls are the last two
                assert [n - n_before for _, n in events] == [1, 1, 2]


class GatedLLM(ScriptLLM):
    """A scripted policy whose second and later generate calls wait for ``gate`` (at most 10 s); ``waited``
    records whether each wait was released (True) or timed out (False)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.waited = threading.Event(), []

    def generate(self, prompts, params):
        if self.batches:
            self.waited.append(self.gate.wait(10))
        return super().generate(prompts, params)


def test_stream_sends_turns_and_searches_while_the_episode_runs(tiny_llm, retriever, agent_cfg):
    """The first turn's reasoning and its search reach the client before the second turn is generated
    (the backend waits until the client has them); then the content equals the non-streamed answer."""
    llm = GatedLLM(tiny_llm.tokenizer, SCRIPTS)
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=20))
    q = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with ServerThread(app) as srv:
        with httpx2.stream("POST", srv.url + "/v1/chat/completions", json=q | {"stream": True}, timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            got, lines = [], r.iter_lines()
            for line in lines:
                got += _sse([line])
                if got and isinstance(got[-1], dict) and got[-1].get("sleuth", {}).get("event") == "search":
                    llm.gate.set()  # only now may the second turn be generated
                    break
            got += _sse(lines)
        llm.gate.set()
        plain = httpx2.post(srv.url + "/v1/chat/completions", json=q, timeout=30).json()
    assert llm.waited[0] is True  # released by the client, not by the backstop
    assert got[-1] == "[DONE]" and all("error" not in c for c in got[:-1])
    deltas = [c["choices"][0]["delta"] for c in got[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
    content = [i for i, d in enumerate(deltas) if d.get("content")]
    assert len(reasoning) == 2 and len(content) == 1 and max(reasoning) < content[0]
    assert deltas[reasoning[0]]["reasoning_content"] == SCRIPTS["capital of France"][0]
    assert deltas[reasoning[1]]["reasoning_content"] == "\n\n" + SCRIPTS["capital of France"][1]
    assert [got[i]["sleuth"]["action"] for i in reasoning] == ["search", "answer"]
    search = [c["sleuth"] for c in got[:-1] if c.get("sleuth", {}).get("event") == "search"]
    assert len(search) == 1 and search[0]["query"] == "capital of France" and search[0]["doc_ids"][0] == "p0"
    assert reasoning[0] < got.index(next(c for c in got if c.get("sleuth", {}).get("event") == "search")) < reasoning[1]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == plain["choices"][0]["message"]["content"] == "Paris"
    assert got[-2]["choices"][0]["finish_reason"] == "stop" and got[-2]["sleuth"]["evidence"][0]["id"] == "p0"


def test_openai_client_reads_streamed_reasoning_and_search_events(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="secret", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="sleuth-agent", stream=True,
        messages=[{"role": "user", "content": "Where was the designer of the Eiffel Tower born?"}]))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == "\n\n".join(SCRIPTS["Eiffel"])
    events = [c.model_extra["sleuth"] for c in chunks if (c.model_extra or {}).get("sleuth", {}).get("event")]
    assert [e["event"] for e in events] == ["turn", "search", "turn"]
    assert events[1]["query"] == "Gustave Eiffel" and events[1]["doc_ids"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Dijon"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].model_extra["sleuth"]["searches"] == 1


def test_stream_errors_arrive_as_an_error_event(tiny_llm, retriever, agent_cfg):
    class Broken:
        tokenizer = tiny_llm.tokenizer

        def generate(self, prompts, params):
            raise ValueError("backend returned garbage")

    app = create_app(Broken(), retriever, agent_cfg)
    body = {"stream": True, "messages": [{"role": "user", "content": "anything?"}]}
    with ServerThread(app) as srv, httpx2.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
        got = _sse(r.iter_lines())
    assert got[-1]["error"]["code"] == 502 and "garbage" in got[-1]["error"]["message"]
    assert "[DONE]" not in got


def test_client_disconnect_cancels_the_streamed_episode(tiny_llm, retriever, agent_cfg):
    llm = GatedLLM(tiny_llm.tokenizer, SCRIPTS)
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=20))
    body = {"stream": True, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with ServerThread(app) as srv:
        with httpx2.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if '"event": "search"' in line:
                    break  # the episode now waits for the gated backend; hang up
        assert httpx2.get(srv.url + "/health").json()["inflight"] in (0, 1)
        deadline = time.time() + 5
        while httpx2.get(srv.url + "/health").json()["inflight"] and time.time() < deadline:
            time.sleep(0.05)
        inflight = httpx2.get(srv.url + "/health").json()["inflight"]
        llm.gate.set()  # let the backend thread finish
    assert inflight == 0  # cancelled well before the backend (gated for 10 s) or the 20 s timeout


def test_threads_are_not_leaked_after_streaming(threads_before_this_module):
    new = _threads_started_here(threads_before_this_module)
    assert len(new) < 10, new


def test_malformed_chat_content_parts_get_422_not_500(server):
    url = server.url + "/v1/chat/completions"
    for content in ([{"type": "text", "text": 3}], [{"type": "text", "text": None}], ["plain string part"], {"text": "q"}):
        r = httpx2.post(url, headers=_h(), json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 422, (content, r.status_code, r.text)
        assert "content" in r.json()["error"]["message"] or "string" in r.json()["error"]["message"]
    r = httpx2.post(url, headers=_h(), json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris"


def test_deeply_nested_json_body_gets_400_not_500(server):
    # 20 kB of '[' is within max_body_bytes but past json's recursion limit (RecursionError, not a JSONDecodeError)
    for path in ("/ask", "/v1/chat/completions"):
        r = httpx2.post(server.url + path, headers=_h(), content=b"[" * 20_000 + b"]" * 20_000)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "nested" in r.json()["error"]["message"]
    assert httpx2.get(server.url + "/health").json()["status"] == "ok"


def test_question_whose_prompt_exceeds_the_token_budget_gets_422_with_the_excess(server):
    # 1,500 CJK characters are within max_question_chars (4,000) but thousands of tokens (512 budget)
    q = "capital of France? " + "東京都の人口" * 250
    for path, body in (("/ask", {"question": q}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": q}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": q}], "stream": True})):
        r = httpx2.post(server.url + path, headers=_h(), json=body)
        assert r.status_code == 422, (path, r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "max_total_tokens" in msg and "512" in msg and "tokens" in msg, msg
    r = httpx2.post(server.url + "/ask", headers=_h(), json={"question": "What is the capital of France?"})
    assert r.status_code == 200 and r.json()["answer"] == "Paris"


def test_golden_answers_of_the_wrong_type_get_422(server):
    """``{}``, ``0``, ``""`` and ``false`` are no list of strings: they were read as "no gold" (``or []``)."""
    for golds in ({}, 0, "", False, "Paris", [1]):
        r = httpx2.post(server.url + "/ask", headers=_h(), json={"question": "capital of France?", "golden_answers": golds})
        assert r.status_code == 422 and "golden_answers" in r.json()["error"]["message"], (golds, r.status_code)
    r = httpx2.post(server.url + "/ask", headers=_h(), json={"question": "capital of France?", "golden_answers": None})
    assert r.status_code == 200  # null is the field left out


def test_question_with_a_lone_surrogate_gets_422_not_500(server):
    # "\ud800" is valid JSON but no Unicode text: the tokenizer (and UTF-8 output) cannot take it
    for path, body in (("/ask", b'{"question": "capital of France \\ud800?"}'),
                       ("/ask", b'{"question": "capital of France?", "golden_answers": ["Paris\\udc80"]}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "France \\udfff?"}]}'),
                       ("/v1/chat/completions", b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "France?"}]}')):
        r = httpx2.post(server.url + path, headers={**_h(), "content-type": "application/json"}, content=body)
        assert r.status_code == 422, (path, r.status_code, r.text[:300])
        assert "surrogate" in r.json()["error"]["message"]
    assert httpx2.get(server.url + "/health").json()["status"] == "ok"


def test_without_golden_answers_an_llm_judge_is_not_called(tiny_llm, retriever, agent_cfg):
    """With agent.judge=llm, a question sent without golden answers was still judged by the LLM against the
    gold "" (one wasted generation per request; no verdict is returned anyway). With golds it is judged."""
    from tests.test_agent_fakes import Recorder

    rec = Recorder(ScriptLLM(tiny_llm.tokenizer, SCRIPTS))
    cfg = agent_cfg.model_copy(update={"judge": "llm"})
    app = create_app(rec, retriever, cfg, top_k=2, limits=ServeLimits(request_timeout_s=20))

    def judge_calls():
        return sum("VERDICT" in tiny_llm.tokenizer.decode(p) for p in rec.prompts)

    with ServerThread(app) as srv:
        r = httpx2.post(srv.url + "/ask", json={"question": "What is the capital of France?"}, timeout=30)
        assert r.status_code == 200 and r.json()["answer"] == "Paris" and r.json()["verdict"] is None
        assert judge_calls() == 0
        r = httpx2.post(srv.url + "/ask", json={"question": "What is the capital of France?",
                                                "golden_answers": ["Paris"]}, timeout=30)
        assert r.status_code == 200 and r.json()["verdict"] is not None and judge_calls() == 1


def test_a_judge_given_to_the_server_scores_answers_sent_with_golds(tiny_llm, retriever, agent_cfg):
    """``agent.llm_judge.model`` (a judge on its own model) reaches ``sleuth serve`` as ``create_app(judge=)``:
    answers sent with golds are scored by it, not by the policy; without golds the rule judge still runs."""
    from tests.test_agent_fakes import Recorder

    rec = Recorder(ScriptLLM(tiny_llm.tokenizer, SCRIPTS))
    cfg = agent_cfg.model_copy(update={"judge": "llm"})
    judged = []

    def judge(traj):
        judged.append(traj.answer)
        return 0.5, {"em": 0.0, "judge": "own"}

    app = create_app(rec, retriever, cfg, top_k=2, limits=ServeLimits(request_timeout_s=20), judge=judge)
    with ServerThread(app) as srv:
        for k in (None, 1):  # the default top-k and another one (a context made per request)
            r = httpx2.post(srv.url + "/ask", json={"question": "What is the capital of France?", "top_k": k,
                                                    "golden_answers": ["Paris"]}, timeout=30)
            assert r.status_code == 200 and r.json()["verdict"]["judge"] == "own"
        r = httpx2.post(srv.url + "/ask", json={"question": "What is the capital of France?"}, timeout=30)
        assert r.status_code == 200 and r.json()["verdict"] is None
    assert judged == ["Paris", "Paris"]
    assert not any("VERDICT" in tiny_llm.tokenizer.decode(p) for p in rec.prompts)  # the policy never judged


def test_json_number_past_the_int_digit_limit_gets_400_not_500(server):
    # 5,000 digits is valid JSON within max_body_bytes, but past Python's int-string limit (4,300): json.loads
    # raises a plain ValueError (neither JSONDecodeError nor UnicodeDecodeError)
    for path, body in (("/ask", b'{"question": "capital of France?", "top_k": ' + b"1" * 5000 + b"}"),
                       ("/v1/chat/completions", b'{"messages": [], "n": ' + b"9" * 5000 + b"}")):
        r = httpx2.post(server.url + path, headers={**_h(), "content-type": "application/json"}, content=body)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert "not valid JSON" in r.json()["error"]["message"] and "digits" in r.json()["error"]["message"]
    r = httpx2.post(server.url + "/ask", headers=_h(), json={"question": "What is the capital of France?"})
    assert r.status_code == 200 and r.json()["answer"] == "Paris"


def test_chat_model_and_stream_of_the_wrong_type_get_422(server):
    # a non-string model was echoed back as the reply's model (["\ud800"]: a 500 when encoding the reply;
    # {"a": 1}: a 200 that no OpenAI client can parse), and any truthy stream ("false") streamed
    url, ok = server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    for body, field in ((b'{"model": ["\\ud800"], "messages": [{"role": "user", "content": "France?"}]}', "model"),
                        (b'{"model": {"a": 1}, "messages": [{"role": "user", "content": "France?"}]}', "model"),
                        (b'{"stream": "false", "messages": [{"role": "user", "content": "France?"}]}', "stream")):
        r = httpx2.post(url, headers={**_h(), "content-type": "application/json"}, content=body)
        assert r.status_code == 422, (body, r.status_code, r.text[:300])
        assert field in r.json()["error"]["message"]
    r = httpx2.post(url, headers=_h(), json=ok | {"model": None, "stream": False})
    assert r.status_code == 200 and r.json()["model"] == "sleuth-agent"
    assert r.json()["choices"][0]["message"]["content"] == "Paris"


def test_a_backend_raising_stopiteration_fails_its_request_and_the_server_keeps_serving(tiny_llm, retriever, agent_cfg):
    # StopIteration (a bare next() in a backend or retriever) cannot be set on an asyncio future: the batch's
    # awaited result never arrived and the scheduler stayed busy, so every later request timed out too
    llm = ScriptLLM(tiny_llm.tokenizer, SCRIPTS)
    calls = []

    class Flaky:
        tokenizer = tiny_llm.tokenizer

        def generate(self, prompts, params):
            calls.append(len(prompts))
            if len(calls) == 1:
                raise StopIteration
            return llm.generate(prompts, params)

    app = create_app(Flaky(), retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=5))
    with ServerThread(app) as srv:
        q = {"question": "What is the capital of France?"}
        r = httpx2.post(srv.url + "/ask", json=q, timeout=30)
        assert r.status_code == 502 and "StopIteration" in r.json()["error"]["message"], (r.status_code, r.text)
        r = httpx2.post(srv.url + "/ask", json=q, timeout=30)
        assert r.status_code == 200 and r.json()["answer"] == "Paris", (r.status_code, r.text)


def test_client_disconnect_cancels_a_non_streamed_episode(tiny_llm, retriever, agent_cfg):
    # a client that gave up (its timeout, a closed tab) left its episode running to the end or to the server's
    # timeout, holding one of max_inflight slots: hostile clients could fill them all by hanging up
    llm = GatedLLM(tiny_llm.tokenizer, SCRIPTS)
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=20))
    q = "What is the capital of France?"
    with ServerThread(app) as srv:
        for path, body in (("/ask", {"question": q}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": q}]})):
            with pytest.raises(httpx2.TimeoutException):  # the second turn waits for the gate: the client hangs up
                httpx2.post(srv.url + path, json=body, timeout=1.0)
            deadline = time.time() + 5
            while httpx2.get(srv.url + "/health").json()["inflight"] and time.time() < deadline:
                time.sleep(0.05)
            assert httpx2.get(srv.url + "/health").json()["inflight"] == 0, path
        llm.gate.set()  # let the backend thread finish
        r = httpx2.post(srv.url + "/ask", json={"question": q}, timeout=30)
        assert r.status_code == 200 and r.json()["answer"] == "Paris"
    assert llm.waited[0] is True  # the gate was still holding the first episode when the client left


def test_unknown_routes_and_unexpected_failures_answer_in_the_error_shape(tiny_llm, retriever, agent_cfg):
    # 404/405 came as FastAPI's {"detail": ...} and an unexpected exception (here the tokenizer failing on a
    # question) as a text/plain "Internal Server Error": neither had {"error": {"message", "type"}}
    class Tok:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode(self, text, **kw):
            if "BOOM" in text:
                raise ValueError("tokenizer exploded")
            return self.inner.encode(text, **kw)

    llm = ScriptLLM(Tok(tiny_llm.tokenizer), SCRIPTS)
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=20))
    with ServerThread(app) as srv:
        for r, status in ((httpx2.get(srv.url + "/nope"), 404), (httpx2.get(srv.url + "/ask"), 405),
                          (httpx2.post(srv.url + "/ask", json={"question": "BOOM?"}), 500)):
            assert r.status_code == status, (r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"], err
        assert "tokenizer exploded" in err["message"]
        r = httpx2.post(srv.url + "/ask", json={"question": "What is the capital of France?"}, timeout=30)
        assert r.status_code == 200 and r.json()["answer"] == "Paris"


# -- max_inflight and streaming -----------------------------------------------------------------------
def test_a_streamed_request_over_max_inflight_gets_503_before_any_stream(tiny_llm, retriever, agent_cfg):
    # the slot was taken inside the streamed episode's task, after the 200 and the role chunk had gone out:
    # a client over the limit got 200 and then an error event, which OpenAI clients do not retry
    llm = GatedLLM(tiny_llm.tokenizer, SCRIPTS)
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=20, max_inflight=2))
    body = {"stream": True, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    url = "/v1/chat/completions"
    with ServerThread(app) as srv:
        async def main():
            async with httpx2.AsyncClient(base_url=srv.url, timeout=30) as c:
                async def one():
                    async with c.stream("POST", url, json=body) as r:
                        return r.status_code, r.headers.get("content-type", ""), (await r.aread()).decode()

                tasks = [asyncio.create_task(one()) for _ in range(5)]
                while httpx2.get(srv.url + "/health").json()["inflight"] < 2:  # two episodes hold the slots
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                over = await c.post(url, json=body)  # over the limit while the two run
                llm.gate.set()
                return await asyncio.gather(*tasks), over

        got, over = asyncio.run(main())
        after = httpx2.post(srv.url + url, json=body, timeout=30)
        inflight = httpx2.get(srv.url + "/health").json()["inflight"]
    import json

    assert sorted(s for s, _, _ in got) == [200, 200, 503, 503, 503]
    for status, ctype, text in got + [(over.status_code, over.headers["content-type"], over.text)]:
        if status == 503:
            assert ctype.startswith("application/json"), ctype
            err = json.loads(text)["error"]
            assert "busy" in err["message"] and err["type"] == "server_error"
        else:
            assert ctype.startswith("text/event-stream") and text.rstrip().endswith("data: [DONE]")
    assert over.status_code == 503
    assert after.status_code == 200 and after.text.rstrip().endswith("data: [DONE]")
    assert inflight == 0


def test_a_streamed_episode_frees_its_slot_on_error_timeout_and_success(tiny_llm, retriever, agent_cfg):
    script = ScriptLLM(tiny_llm.tokenizer, SCRIPTS)

    class Moody:
        tokenizer = tiny_llm.tokenizer
        mode = "error"

        def generate(self, prompts, params):
            if self.mode == "error":
                raise ValueError("backend returned garbage")
            if self.mode == "hang":
                time.sleep(1.0)
            return script.generate(prompts, params)

    llm = Moody()
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=0.5, max_inflight=1))
    body = {"stream": True, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with ServerThread(app) as srv:
        for mode, code in (("error", 502), ("hang", 504), ("ok", None)):
            llm.mode = mode
            with httpx2.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
                assert r.status_code == 200, (mode, r.read())
                got = _sse(r.iter_lines())
            if code is None:
                assert got[-1] == "[DONE]"
            else:
                assert got[-1]["error"]["code"] == code, (mode, got[-1])
            assert httpx2.get(srv.url + "/health").json()["inflight"] == 0, mode
            time.sleep(0.7)  # a hung backend call returns before the next mode


def test_a_busy_503_asks_clients_to_retry_after_a_second(tiny_llm, retriever, agent_cfg):
    """Over max_inflight, /ask and chat (streamed or not) answer 503 with ``Retry-After: 1`` and the usual
    JSON error; other errors carry no Retry-After (a 422 retried later would fail the same way)."""
    llm = GatedLLM(tiny_llm.tokenizer, SCRIPTS)
    llm.batches.append(1)  # every generate call waits for the gate
    app = create_app(llm, retriever, agent_cfg, top_k=2, limits=ServeLimits(request_timeout_s=20, max_inflight=1))
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with ServerThread(app) as srv:
        held = threading.Thread(target=httpx2.post, args=(srv.url + "/ask",),
                                kwargs={"json": {"question": "What is the capital of France?"}, "timeout": 30})
        held.start()
        try:
            while httpx2.get(srv.url + "/health").json()["inflight"] < 1:
                time.sleep(0.02)
            replies = [httpx2.post(srv.url + "/ask", json={"question": "Eiffel?"}, timeout=30),
                       httpx2.post(srv.url + "/v1/chat/completions", json=chat, timeout=30),
                       httpx2.post(srv.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=30)]
            bad = httpx2.post(srv.url + "/ask", json={"question": ""}, timeout=30)
        finally:
            llm.gate.set()
            held.join(30)
    for r in replies:
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.headers)
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["type"] == "server_error" and "busy" in r.json()["error"]["message"]
    assert bad.status_code == 422 and "retry-after" not in bad.headers


def test_serve_command_sets_max_inflight(monkeypatch, capsys):
    """`sleuth serve` built its limits with the default max_inflight of 512 and no way to change it;
    ``--max-inflight N`` sets it (uvicorn's own connection limit stays above it), and 0 is a usage error."""
    import uvicorn

    import agent.backends.build
    import agent.serve.app
    import sleuth.commands.serve
    import sleuth.pipeline
    from sleuth.cli import main

    got = {}
    monkeypatch.setattr(sleuth.commands.serve, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(sleuth.pipeline, "open_retriever", lambda cfg, index=None: object())
    monkeypatch.setattr(sleuth.pipeline, "resolve_model_path", lambda m: m)
    monkeypatch.setattr(sleuth.pipeline, "check_context_length", lambda cfg, model: None)
    monkeypatch.setattr(sleuth.pipeline, "answer_judge", lambda cfg: None)
    monkeypatch.setattr(agent.backends.build, "make_llm", lambda *a, **kw: object())
    monkeypatch.setattr(agent.serve.app, "create_app",
                        lambda *a, limits, **kw: got.setdefault("limits", limits))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.setdefault("uvicorn", kw))
    assert main(["serve", "--model", "m", "--max-inflight", "3000"]) == 0
    assert got["limits"].max_inflight == 3000 and got["uvicorn"]["limit_concurrency"] > 3000
    got.clear()
    assert main(["serve", "--model", "m"]) == 0
    assert got["limits"].max_inflight == 512
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-inflight", "0"])
    assert e.value.code == 2 and "--max-inflight" in capsys.readouterr().err
