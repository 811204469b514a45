"""The OpenAI chat-completions fields of a request to ``sleuth serve``, validated: each one is honoured or
refused with an error naming it, as OpenAI's API answers an invalid value, never silently ignored.

Honoured (:class:`ChatParams`):

* ``model``: must be the served model's name (``GET /v1/models``); another name gets 404 with code
  ``model_not_found``, as OpenAI and vLLM answer; left out, the served name.
* ``n`` (1 to ``max_n``): that many episodes, run concurrently, one choice each.
* ``max_completion_tokens`` (or its older name ``max_tokens``), an integer >= 1: the most tokens the episode
  adds after the prompt (the policy's turns and the documents it reads together), so
  ``usage.completion_tokens`` (the policy's tokens) never passes it; an episode it stops before an answer
  ends with ``finish_reason: "length"``. Above the server's own budget (``agent.max_total_tokens`` minus the
  prompt) the server's budget holds.
* ``temperature`` (0 to 2) and ``top_p`` (above 0, at most 1): the sampling of every turn of the episode;
  left out, the server's (``eval.temperature``, ``agent.top_p``).
* ``stream`` and ``stream_options.include_usage``: with it, every chunk carries ``usage: null`` and a last
  chunk before ``[DONE]`` has no choices and the request's ``usage``, as OpenAI streams it.

Refused (400 naming the field) unless left out or at their neutral value: ``stop``, ``seed`` (episodes are
batched with other requests), ``logprobs``/``top_logprobs``, ``presence_penalty``/``frequency_penalty``,
``logit_bias``, ``tools``/``tool_choice``/``functions``/``function_call`` (the agent has its own tool) and a
``response_format`` other than text. Any other field (``user``, ``metadata``, ...) has no effect on an
answer and is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_N = 8
"""Default bound on ``n`` (episodes per request): each takes a slot of the server's ``max_inflight``."""


class ParamError(ValueError):
    """A request field the server cannot honour: ``status`` (400, 404 or 422), the OpenAI error ``param``
    it names and ``code`` (``invalid_value``, ``model_not_found``, ``unsupported_parameter``...)."""

    def __init__(self, message: str, param: str, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class ChatParams:
    """The validated fields (see the module docstring); ``None``: the server's own setting."""

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    include_usage: bool = False


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive_int(obj: dict[str, Any], name: str, hi: int | None = None) -> int | None:
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (hi is not None and v > hi):
        rng = f"between 1 and {hi}" if hi is not None else "at least 1"
        raise ParamError(f"{name} must be an integer {rng}, got {v!r:.40}", name)
    return v


def _in_range(obj: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = obj.get(name)
    if v is None:
        return None
    if not _number(v) or v > hi or v < lo or (lo_open and v == lo):
        rng = f"{'above' if lo_open else 'at least'} {lo:g} and at most {hi:g}"
        raise ParamError(f"{name} must be a number {rng}, got {v!r:.40}", name)
    return float(v)


_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ""), "seed": (None,), "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"),
}
_WHY = {"seed": "episodes are sampled in batches with other requests, so no per-request seed can hold",
        "stop": "an answer is a whole episode that ends with <answer>", "tools": "the agent's only tool is its search",
        "tool_choice": "the agent's only tool is its search", "functions": "the agent's only tool is its search",
        "function_call": "the agent's only tool is its search"}


def parse_chat_params(obj: dict[str, Any], served_model: str, max_n: int = MAX_N) -> ChatParams:
    """The :class:`ChatParams` of a chat-completions request body ``obj`` for a server serving
    ``served_model``. Raises :class:`ParamError`: 422 for ``model``/``stream`` of the wrong type or a model
    name holding a lone surrogate, 404 (``model_not_found``) for another model, 400 naming the field for any
    other value the server cannot honour (see the module docstring)."""
    model = obj.get("model")
    if model is None:
        model = served_model
    if not isinstance(model, str):
        raise ParamError("model must be a string", "model", 422)
    if not model.isascii():
        try:
            model.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ParamError(f"the model name holds a lone surrogate at character {e.start}", "model", 422) from None
    if model != served_model:
        raise ParamError(f"the model {model[:200]!r} does not exist; this server serves {served_model!r} "
                         "(GET /v1/models)", "model", 404, "model_not_found")
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ParamError("stream must be true or false", "stream", 422)
    opts = obj.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ParamError("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict):
            raise ParamError("stream_options must be an object", "stream_options")
        include_usage = opts.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise ParamError("stream_options.include_usage must be true or false", "stream_options.include_usage")
    for name, neutral in _NEUTRAL.items():
        v = obj.get(name)
        if not any(v == x and type(v) is type(x) for x in neutral):  # a bool is not the number 0
            why = _WHY.get(name, "this server cannot honour it")
            raise ParamError(f"{name} is not supported by this server ({why}); leave it out", name, 400,
                             "unsupported_parameter")
    fmt = obj.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ParamError("response_format other than {'type': 'text'} is not supported by this server (answers are "
                         "the agent's short text answers); leave it out", "response_format", 400,
                         "unsupported_parameter")
    max_tokens = _positive_int(obj, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(obj, "max_tokens")
    return ChatParams(model=model, n=_positive_int(obj, "n", max_n) or 1, max_tokens=max_tokens,
                      temperature=_in_range(obj, "temperature", 0.0, 2.0),
                      top_p=_in_range(obj, "top_p", 0.0, 1.0, lo_open=True), stream=bool(stream),
                      include_usage=bool(include_usage))
