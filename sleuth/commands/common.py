"""Arguments and helpers shared by subcommands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: bench/kernels.py takes the argparse types on a GPU machine without pydantic
    from sleuth.config import Config


def _int_at_least(value: str, minimum: int, kind: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {value!r}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
    return n


def positive_int(value: str) -> int:
    """argparse type of a count that must be >= 1 (``--limit 0`` is an error, not "no limit")."""
    return _int_at_least(value, 1, "positive")


def non_negative_int(value: str) -> int:
    """argparse type of a count that may be 0."""
    return _int_at_least(value, 0, "non-negative")


def non_negative_number(value: str) -> float:
    """argparse type of a finite number >= 0 (a wait in milliseconds: ``nan`` or ``inf`` would wait forever)."""
    import math

    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return x


def port_number(value: str) -> int:
    """argparse type of a TCP port to listen on: an integer in 1..65535."""
    n = _int_at_least(value, 1, "port")
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {n}")
    return n


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, so that a busy port (another server on it) or a bad ``--host``
    stops a server command before it loads an index or a model. Raises ``OSError`` whose message names the
    port and the fix (``--port``, ``--host``)."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            s.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is in use (another server?); stop it or pick another with "
                          f"--port") from None
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a ``--host`` value) is a loopback address: ``localhost`` or an IP address in
    127.0.0.0/8 or ``::1``. Any other name or address (``0.0.0.0``, a LAN address) may be reachable from
    other machines."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_key: str | None, key_option: str) -> str | None:
    """Print (to stderr) and return a warning when a server binds ``host`` that is not loopback
    (:func:`is_loopback`): without ``api_key`` anyone who reaches the address may use it; with one, the key
    and the requests still travel unencrypted (plain HTTP). ``key_option`` names the option that sets the
    key. Returns ``None`` on a loopback address."""
    import sys

    if is_loopback(host):
        return None
    if api_key:
        msg = (f"warning: serving on {host}, reachable from other machines: requests and the API key travel as "
               "plain HTTP; put a TLS proxy in front of it on a network you do not trust")
    else:
        msg = (f"warning: serving on {host}, reachable from other machines, without an API key: anyone who can "
               f"reach it can use it; set {key_option}")
    print(msg, file=sys.stderr)
    return msg


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="dotted overrides, e.g. train.optim.lr=1e-4")  # default: not listed as required


def config_from_args(args: argparse.Namespace) -> Config:
    from sleuth.config import load_config

    return load_config(args.config, list(getattr(args, "overrides", []) or []))


MODEL_HELP = ("model directory (a checkpoint, or its checkpoints/latest) or hub id (default: policy.model, else the "
              "untrained tiny policy); a model Sleuth trained brings the agent settings it was trained with "
              "(its sleuth_settings.json), which --config and overrides may change")


def model_config(cfg: Config, model: str | None) -> Config:
    """``cfg`` for running ``model`` (``--model``, else ``policy.model``): with the settings it was trained with
    in place of those the config leaves unset (:func:`sleuth.trained_settings.with_trained_settings`, which
    warns for explicit settings that differ); without a model, ``cfg`` after printing (to stderr) that the
    policy is the untrained tiny one (:func:`sleuth.trained_settings.untrained_note`)."""
    import sys

    from sleuth.pipeline import resolve_model_path
    from sleuth.trained_settings import untrained_note, with_trained_settings

    note = untrained_note(cfg, model)
    if note is not None:
        print(note, file=sys.stderr)
        return cfg
    return with_trained_settings(cfg, resolve_model_path(model or cfg.policy.model))
