"""Web search backends against fake Tavily and SearXNG servers on 127.0.0.1 (no network): results as hits,
the on-disk cache (a second identical run sends no request), rate limiting, retries on 429 and timeouts,
clear errors otherwise, and a rollout that survives a provider outage by failing those episodes only."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from corpora.formats import QAExample
from retrieval.web import WebSearch, WebSearchError, WebSearchUnavailable
from tests.test_agent_fakes import ScriptLLM, ServerThread


def fake_search_app(mode: dict) -> FastAPI:
    """Tavily (``POST /search``) and SearXNG (``GET /search?format=json``) in one app. ``mode["seen"]`` collects
    (method, query, auth); ``mode["script"]`` is a list of responses to give first (``429``, ``503``, ``400``,
    ``401``, ``"sleep"``, ``"garbage"``); ``mode["down_for"]`` a word whose queries always get 503."""
    app = FastAPI()
    mode.setdefault("seen", [])

    async def answer(request: Request, query: str, k: int):
        mode["seen"].append((request.method, query, request.headers.get("authorization")))
        if mode.get("down_for") and mode["down_for"] in query:
            return JSONResponse({"error": "outage"}, status_code=503)
        step = mode["script"].pop(0) if mode.get("script") else None
        if step == "sleep":
            await asyncio.sleep(1.0)
        elif step == "garbage":
            return JSONResponse({"answer": "no results field"})
        elif step == 429:
            return JSONResponse({"detail": "rate limited"}, status_code=429, headers={"Retry-After": "0"})
        elif isinstance(step, int):
            return JSONResponse({"detail": f"error {step}"}, status_code=step)
        results = [{"url": f"https://example.org/{query.replace(' ', '_')}/{i}", "title": f"{query} {i}",
                    "content": f"snippet {i} about {query}", **({"score": 1.0 - i / 10} if request.method == "POST"
                                                              else {})} for i in range(6)]
        return {"results": results[:k], "query": query}

    @app.post("/search")
    async def tavily(request: Request):
        body = await request.json()
        return await answer(request, body["query"], body["max_results"])

    @app.get("/search")
    async def searxng(request: Request, q: str, format: str):
        assert format == "json"
        return await answer(request, q, 10)

    return app


@pytest.fixture()
def fake():
    mode: dict = {}
    with ServerThread(fake_search_app(mode)) as server:
        yield server.url, mode


def make(provider, url, tmp_path, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("rate_per_s", 0)
    return WebSearch(provider, url, tmp_path / "cache", **kw)


@pytest.mark.parametrize("provider", ["tavily", "searxng"])
def test_hits_and_a_second_identical_run_sends_no_request(fake, tmp_path, monkeypatch, provider):
    url, mode = fake
    monkeypatch.setenv("TAVILY_API_KEY", "tv-key")
    queries = ["eiffel tower", "capital of france", "eiffel tower"]
    first = make(provider, url, tmp_path)
    hits = first.search(queries, 3)
    first.close()
    assert len(mode["seen"]) == 2 and first.stats["cache_hits"] == 1  # the repeat came from the cache
    assert [h.id for h in hits[0]] == [f"https://example.org/eiffel_tower/{i}" for i in range(3)]
    assert hits[0][0].title == "eiffel tower 0" and hits[0][0].text == "snippet 0 about eiffel tower"
    assert hits[0][0].score > hits[0][1].score > hits[0][2].score
    if provider == "tavily":
        assert mode["seen"][0] == ("POST", "eiffel tower", "Bearer tv-key")
    else:
        assert mode["seen"][0][:2] == ("GET", "eiffel tower") and mode["seen"][0][2] is None
    second = make(provider, url, tmp_path)  # a new run over the same questions: the cache is on disk
    assert second.search(queries, 3) == hits and len(mode["seen"]) == 2 and second.stats["requests"] == 0
    assert second.search(["eiffel tower"], 2)[0] == hits[0][:2] and len(mode["seen"]) == 3  # k is in the key
    second.close()


def test_429_and_timeouts_are_retried_with_backoff(fake, tmp_path, monkeypatch):
    url, mode = fake
    monkeypatch.setenv("TAVILY_API_KEY", "k")
    mode["script"] = [429, 503, "sleep"]
    ws = make("tavily", url, tmp_path, timeout_s=0.3, max_retries=3)
    (hits,) = ws.search(["dijon"], 2)
    assert len(hits) == 2 and ws.stats == {"requests": 4, "cache_hits": 0, "retries": 3}
    mode["script"] = [429] * 3
    ws2 = make("tavily", url, tmp_path / "other", max_retries=2)
    with pytest.raises(WebSearchUnavailable, match=r"failed after 3 attempts for 'paris' \(HTTP 429"):
        ws2.search(["paris"], 2)


@pytest.mark.parametrize("step, match", [(400, "answered HTTP 400 for 'q': .*error 400"),
                                         (401, r"refused the API key \(HTTP 401.*check \$TAVILY_API_KEY"),
                                         ("garbage", "not a result list")])
def test_other_errors_are_clear_and_not_retried(fake, tmp_path, monkeypatch, step, match):
    url, mode = fake
    monkeypatch.setenv("TAVILY_API_KEY", "k")
    mode["script"] = [step]
    ws = make("tavily", url, tmp_path)
    with pytest.raises(WebSearchError, match=match):
        ws.search(["q"], 2)
    assert len(mode["seen"]) == 1 and len(ws.cache) == 0  # nothing cached from a failure


def test_keys_urls_and_rate_limit(fake, tmp_path, monkeypatch):
    url, mode = fake
    monkeypatch.delenv("TAVILY_API_KEY", raising=False)
    monkeypatch.delenv("SEARXNG_URL", raising=False)
    with pytest.raises(ValueError, match="needs an API key in the environment variable TAVILY_API_KEY"):
        WebSearch("tavily", url, tmp_path)
    with pytest.raises(ValueError, match="needs the instance's URL"):
        WebSearch("searxng", None, tmp_path)
    with pytest.raises(ValueError, match="unknown web search provider 'bing'"):
        WebSearch("bing", url, tmp_path)
    ws = make("searxng", url, tmp_path, rate_per_s=10)
    t0 = time.monotonic()
    ws.search([f"q{i}" for i in range(4)], 1)
    assert time.monotonic() - t0 >= 0.3 - 1e-3 and len(mode["seen"]) == 4  # 4 requests at 10/s: 3 gaps of 0.1 s


def test_a_rollout_survives_a_provider_outage(fake, tmp_path, tiny_llm, agent_cfg, monkeypatch):
    """Through the trainer's rollout path (failed episodes rerun, those still failing left out): the episodes
    whose searches hit the outage fail with the provider's error and are dropped; the others train."""
    from sleuth.config import Config
    from sleuth.pipeline import open_retriever
    from training.rollout.faults import drop_failed, run_episodes_retrying

    url, mode = fake
    mode["down_for"] = "Eiffel"
    cfg = Config.model_validate({"retrieval": {"method": "web", "web_provider": "searxng", "web_url": url,
                                               "web_cache_dir": str(tmp_path / "c"), "web_rate_per_s": 0}})
    web = open_retriever(cfg)
    web.inner.backoff_s, web.inner.max_retries = 0.01, 1
    script = {"France": ["<search> capital of France </search>", "<answer> Paris </answer>"],
              "Eiffel": ["<search> Eiffel Tower designer </search>", "<answer> Dijon </answer>"]}
    examples = [QAExample("q0", "What is the capital of France?", ["Paris"]),
                QAExample("q1", "Where was the designer of the Eiffel Tower born?", ["Dijon"])]
    trajs = run_episodes_retrying(examples, ScriptLLM(tiny_llm.tokenizer, script), web, agent_cfg, n_samples=2,
                                  waits=(0.0,))
    kept, stats = drop_failed(trajs)
    assert [t.question_id for t in kept] == ["q0", "q0"] and all(t.reward == 1.0 for t in kept)
    failed = [t for t in trajs if t.stop_reason == "error"]
    assert len(failed) == 2 and "WebSearchUnavailable" in failed[0].metadata["error"]
    assert all(t.question_id == "q1" for t in failed)  # one query's outage fails its own episodes only
    assert stats == {"rollout_errors": 4.0, "rollout_dropped": 2.0}  # each failed twice (run, rerun)
    web.inner.close()
