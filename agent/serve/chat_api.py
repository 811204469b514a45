"""``POST /v1/chat/completions`` of ``sleuth serve`` (:mod:`agent.serve.app`): the OpenAI-compatible route, a
whole agent episode per choice, answered at once or streamed turn by turn as server-sent events (the
module docstring of :mod:`agent.serve.app` gives the events; :mod:`agent.serve.chat_params` the request
fields)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from agent.serve.chat_params import ChatParams, ParamError, parse_chat_params
from agent.serve.service import AgentService, HTTPError, SlotStream
from agent.trajectory import Trajectory


def chat_question(msgs: Any) -> Any:
    """The question of a chat request: the last user message's content (its text parts joined), or a 422
    :class:`agent.serve.service.HTTPError` for messages that are not a non-empty list with a user message."""
    if not isinstance(msgs, list) or not msgs:
        raise HTTPError(422, "messages must be a non-empty list")
    user = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
    if not user:
        raise HTTPError(422, "no user message")
    content = user[-1].get("content")
    if isinstance(content, list):  # content parts: the text parts are the question
        if not all(isinstance(p, dict) and (p.get("type") != "text" or isinstance(p.get("text"), str))
                   for p in content):
            raise HTTPError(422, "message content parts must be objects; a text part needs a string 'text'")
        return " ".join(p["text"] for p in content if p.get("type") == "text")
    if not isinstance(content, str):
        raise HTTPError(422, "message content must be a string or a list of content parts")
    return content


@dataclass
class Completion:
    """One chat request being answered: its parameters, id and creation time, and how each choice's
    trajectory becomes a reply (``golds``: whether the judge's verdict is returned)."""

    svc: AgentService
    p: ChatParams
    golds: list[str]
    cid: str
    created: int

    def reply(self, traj: Trajectory) -> tuple[str, str, dict[str, Any]]:
        finish = "stop" if traj.answer is not None else "length"
        extra = {"stop_reason": traj.stop_reason, "searches": traj.num_search_calls,
                 "evidence": self.svc.evidence_of(traj), "verdict": traj.verdict if self.golds else None}
        return traj.answer or "", finish, extra

    @staticmethod
    def usage(trajs: list[Trajectory]) -> dict[str, int]:
        """The prompt once, the policy's tokens of every choice."""
        n_prompt, n_gen = trajs[0].prompt_len, sum(t.num_policy_tokens for t in trajs)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}

    def answer(self, trajs: list[Trajectory]) -> dict[str, Any]:
        """The whole (not streamed) reply."""
        choices = []
        for i, traj in enumerate(trajs):
            text, finish, extra = self.reply(traj)
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": finish, "sleuth": extra})
        return {"id": self.cid, "object": "chat.completion", "created": self.created, "model": self.p.model,
                "choices": choices, "usage": self.usage(trajs), "sleuth": choices[0]["sleuth"]}

    def chunk(self, i: int, delta: dict[str, Any], finish: str | None = None, **more: Any) -> str:
        c = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.p.model,
             "choices": [{"index": i, "delta": delta, "finish_reason": finish}], **more}
        if self.p.include_usage:
            c["usage"] = None
        return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

    def progress(self, i: int, event: dict[str, Any], first_turn: bool) -> str:
        """The event of a policy turn (its text as ``reasoning_content``) or of a search (its passages)."""
        if event["type"] == "turn":
            text = event["text"] if first_turn else "\n\n" + event["text"]
            more = {f: event[f] for f in ("error", "judgement") if event.get(f) is not None}
            return self.chunk(i, {"reasoning_content": text},
                              sleuth={"event": "turn", "turn": event["turn"], "action": event["action"], **more})
        hits = [{"id": h.id, "title": h.title, "text": h.text, "score": float(h.score)} for h in event["hits"]]
        return self.chunk(i, {}, sleuth={"event": "search", "turn": event["turn"], "query": event["query"],
                                         "doc_ids": event["doc_ids"], "hits": hits})

    def ending(self, trajs: list[Trajectory]) -> list[str]:
        """The answer chunks, the finish chunks with the evidence, the usage chunk and ``[DONE]``."""
        out = []
        for i, traj in enumerate(trajs):
            text, finish, extra = self.reply(traj)
            if text:
                out.append(self.chunk(i, {"content": text}))
            out.append(self.chunk(i, {}, finish, sleuth=extra))
        if self.p.include_usage:  # as OpenAI: a last chunk without choices, carrying the request's usage
            last = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.p.model,
                    "choices": [], "usage": self.usage(trajs)}
            out.append(f"data: {json.dumps(last)}\n\n")
        return [*out, "data: [DONE]\n\n"]

    async def events(self, run: Callable[..., Any], releases: list[Callable[[], None]]) -> AsyncIterator[str]:
        """The stream: each choice's episode runs as its own task and hands its progress events over one
        queue, tagged with its choice index (``(i, None)``: episode ``i`` ended); a failed episode ends the
        stream with one ``error`` event. Never leaves an episode running (the client went away, or the
        stream ended)."""
        queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()
        tasks = []
        for i, rel in enumerate(releases):
            async def sink(event: dict[str, Any], i: int = i) -> None:
                await queue.put((i, event))

            tasks.append(asyncio.create_task(run(on_event=sink, release=rel)))
            tasks[-1].add_done_callback(lambda _, i=i: queue.put_nowait((i, None)))
        try:
            for i in range(self.p.n):
                yield self.chunk(i, {"role": "assistant", "content": ""})
            first_turn, running = [True] * self.p.n, self.p.n
            while running:
                i, event = await queue.get()
                if event is None:
                    running -= 1
                    if isinstance(e := tasks[i].exception(), HTTPError):
                        yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'code': e.status}})}\n\n"
                        return
                    continue
                yield self.progress(i, event, first_turn[i])
                first_turn[i] = first_turn[i] and event["type"] != "turn"
            for line in self.ending([t.result() for t in tasks]):
                yield line
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()  # retrieved: no "exception was never retrieved" after a disconnect


async def chat_completions(request: Request):
    """The route: checks, then ``n`` episodes answered at once or streamed."""
    svc: AgentService = request.app.state.service
    svc.check_auth(request)
    obj = await svc.read_json(request)
    q = svc.check_question(chat_question(obj.get("messages")))
    golds, k, turns = svc.episode_options(obj)
    try:
        p = parse_chat_params(obj, svc.model_name, svc.limits.max_n)
    except ParamError as e:
        raise HTTPError(e.status, e.message, param=e.param, code=e.code) from None
    done = Completion(svc, p, golds, f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()))
    run = functools.partial(svc.episode, q, golds, k, turns=turns, temp=p.temperature,
                            cfg_update=svc.sampling_update(q, p))
    if not p.stream:
        return done.answer(await svc.unless_hung_up(request, svc.episodes(run, p.n)))
    # the slots are taken before the stream starts: a client over max_inflight gets a plain 503 (OpenAI
    # clients retry it), not a 200 whose stream then carries the error
    releases = svc.take_slots(p.n)
    return SlotStream(done.events(run, releases), lambda: [r() for r in releases], media_type="text/event-stream")
