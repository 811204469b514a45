"""Registries of the training algorithm's parts: advantage estimators, policy losses, KL estimators and loss
aggregation modes, each a name -> entry map filled by decorators where the part is defined.

The pattern users of this field know from verl (``core_algos.register_adv_est`` /
``register_policy_loss``): a new estimator is one function and one registration, in one file (Sleuth's
own, or a plugin module named in the config's ``plugins``), and the config's allowed values are the
registered names (:func:`training.config.choice`: the one validator of a registered name). Entries are frozen
dataclasses that say what the part needs (a critic, group structure, its :class:`Options`, the inputs it
prepares), so the trainer asks the entry instead of testing names. Nothing here needs pydantic: the losses and
the kernels' benchmarks import it on machines without the config stack.

The :class:`Registry` class itself is the one every pluggable choice of every layer uses
(:mod:`corpora.registry`, the lowest layer: retrievers, backends and tool protocols sit below training).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from corpora.registry import Registry, decorator

__all__ = ["Options", "Registry", "decorator", "options_class"]


@dataclass(frozen=True)
class Options:
    """Base of a registered part's own settings (an estimator's ``train.algorithm.options``, a policy loss's
    ``train.algorithm.loss_options``): a part with settings registers a frozen dataclass subclassing this, one
    field per setting with its default, its ranges checked in ``__post_init__`` (``ValueError``, e.g. with
    :func:`training.algos.options.check_range`). The config validates the mapping it is given against the
    chosen part's class when it is loaded (unknown keys are errors naming the closest ones; values are
    converted to the field types). This base has no settings.

    :meth:`check_model` runs the checks that need the policy (its vocabulary), when training starts: before the
    first step, after the config was loaded."""

    def check_model(self, vocab_size: int) -> None:
        """Raise ``ValueError`` for settings the policy cannot have: ``vocab_size`` is the number of tokens
        ``V`` of its output layer. This base checks nothing; a part overrides it (AEPO: its entropy target
        must lie in ``(0, log V)`` nats)."""


def options_class(options: type, part: str) -> type[Options]:
    """``options`` when it is a frozen dataclass subclassing :class:`Options` (what a registration's
    ``options=`` takes), else ``TypeError`` naming the registered ``part``."""
    if not (isinstance(options, type) and issubclass(options, Options) and dataclasses.is_dataclass(options)
            and options.__dataclass_params__.frozen):
        raise TypeError(f"{part}: options must be a frozen dataclass subclassing training.registry.Options "
                        f"(@dataclass(frozen=True) class MyOptions(Options): ...), got {options!r}")
    return options
