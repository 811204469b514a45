"""The LLM backend interface shared by rollouts, simulated search and judging.

A backend turns a batch of prompts *given as token ids* into continuations given as token ids, so the
agent loop appends exactly the tokens the policy produced (no re-tokenisation drift). Backends: the
transformers one here (:mod:`agent.backends.hf`); vLLM and OpenAI-compatible HTTP backends implement the same
protocol.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings for one batch.

    ``max_new_tokens`` is per prompt (tokens); ``temperature == 0`` means greedy; ``stop`` strings end a
    turn where the action ends and are kept in the output (``</search>``, ``</answer>``).

    ``episode`` names the episode a request belongs to (set by the agent loop for each turn, by the training
    proxy from the request): a backend of several engines (:class:`agent.backends.fleet.Fleet`) sends all
    turns of an episode to one engine, whose prefix cache then holds the episode's earlier turns. It takes
    no part in equality or hashing, so requests of different episodes still batch together.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ("</search>", "</answer>")
    seed: int | None = None
    episode: str | None = field(default=None, compare=False)


@dataclass
class Generation:
    """One continuation: ``token_ids`` (list[int], the sampled tokens up to and including the stop),
    ``text`` (their decoding), optional per-token ``logprobs`` (list[float], natural log) and
    ``finish_reason`` (``"stop"`` or ``"length"``)."""

    token_ids: list[int]
    text: str
    finish_reason: str = "stop"
    logprobs: list[float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class BackendUnavailable(RuntimeError):
    """The backend as a whole cannot serve (down, unreachable, closed, still failing after its own retries):
    every request would fail the same way, so :class:`agent.loop.scheduler.Scheduler` does not retry the
    members of a batch that raised it one by one. Backends raise other exceptions for a failure that may be
    one request's (a prompt over the model's context, a request the server rejects)."""


class BatchPartlyFailed(RuntimeError):
    """Some requests of a batched call failed and the others did not: ``results[i]`` is request ``i``'s
    :class:`Generation` or its exception. A backend that sends each request on its own (an OpenAI-compatible
    server) raises it so that :class:`agent.loop.scheduler.Scheduler` answers every request with its own
    outcome instead of running the batch again one request at a time."""

    def __init__(self, results: list[Any]):
        self.results = results
        failed = [r for r in results if isinstance(r, BaseException)]
        super().__init__(f"{len(failed)} of {len(results)} requests failed; the first: {failed[0] if failed else '-'}")


@runtime_checkable
class LLM(Protocol):
    """A batched generator.

    ``tokenizer`` is a Hugging Face tokenizer (``encode``/``decode``); ``generate`` returns one
    :class:`Generation` per prompt, in order. A backend whose ``generate`` may run in several threads at
    once sets the class attribute ``concurrent_calls = True`` (:class:`agent.loop.scheduler.Scheduler` then
    runs a failed batch's single retries concurrently); read with ``getattr(llm, "concurrent_calls",
    False)``, it is not a member of this protocol, so backends without it stay :class:`LLM`. Likewise
    optional: ``generate_each(requests)``, a list of ``(prompt, SamplingParams)`` with one
    :class:`Generation` each, for a backend that sends each prompt on its own anyway (an HTTP server):
    the scheduler then keeps every request's own settings instead of one call per setting with the
    batch's largest ``max_new_tokens``.
    """

    tokenizer: Any

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


def run_sync(coro: Any) -> Any:
    """Run ``coro`` to completion from sync code and return its result, also when this thread already runs an
    event loop (a Jupyter cell, an async caller): then in a fresh loop on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens added (BOS/EOS)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any, ids: list[int]) -> str:
    """Text of ``ids``, keeping the protocol tags (which may be special tokens)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def generate_requests(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
    """One :class:`Generation` per ``(prompt, params)`` request, each within its own ``max_new_tokens``.

    A backend with ``generate_each`` (one request per prompt, e.g. an OpenAI-compatible server, which
    refuses a prompt plus ``max_tokens`` over the model's context) gets all requests in one call, each with
    its own settings. Any other backend gets one ``generate`` call per distinct setting but
    ``max_new_tokens``, with that group's largest budget, and each output is cut back to its own budget (a
    prefix: token ids, text and log-probs stay exact; the finish reason becomes ``"length"``). Raises what the
    backend raises.
    """
    each = getattr(llm, "generate_each", None)
    if each is not None:
        return list(each(requests))
    out: list[Generation | None] = [None] * len(requests)
    groups: dict[SamplingParams, list[int]] = {}
    for i, (_, params) in enumerate(requests):
        groups.setdefault(replace(params, max_new_tokens=0), []).append(i)
    for key, idx in groups.items():
        budget = max(requests[i][1].max_new_tokens for i in idx)
        gens = llm.generate([requests[i][0] for i in idx], replace(key, max_new_tokens=budget))
        for i, g in zip(idx, gens, strict=True):
            limit = requests[i][1].max_new_tokens
            if len(g.token_ids) > limit:
                ids = g.token_ids[:limit]
                g = Generation(ids, decode(llm.tokenizer, ids), "length",
                               g.logprobs[:limit] if g.logprobs else None, meta=g.meta)
            out[i] = g
    return out  # type: ignore[return-value]


def complete(llm: LLM, prompts: list[str], params: SamplingParams) -> list[str]:
    """Text in, text out: for simulated search and LLM-as-judge, where token-exactness does not matter."""
    outs = llm.generate([encode(llm.tokenizer, p) for p in prompts], params)
    return [o.text for o in outs]


def end_of_turn_ids(tokenizer: Any, generation_eos: Any = None) -> set[int]:
    """The token ids that end a turn: the tokenizer's ``eos_token_id`` and the model's generation config
    ``eos_token_id`` (an int or a list: Qwen2.5-Instruct lists ``<|im_end|>`` and ``<|endoftext|>``, and
    transformers and vLLM stop at every one of them).

    ``generation_eos`` is that config value, or a model directory or hub id (read from the local Hugging Face
    cache) whose ``generation_config.json`` holds it (a missing or unreadable file adds nothing).
    """
    if isinstance(generation_eos, (str, Path)):
        try:
            config = json.loads(_generation_config_path(generation_eos).read_text())
            generation_eos = config.get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            generation_eos = None
    ids: set[int] = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), generation_eos):
        ids |= {eos} if isinstance(eos, int) else {e for e in (eos or []) if isinstance(e, int)}
    return ids


def _generation_config_path(model: str | Path) -> Path:
    """``generation_config.json`` of a model directory, else of a hub id's snapshot in the local cache (the
    directory's path, which does not exist, when neither has one)."""
    path = Path(model) / "generation_config.json"
    if path.is_file() or Path(model).exists():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model), "generation_config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id, or no huggingface_hub: nothing cached
        cached = None
    return Path(cached) if isinstance(cached, str) else path


def truncate_at_stop(tokenizer: Any, ids: list[int], stop: tuple[str, ...], eos_ids: set[int]) -> tuple[list[int], str, str]:
    """Cut a sampled continuation right after the first stop string or EOS.

    Returns ``(ids, text, finish_reason)``; ``finish_reason`` is ``"stop"`` when a stop string or EOS was
    found, else ``"length"``. The kept ids are exactly a prefix of ``ids`` (EOS kept in the ids, not in the
    text). Decodes the continuation once, and only when a stop string occurs binary-searches the first
    token whose prefix contains it (O(log n) decodes instead of one per token).
    """
    eos_at = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    body = list(ids) if eos_at is None else list(ids[:eos_at])
    text = decode(tokenizer, body)
    if any(s in text for s in stop):
        lo, hi = 0, len(body) - 1  # the first i such that decode(body[: i + 1]) contains a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(tokenizer, body[: mid + 1]) for s in stop):
                hi = mid
            else:
                lo = mid + 1
        return body[: lo + 1], decode(tokenizer, body[: lo + 1]), "stop"
    if eos_at is not None:
        return list(ids[: eos_at + 1]), text, "stop"
    return list(ids), text, "length"
