"""``sleuth serve``'s per-request settings (``top_k``, ``max_turns``, ``golden_answers`` on /ask and chat) and
what the stream's ``sleuth`` events carry for a client that shows the episode (the retrieved passages of
each search, an invalid action's reason, a self-judgement, the judge's verdict)."""

from __future__ import annotations

import json

import httpx2
import pytest

from agent.serve.app import create_app
from agent.serve.service import ServeLimits
from tests.test_agent_fakes import ScriptLLM, ServerThread

SCRIPTS = {"capital of France": ["<search> capital of France </search>", "<answer> Paris </answer>"],
           "Eiffel": ["<search> Gustave Eiffel </search>",
                      "<judge> useful </judge> <search> Dijon </search>", "<answer> Dijon </answer>"],
           "garbled": ["<serch> oops", "<answer> no idea </answer>"]}
FRANCE = "What is the capital of France?"


@pytest.fixture()
def server(tiny_llm, retriever, agent_cfg):
    app = create_app(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, agent_cfg, top_k=2,
                     limits=ServeLimits(request_timeout_s=20, max_top_k=4))
    with ServerThread(app) as srv:
        yield srv


def _stream(url: str, question: str, **more) -> list:
    """The decoded ``data:`` payloads of one streamed chat request (``[DONE]`` kept as a string)."""
    body = {"stream": True, "messages": [{"role": "user", "content": question}], **more}
    out = []
    with httpx2.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _events(chunks: list) -> list[dict]:
    return [c["sleuth"] for c in chunks if isinstance(c, dict) and "event" in c.get("sleuth", {})]


def test_search_events_carry_the_retrieved_passages_with_this_querys_scores(server, retriever):
    chunks = _stream(server.url, FRANCE)
    (search,) = [e for e in _events(chunks) if e["event"] == "search"]
    expected = retriever.search(["capital of France"], 2)[0]
    assert [h["id"] for h in search["hits"]] == search["doc_ids"] == [h.id for h in expected]
    for got, hit in zip(search["hits"], expected, strict=True):
        assert got == {"id": hit.id, "title": hit.title, "text": hit.text, "score": pytest.approx(hit.score)}
    assert search["hits"][0]["title"] == "Paris" and "capital" in search["hits"][0]["text"]
    # the finish chunk's evidence is unchanged by the extra fields, and no verdict without golden answers
    assert chunks[-2]["sleuth"]["evidence"][0]["id"] == "p0" and chunks[-2]["sleuth"]["verdict"] is None


def test_turn_events_carry_an_invalid_actions_reason_and_a_self_judgement(tiny_llm, retriever, agent_cfg):
    cfg = agent_cfg.model_copy(update={"self_judge": True, "max_new_tokens": 64})
    app = create_app(ScriptLLM(tiny_llm.tokenizer, SCRIPTS), retriever, cfg, top_k=2,
                     limits=ServeLimits(request_timeout_s=20))
    with ServerThread(app) as srv:
        turns = [e for e in _events(_stream(srv.url, "Where was the designer of the Eiffel Tower born?"))
                 if e["event"] == "turn"]
        garbled = [e for e in _events(_stream(srv.url, "A garbled question?")) if e["event"] == "turn"]
    assert [t["action"] for t in turns] == ["search", "search", "answer"], turns
    assert "judgement" not in turns[0] and turns[1]["judgement"] == "useful" and "error" not in turns[1]
    assert garbled[0]["action"] == "invalid" and garbled[0]["error"]


def test_chat_takes_top_k_and_max_turns_per_request(server):
    search = [e for e in _events(_stream(server.url, FRANCE, top_k=1)) if e["event"] == "search"]
    assert len(search[0]["hits"]) == 1
    search = [e for e in _events(_stream(server.url, FRANCE, top_k=3)) if e["event"] == "search"]
    assert len(search[0]["hits"]) == 3  # above the server's top_k of 2 (three passages match the query)
    chunks = _stream(server.url, FRANCE, max_turns=1)  # the last turn's search is not run: no turn would read it
    assert [(e["event"], e["action"]) for e in _events(chunks)] == [("turn", "search")]
    assert chunks[-2]["sleuth"]["stop_reason"] == "max_turns" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    msgs = [{"role": "user", "content": FRANCE}]
    r = httpx2.post(server.url + "/v1/chat/completions", timeout=30, json={"messages": msgs, "max_turns": 1})
    assert r.status_code == 200 and r.json()["sleuth"]["stop_reason"] == "max_turns"
    r = httpx2.post(server.url + "/v1/chat/completions", timeout=30, json={"messages": msgs, "top_k": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris"
    assert len(r.json()["sleuth"]["evidence"]) == 1
    # the server's own settings are untouched by those requests
    r = httpx2.post(server.url + "/ask", json={"question": FRANCE}, timeout=30).json()
    assert r["answer"] == "Paris" and len(r["trajectory"]["turns"]) == 2 and len(r["evidence"]) == 2


def test_ask_takes_max_turns(server):
    r = httpx2.post(server.url + "/ask", json={"question": FRANCE, "max_turns": 1}, timeout=30).json()
    assert r["answer"] is None and r["stop_reason"] == "max_turns" and len(r["trajectory"]["turns"]) == 1
    r = httpx2.post(server.url + "/ask", json={"question": FRANCE, "max_turns": 3}, timeout=30).json()
    assert r["answer"] == "Paris"


@pytest.mark.parametrize("field,value,reason", [
    ("max_turns", 0, "[1, 3]"), ("max_turns", 4, "agent.max_turns"), ("max_turns", True, "max_turns"),
    ("max_turns", "2", "max_turns"), ("max_turns", 2.5, "max_turns"),
    ("top_k", 5, "[1, 4]"), ("top_k", 0, "top_k"), ("top_k", False, "top_k"),
    ("golden_answers", "Paris", "golden_answers"), ("golden_answers", [1], "golden_answers")])
def test_per_request_settings_out_of_range_get_422_on_both_routes(server, field, value, reason):
    for path, body in (("/ask", {"question": FRANCE}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": FRANCE}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": FRANCE}], "stream": True})):
        r = httpx2.post(server.url + path, json=body | {field: value}, timeout=30)
        assert r.status_code == 422, (path, field, value, r.status_code, r.text[:300])
        assert reason in r.json()["error"]["message"] and field in r.json()["error"]["message"]
    assert httpx2.get(server.url + "/health").json()["inflight"] == 0


def test_chat_with_golden_answers_returns_the_judges_verdict(server):
    chunks = _stream(server.url, FRANCE, golden_answers=["Paris"])
    verdict = chunks[-2]["sleuth"]["verdict"]
    assert verdict["em"] == 1.0 and verdict["f1"] == 1.0
    r = httpx2.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": FRANCE}], "golden_answers": ["Berlin"]})
    assert r.status_code == 200 and r.json()["sleuth"]["verdict"]["em"] == 0.0


def test_health_reports_the_per_request_limits(server):
    h = httpx2.get(server.url + "/health").json()
    assert h["limits"] == {"top_k": 2, "max_top_k": 4, "max_turns": 3, "max_question_chars": 4000}
