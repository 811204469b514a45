"""Shared stand-ins for the agent tests (no tests here): scripted and recording backends, a chat template.

``ScriptLLM`` plays fixed turns per question (the turn is found by counting a marker the tool writes into
the context), optionally ending each turn with the EOS token like a chat model; ``Recorder`` wraps any
backend and keeps every prompt and batch it receives; ``CHAT_TEMPLATE`` is a small Qwen2.5-like Jinja
template (tools in the system block, ``<|im_start|>role ... <|endoftext|>`` turns, tool results wrapped in
``<tool_response>``) to give the tiny test tokenizer function calling without any download.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from agent.llm import Generation, SamplingParams, decode, encode

CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n' }}{% endif %}"
    "{{ 'Tools: ' }}{% for t in tools %}{{ t | tojson }}{% endfor %}{{ '<|endoftext|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|endoftext|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|endoftext|>\\n' }}"
    "{%- elif m.role != 'system' %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|endoftext|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ScriptLLM:
    """Plays ``scripts[key][turn]`` for the first key found in the prompt; ``turn`` = occurrences of
    ``marker`` in the prompt. ``eos`` appends the EOS id after every turn (a chat model ending its turn)."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], marker: str = "<information>", eos: bool = False):
        self.tokenizer, self.scripts, self.marker, self.eos = tokenizer, scripts, marker, eos
        self.batches: list[int] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            text = decode(self.tokenizer, p)
            key = next(k for k in self.scripts if k in text)
            script = self.scripts[key]
            reply = script[min(text.count(self.marker), len(script) - 1)]
            ids = encode(self.tokenizer, reply)
            if self.eos:
                ids = ids + [self.tokenizer.eos_token_id]
            ids = ids[: params.max_new_tokens]
            reason = "stop" if len(ids) < params.max_new_tokens or self.eos else "length"
            out.append(Generation(ids, decode(self.tokenizer, [i for i in ids if i != self.tokenizer.eos_token_id]), reason))
        return out


class Recorder:
    """Wraps a backend; ``prompts`` holds every prompt (token ids) it was asked to continue, ``outputs``
    the ids it returned, ``batches`` the batch sizes."""

    def __init__(self, inner):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.batches: list[int] = []

    def generate(self, prompts, params):
        gens = self.inner.generate(prompts, params)
        self.prompts.extend(list(p) for p in prompts)
        self.outputs.extend(list(g.token_ids) for g in gens)
        self.batches.append(len(prompts))
        return gens


class ServerThread:
    """Runs an ASGI app with uvicorn on 127.0.0.1 (a free port) in a daemon thread; ``url`` is its base URL.

    Use as a context manager; the server is stopped on exit."""

    def __init__(self, app, **uvicorn_kwargs):
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **uvicorn_kwargs)
        self.server = uvicorn.Server(config)

    def __enter__(self):
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def fake_openai_completions_app(llm, mode: dict):
    """A minimal OpenAI-compatible ``/v1/completions`` server over an :class:`agent.llm.LLM`, for tests.

    ``mode`` (mutable) steers it: ``{"fail_first": n}`` answers 503 to the first n requests (429 with
    ``Retry-After`` when ``mode["retry_after"]`` is set),
    ``{"garbage": True}`` answers 200 with a non-JSON body, ``{"sleep": s}`` stalls s seconds,
    ``{"text_only": True}`` omits token ids (a hosted API); ``{"drop_stop": True}`` leaves the stop string
    out of the text, as OpenAI's API does, and ``{"stop_reason": True}`` then names it as vLLM does
    (``stop_reason``: the string, or ``None`` for EOS). ``{"max_prompt": n}`` answers 400 to a prompt of
    more than n tokens (vLLM's context-length error), ``{"max_context": n}`` 400 to a prompt plus
    ``max_tokens`` of more than n (the check `vllm serve` makes against ``max_model_len``; each one is also
    appended to ``mode["rejected"]``); ``{"status": code}`` answers every request with that error status
    (401: a wrong key). ``mode["seen"]`` collects request bodies."""
    import asyncio

    app = FastAPI()
    mode.setdefault("seen", [])

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        mode["seen"].append(body)
        if mode.get("status"):
            return JSONResponse({"error": {"message": "refused"}}, status_code=mode["status"])
        if len(body["prompt"]) > mode.get("max_prompt", len(body["prompt"])):
            return JSONResponse({"error": {"message": f"This model's maximum context length is {mode['max_prompt']} "
                                                      f"tokens; the prompt has {len(body['prompt'])}"}}, status_code=400)
        if "max_context" in mode and len(body["prompt"]) + body["max_tokens"] > mode["max_context"]:
            mode.setdefault("rejected", []).append(body)
            return JSONResponse({"error": {"message": f"This model's maximum context length is {mode['max_context']} "
                                                      f"tokens; you requested {len(body['prompt'])} + "
                                                      f"{body['max_tokens']}"}}, status_code=400)
        if mode.get("fail_first", 0) > 0:
            mode["fail_first"] -= 1
            retry = mode.get("retry_after")  # a rate limit with Retry-After (seconds), as hosted APIs send
            return JSONResponse({"error": "overloaded"}, status_code=429 if retry else 503,
                                headers={"Retry-After": str(retry)} if retry else None)
        if mode.get("garbage"):
            return PlainTextResponse("<html>oops</html>")
        if mode.get("sleep"):
            await asyncio.sleep(mode["sleep"])
        params = SamplingParams(max_new_tokens=body["max_tokens"], temperature=body["temperature"],
                                stop=tuple(body.get("stop") or ()), seed=body.get("seed"))
        (g,) = await asyncio.to_thread(llm.generate, [body["prompt"]], params)
        choice = {"index": 0, "text": g.text, "finish_reason": g.finish_reason}
        matched = next((x for x in params.stop if g.text.endswith(x)), None) if g.finish_reason == "stop" else None
        if mode.get("drop_stop") and matched:
            choice["text"] = g.text[: -len(matched)]
        if mode.get("stop_reason"):
            choice["stop_reason"] = matched
        if not mode.get("text_only"):
            choice["logprobs"] = {"tokens": [f"token_id:{i}" for i in g.token_ids],
                                  "token_logprobs": [-1.0] * len(g.token_ids)}
        return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]}

    return app
