"""Build the configured :class:`agent.llm.LLM` backend (``agent.backend.kind``): transformers, vLLM or an
OpenAI-compatible server. The composition root (``sleuth`` commands) calls :func:`make_llm`."""

from __future__ import annotations

import os
from typing import Any


def make_llm(backend_cfg: Any, model_path: str, dtype: str = "float32", device: str = "auto", seed: int = 0):
    """The policy backend for ``model_path`` (a local directory or cached hub id).

    ``backend_cfg`` is a :class:`agent.config.BackendConfig`. For ``openai`` the tokenizer is loaded from
    ``model_path`` (prompts are token ids) and the served model name is ``backend_cfg.model`` or
    ``model_path``; the API key comes from ``$<api_key_env>`` only (none is sent when it is unset). Raises
    ``ImportError`` (vLLM missing) or ``FileNotFoundError`` (model not found) with a hint.
    """
    kind = backend_cfg.kind
    if kind == "transformers":
        from agent.backends.hf import TransformersLLM

        return TransformersLLM.from_pretrained(str(model_path), dtype, device)
    if kind == "vllm":
        from agent.backends.vllm import VLLMBackend

        return VLLMBackend(str(model_path), dtype=dtype, seed=seed,
                           gpu_memory_utilization=backend_cfg.gpu_memory_utilization,
                           enforce_eager=backend_cfg.enforce_eager)
    if kind == "openai":
        from transformers import AutoTokenizer

        from agent.backends.openai import OpenAICompatibleLLM

        try:
            tok = AutoTokenizer.from_pretrained(str(model_path))
        except OSError as e:
            raise FileNotFoundError(f"cannot load the tokenizer of {model_path!r} for the openai backend: {e}") from None
        return OpenAICompatibleLLM(backend_cfg.base_url, backend_cfg.model or str(model_path), tok,
                                   # "" (no key), not None: None would fall back to $OPENAI_API_KEY
                                   api_key=os.environ.get(backend_cfg.api_key_env, ""),
                                   timeout_s=backend_cfg.timeout_s, max_retries=backend_cfg.max_retries,
                                   max_concurrency=backend_cfg.max_concurrency)
    raise ValueError(f"unknown agent.backend.kind {kind!r}")
