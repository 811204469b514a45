"""Method options as frozen dataclasses built from a plain mapping, with a clear error for a name the method
does not have (the closest names suggested) and each dataclass's own range checks in ``__post_init__``."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def parse_options(cls: type[T], values: Mapping[str, Any] | None, method: str) -> T:
    """``cls(**values)`` for a dataclass ``cls`` of ``method``'s options (``None``: all defaults).

    Raises ``ValueError`` naming the method, the unknown option names, the option names it has and the closest
    matches; the dataclass's ``__post_init__`` raises ``ValueError`` for a value out of its range."""
    values = dict(values or {})
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(k for k in values if k not in names)
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), names, n=2)
            if close:
                hints.append(f"{k!r}: did you mean {' or '.join(map(repr, close))}?")
        raise ValueError(f"unknown {method} option(s) {', '.join(map(repr, unknown))}; {method} takes "
                         f"{', '.join(names)}" + (f" ({'; '.join(hints)})" if hints else ""))
    return cls(**values)


def check_range(name: str, value: float, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``lo <= value <= hi`` (``<`` at an open end; ``None``: unbounded). NaN fails."""
    ok = not math.isnan(value)  # NaN is in no range
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        left = "-inf" if lo is None else f"{lo}"
        right = "inf" if hi is None else f"{hi}"
        bounds = f"{'(' if lo_open or lo is None else '['}{left}, {right}{')' if hi_open or hi is None else ']'}"
        raise ValueError(f"{name} must lie in {bounds}, got {value}")
