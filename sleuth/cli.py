"""The ``sleuth`` command line. Each subcommand lives in ``sleuth/commands/<name>.py`` and exposes
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module under sleuth.commands (imported lazily so `sleuth --help` stays fast)
COMMANDS: dict[str, str] = {
    "quickstart": "quickstart",
    "index": "index",
    "search": "search",
    "ask": "ask",
    "sft": "sft",
    "train": "train",
    "eval": "evaluate",
    "report": "report",
    "serve-retrieval": "serve_retrieval",
    "serve-mcp": "serve_mcp",
    "corpus": "corpus",
    "simulator-data": "simulator_data",
    "serve": "serve",
    "serve-engine": "serve_engine",
    "dashboard": "dashboard",
    "data": "data",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(  # no prefixes of flags: a typo (--resum) must not pass for a flag
        prog="sleuth", description="Train, serve and evaluate LLM search agents with multi-turn RL.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, mod_name in COMMANDS.items():
        mod = importlib.import_module(f"sleuth.commands.{mod_name}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, allow_abbrev=False)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "data":  # models and data load from disk; `sleuth data get` is the one that downloads
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # argparse fills a positional list once: KEY=VALUE overrides given after an option come back as extras
    overrides = [x for x in extra if "=" in x and not x.startswith("-")]
    if extra and (len(overrides) < len(extra) or not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*(args.overrides or []), *overrides]
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    # ConfigError, IndexNotFoundError, DataFormatError, IsADirectoryError, ..., and a missing optional extra
    # (ImportError naming what to install: vllm, pyserini)
    except (OSError, ValueError, ImportError) as e:
        if os.environ.get("SLEUTH_DEBUG"):
            raise
        print(f"sleuth {args.command}: error: {_describe(e)}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    """Run the parsed subcommand; its exit status."""
    return int(args._run(args) or 0)


def _describe(e: BaseException) -> str:
    """An error as one line: an OS error on a path as ``PATH: reason`` (not ``[Errno 21] ...``)."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}" + (f" (-> {e.filename2})" if e.filename2 is not None else "")
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
