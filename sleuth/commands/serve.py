"""``sleuth serve``: the agent as a QA service (``/ask``, OpenAI-compatible ``/v1/chat/completions``)."""

from __future__ import annotations

import os

from sleuth.commands.common import (
    MODEL_HELP,
    add_config_arguments,
    check_port_free,
    config_from_args,
    model_config,
    port_number,
    positive_int,
    warn_if_exposed,
)

HELP = "serve the agent over HTTP: POST /ask and OpenAI-compatible /v1/chat/completions (127.0.0.1 by default)"


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--index", help="index directory (default: retrieval.index_dir)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("SLEUTH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SLEUTH_API_KEY; unset or empty: no key, open)")
    p.add_argument("--max-body-bytes", type=positive_int, default=64_000,
                   help="largest request body accepted, in bytes (default 64000; above: HTTP 413)")
    p.add_argument("--timeout", type=_positive_seconds, default=120.0, help="seconds per episode before a 504")
    p.add_argument("--max-inflight", type=positive_int, default=512,
                   help="episodes running at once (default 512); a request over it gets HTTP 503 with Retry-After: 1")
    p.add_argument("--name", default="sleuth-agent", help="model name reported by the OpenAI routes")


def _positive_seconds(value: str) -> float:
    """argparse type of a time limit in seconds: a finite number > 0 (``--timeout 0`` would time out every
    episode)."""
    import argparse
    import math

    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not (s > 0 and math.isfinite(s)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {value}")
    return s


def run(args) -> int:
    import uvicorn

    from agent.backends.build import make_llm
    from agent.external.runner import runner_for
    from agent.serve.app import create_app
    from agent.serve.service import ServeLimits
    from sleuth.pipeline import (
        answer_judge,
        check_context_length,
        external_agent_env,
        open_retriever,
        resolve_model_path,
        tiny_policy_path,
    )

    cfg = model_config(config_from_args(args), args.model)  # the model's trained settings, or the untrained note
    warn_if_exposed(args.host, args.api_key, "--api-key or $SLEUTH_API_KEY")
    check_port_free(args.host, args.port)  # before the index and the model load
    retriever = open_retriever(cfg, args.index)  # first to load: a missing index is the commonest mistake
    model = resolve_model_path(args.model or cfg.policy.model or tiny_policy_path(cfg))
    check_context_length(cfg, model)
    llm = make_llm(cfg.agent.backend, str(model), cfg.policy.dtype, cfg.policy.device, cfg.seed)
    limits = ServeLimits(max_body_bytes=args.max_body_bytes, request_timeout_s=args.timeout,
                         max_inflight=args.max_inflight, max_question_chars=cfg.agent.max_query_chars)
    external_agent_env(cfg, args.index)
    external = runner_for(llm, cfg.agent, temperature=cfg.eval.temperature)  # agent.kind=external, else None
    app = create_app(llm, retriever, cfg.agent, top_k=cfg.retrieval.top_k, temperature=cfg.eval.temperature,
                     api_key=args.api_key, model_name=args.name, limits=limits, judge=answer_judge(cfg),
                     external=external)
    # uvicorn's own limit answers a plain-text 503 with no Retry-After: kept above max_inflight (and /health)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                limit_concurrency=max(1024, 2 * limits.max_inflight))
    return 0
