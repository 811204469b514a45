"""``sleuth serve-engine``: one rollout engine of a fleet, on transformers (:mod:`agent.serve.engine`)."""

from __future__ import annotations

import argparse
import os

from sleuth.commands.common import check_port_free, port_number, positive_int, warn_if_exposed

HELP = ("serve a model as a rollout engine: OpenAI-compatible /v1/completions (token ids in and out) and vLLM's "
        "RL weight-update routes (127.0.0.1 by default)")

API_KEY_ENV = "SLEUTH_ENGINE_API_KEY"


def _positive_seconds(value: str) -> float:
    """argparse type of a time limit in seconds: a finite number > 0."""
    import math

    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not (s > 0 and math.isfinite(s)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {value}")
    return s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (a checkpoint) or cached hub id")
    p.add_argument("--served-model-name", help="the name clients give as `model` (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=port_number, default=8100, help="TCP port (default 8100)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights' dtype (default float32)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's own)")
    p.add_argument("--max-batch", type=positive_int, default=64, help="most prompts per generation batch")
    p.add_argument("--max-inflight", type=positive_int, default=1024,
                   help="requests in flight at once (default 1024; over it: HTTP 503 with Retry-After: 1)")
    p.add_argument("--max-body-bytes", type=positive_int, default=16_000_000,
                   help="largest request body, in bytes (default 16 MB; above: HTTP 413)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32_768, help="largest max_tokens accepted")
    p.add_argument("--timeout", type=_positive_seconds, default=600.0,
                   help="seconds per request (and per wait for a weight update to finish) before HTTP 504/503")
    p.add_argument("--update-idle-timeout", type=_positive_seconds, default=600.0,
                   help="seconds without a call after which a weight update is abandoned (default 600)")
    p.add_argument("--weights-dir", help="read weight buckets sent over shared disk only from under this directory")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}; "
                        "unset or empty: open)")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the engine's sampling (default 0)")


def run(args: argparse.Namespace) -> int:
    from agent.serve.engine import EngineLimits, serve_engine

    warn_if_exposed(args.host, args.api_key, f"--api-key or ${API_KEY_ENV}")
    check_port_free(args.host, args.port)  # before the model loads
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    limits = EngineLimits(max_body_bytes=args.max_body_bytes, max_new_tokens=args.max_new_tokens,
                          max_inflight=args.max_inflight, request_timeout_s=args.timeout, max_batch=args.max_batch)
    print(f"serving {args.served_model_name or args.model} at http://{args.host}:{args.port}/v1", flush=True)
    serve_engine(args.model, args.host, args.port, name=args.served_model_name, dtype=args.dtype,
                 device=args.device, limits=limits, api_key=args.api_key, weights_dir=args.weights_dir,
                 idle_timeout_s=args.update_idle_timeout, seed=args.seed)
    return 0
