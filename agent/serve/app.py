"""The agent served as a question-answering tool (FastAPI): ``/ask``, OpenAI-compatible chat, ``/health``.

* ``POST /ask`` ``{"question": str, "golden_answers"?: [str], "top_k"?: int, "max_turns"?: int}`` -> the
  answer, the evidence documents (ids, titles, contents, scores, in retrieval order) and the whole
  trajectory. ``top_k`` (documents per search) is at most ``max_top_k``, ``max_turns`` at most the server's
  ``agent.max_turns`` (422 otherwise); left out, the server's own settings are used.
* ``POST /v1/chat/completions`` (OpenAI-compatible): the last user message is the question; the reply's
  content is the agent's answer, and a ``sleuth`` field carries the evidence and stop reason. Existing
  clients (the ``openai`` package, LangChain's ``ChatOpenAI``) can use the agent as a model. The request
  may carry ``top_k``, ``max_turns`` and ``golden_answers`` as /ask takes them (``extra_body`` in the
  ``openai`` client); with golden answers the ``sleuth`` field has the judge's ``verdict``. With
  ``stream: true`` the server-sent events follow the episode turn by turn: a role chunk; each policy
  turn's generated text as ``delta: {"reasoning_content": text}`` (the field vLLM's and DeepSeek's
  reasoning models use; turns after the first start with a blank line) with
  ``sleuth: {"event": "turn", "turn", "action", "error"?, "judgement"?}`` (``error``: why an invalid action
  was invalid; ``judgement``: the turn's self-judge of the previous search, when it made one); each search
  as an empty delta with ``sleuth: {"event": "search", "turn", "query", "doc_ids", "hits"}`` (``hits``: the
  retrieved passages in order, each ``{"id", "title", "text", "score"}``, ``text`` without the title line,
  ``score`` this query's); then the answer as
  ``delta: {"content": answer}``, the finish chunk with the ``sleuth`` evidence, and ``data: [DONE]``. A
  request over ``max_inflight`` gets the plain 503 before any stream starts (so clients retry it); a
  failure of the episode (504, 502) arrives as one ``data: {"error": {...}}`` event; a client that
  disconnects cancels its episode. The OpenAI fields are honoured or refused with an error naming them
  (:mod:`agent.serve.chat_params`): ``model`` must be the served name (404 ``model_not_found``); ``n`` runs
  that many episodes (at most ``max_n``; one choice each, with its own ``sleuth`` field; the top-level one is
  the first choice's; streamed, each event carries its choice's index); ``max_tokens`` (or
  ``max_completion_tokens``) caps the tokens the episode adds after the prompt; ``temperature`` and
  ``top_p`` sample every turn; ``stream_options.include_usage`` adds OpenAI's usage chunk; ``stop``,
  ``seed``, ``logprobs``, penalties, ``tools`` and JSON ``response_format`` get 400. With an external agent
  (``agent.kind: external``) ``temperature``, ``top_p`` and ``n`` are honoured as well, while ``top_k`` and
  ``max_turns`` other than the server's own get 422 and ``max_tokens`` 400 (:func:`create_app`).
* ``GET /health``: status, counters (``inflight``: episode slots taken; ``running_episodes``: episodes the
  scheduler runs now; ``tasks``: the event loop's tasks, for spotting a leak) and the per-request ``limits``
  a client may choose within (``top_k``/``max_top_k``, ``max_turns``, ``max_question_chars``).
* ``GET /``: a browser page over the streaming endpoint (:mod:`agent.serve.webui`; no key needed to load it).

All requests share one :class:`agent.loop.scheduler.Scheduler` living in the server's event loop, so
concurrent requests are episodes whose generation and search calls are batched together. Limits: request
bodies over ``max_body_bytes`` get 413, bodies that are not JSON (or nest over 64 levels, or hold an integer of
over 100 digits: the shared :class:`retrieval.http_guard.RequestGuard`) 400, empty or over-long questions 422 (over ``max_question_chars``, or a prompt
that leaves no token of the agent's ``max_total_tokens`` to generate: the message says by how many tokens),
text with a lone surrogate 422, more than ``max_inflight`` episodes 503 with ``Retry-After:``
:data:`BUSY_RETRY_AFTER_S` (streamed or not; the slot is taken in one step with the check and freed however
the episode ends; the ``openai`` client and httpx retry loops wait that long), an episode over
``request_timeout_s`` 504, a backend failure 502 (only the episodes whose own call failed: the scheduler
retries a failed batch's calls one by one), an unknown route 404 or method 405, anything unexpected 500 -
each with the reason in ``{"error": {"message", "type"}}``; the server keeps serving.
With ``api_key`` set (not empty), every route but ``/health`` and the page (``/``, ``/static/*``) needs
``Authorization: Bearer <key>`` (401 otherwise).
A client that disconnects before its answer (streamed or not) cancels its episode. Binds 127.0.0.1 by
default (see ``sleuth serve``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent.judges import Judge
from agent.llm import LLM
from agent.serve.chat_api import chat_completions
from agent.serve.service import AgentService, HTTPError, ServeLimits, error_reply
from agent.serve.webui import add_page_routes
from retrieval.base import Retriever


def create_app(llm: LLM, retriever: Retriever, agent_cfg: Any, *, top_k: int = 3, temperature: float = 0.0,
               api_key: str | None = None, model_name: str = "sleuth-agent",
               limits: ServeLimits | None = None, judge: Judge | None = None, external: Any = None) -> FastAPI:
    """Build the app around one policy backend and one retriever (see the module docstring). ``judge``
    scores answers sent with golden answers (default: :func:`agent.loop.nodes.make_context`'s, from
    ``agent_cfg.judge``). ``external`` (an :class:`agent.external.runner.ExternalRunner`,
    ``agent.kind: external``) answers with the external agent instead of the built-in loop: its own tools
    search, so a request's ``top_k`` and ``max_turns`` other than the server's own are refused (422) and so is
    ``max_tokens`` (400: the agent decides how many model calls it makes); ``temperature`` and ``top_p`` sample
    every model call of its episode, ``n`` runs that many episodes; a stream carries no turn or search events,
    and the evidence is empty."""
    app = FastAPI(title="Sleuth agent", version="0.1")
    app.state.service = AgentService(app.state, llm, retriever, agent_cfg, top_k=top_k, temperature=temperature,
                                     api_key=api_key, model_name=model_name, limits=limits or ServeLimits(),
                                     judge=judge, external=external)
    app.add_exception_handler(HTTPError, _http_error)
    app.add_exception_handler(StarletteHTTPException, _route_error)  # an unknown route (404), a wrong method (405)
    app.add_exception_handler(Exception, _internal_error)  # a bug: still a JSON 500 (the traceback is logged)
    app.add_api_route("/health", health, methods=["GET"])
    add_page_routes(app)  # GET /: the browser page (no key needed to load it; it asks for the key)
    app.add_api_route("/ask", ask, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


async def _http_error(request: Request, exc: HTTPError):
    return error_reply(exc.status, exc.message, exc.kind, exc.retry_after, exc.param, exc.code)


async def _route_error(request: Request, exc: StarletteHTTPException):
    return error_reply(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")


async def _internal_error(request: Request, exc: Exception):
    return error_reply(500, f"internal server error ({type(exc).__name__}: {exc})", "server_error")


# -- routes -------------------------------------------------------------------------------------------
async def health(request: Request):
    svc: AgentService = request.app.state.service
    s, limits = svc.ctx.scheduler, svc.limits
    return {"status": "ok", "model": svc.model_name, "inflight": request.app.state.inflight,
            "served": request.app.state.served, "running_episodes": s.active, "tasks": len(asyncio.all_tasks()),
            "batches": s.stats["generate_batches"], "prompts": s.stats["generate_prompts"],
            "limits": {"top_k": svc.ctx.top_k, "max_top_k": limits.max_top_k, "max_turns": svc.agent_cfg.max_turns,
                       "max_question_chars": limits.max_question_chars}}


async def ask(request: Request):
    svc: AgentService = request.app.state.service
    svc.check_auth(request)
    obj = await svc.read_json(request)
    q = svc.check_question(obj.get("question"))
    golds, k, turns = svc.episode_options(obj)
    traj = await svc.unless_hung_up(request, svc.episode(q, golds, k, turns=turns))
    return {"answer": traj.answer, "stop_reason": traj.stop_reason, "evidence": svc.evidence_of(traj),
            "searches": traj.num_search_calls, "verdict": traj.verdict if golds else None,
            "trajectory": traj.to_json()}


async def models(request: Request):
    svc: AgentService = request.app.state.service
    svc.check_auth(request)
    return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "owned_by": "sleuth"}]}
