"""Registries of the training algorithm's parts: advantage estimators, policy losses, KL estimators and loss
aggregation modes, each a name -> entry map filled by decorators where the part is defined.

The pattern users of this field know from verl (``core_algos.register_adv_est`` /
``register_policy_loss``): a new estimator is one function and one registration, in one file (Sleuth's
own, or a plugin module named in the config's ``plugins``), and the config's allowed values are the
registered names (:func:`training.config.choice`: the one validator of a registered name). Entries are frozen
dataclasses that say what the part needs (a critic, group structure, its :class:`Options`, the inputs it
prepares), so the trainer asks the entry instead of testing names. Nothing here needs pydantic: the losses and
the kernels' benchmarks import it on machines without the config stack.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

E = TypeVar("E")


@dataclass(frozen=True)
class Options:
    """Base of a registered part's own settings (an estimator's ``train.algorithm.options``, a policy loss's
    ``train.algorithm.loss_options``): a part with settings registers a frozen dataclass subclassing this, one
    field per setting with its default, its ranges checked in ``__post_init__`` (``ValueError``, e.g. with
    :func:`training.algos.options.check_range`). The config validates the mapping it is given against the
    chosen part's class when it is loaded (unknown keys are errors naming the closest ones; values are
    converted to the field types). This base has no settings."""


def options_class(options: type, part: str) -> type[Options]:
    """``options`` when it is a frozen dataclass subclassing :class:`Options` (what a registration's
    ``options=`` takes), else ``TypeError`` naming the registered ``part``."""
    if not (isinstance(options, type) and issubclass(options, Options) and dataclasses.is_dataclass(options)
            and options.__dataclass_params__.frozen):
        raise TypeError(f"{part}: options must be a frozen dataclass subclassing training.registry.Options "
                        f"(@dataclass(frozen=True) class MyOptions(Options): ...), got {options!r}")
    return options


class Registry(Generic[E]):
    """Name -> entry for one kind of part (``kind``: e.g. ``"advantage estimator"``, used in errors)."""

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
        """``name`` if registered (for a config validator), else ``ValueError`` as :meth:`get`."""
        self.get(name)
        return name

    def unknown_message(self, name: object) -> str:
        close = difflib.get_close_matches(str(name), list(self._entries), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        return (f"unknown {self.kind} {name!r} ({self.config_key}); registered: {', '.join(self.names())}{hint} "
                "(a plugin module named in the config's `plugins` can register more)")

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)


def decorator(registry: Registry[E], name: str, make: Callable[[Callable], E], replace: bool = False):
    """A decorator registering ``make(fn)`` under ``name`` and returning ``fn`` unchanged."""

    def wrap(fn: Callable) -> Callable:
        registry.add(name, make(fn), replace=replace)
        return fn

    return wrap

