"""The one registry pattern of every pluggable choice: a name -> entry map per kind of part, filled by
decorators where the parts are defined (verl's ``register_adv_est`` / ``register_policy_loss``).

Retrievers (``retrieval.method``), LLM backends (``agent.backend.kind``), tool protocols (``agent.protocol``),
evaluation methods (``sleuth eval --method``), advantage estimators, policy losses, KL estimators and loss
aggregations each have one :class:`Registry`. An entry is a small frozen dataclass that says what the choice
needs (an index, a critic, the Search-R1 tags, ...), so callers ask the entry instead of testing names, and
the config's allowed values and the command line's help texts are the registered names. A plugin module named
in the config's ``plugins`` registers more before the config is validated.

It lives here, in the lowest layer, so that every layer can keep a registry of its own parts (the retrieval
layer cannot import training); it knows nothing of what it holds.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

E = TypeVar("E")


class Registry(Generic[E]):
    """Name -> entry for one kind of part. ``kind`` names it in errors (``"advantage estimator"``) and
    ``config_key`` is where a config chooses one (``train.algorithm``)."""

    def __init__(self, kind: str, config_key: str):
        self.kind, self.config_key = kind, config_key
        self._entries: dict[str, E] = {}

    def add(self, name: str, entry: E, *, replace: bool = False) -> E:
        """Register ``entry`` under ``name``. Raises ``ValueError`` when ``name`` is empty or already
        registered (unless ``replace``: a plugin deliberately overriding a built-in)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered (pass replace=True to override it)")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> E:
        """The entry of ``name``. Raises ``ValueError`` naming the config key, the registered names and the
        closest matches."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(self.unknown_message(name)) from None

    def check(self, name: str) -> str:
        """``name`` if registered (a config field's validator), else ``ValueError`` as :meth:`get`."""
        self.get(name)
        return name

    def unknown_message(self, name: object) -> str:
        close = difflib.get_close_matches(str(name), list(self._entries), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        return (f"unknown {self.kind} {name!r} ({self.config_key}); registered: {', '.join(self.names())}{hint} "
                "(a plugin module named in the config's `plugins` can register more)")

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (the built-ins first)."""
        return tuple(self._entries)

    def help(self, default: str | None = None) -> str:
        """A help text of the choice for the command line and the config schema: ``"one of a, b, c (default
        a; a plugin can register more)"``."""
        tail = f"default {default}; " if default else ""
        return f"one of {', '.join(self.names())} ({tail}a plugin can register more)"

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def decorator(registry: Registry[E], name: str, make: Callable[[Callable], E], replace: bool = False):
    """A decorator registering ``make(fn)`` under ``name`` and returning ``fn`` unchanged."""

    def wrap(fn: Callable) -> Callable:
        registry.add(name, make(fn), replace=replace)
        return fn

    return wrap
