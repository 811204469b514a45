"""Registries of the training algorithm's parts: advantage estimators, policy losses, KL estimators and loss
aggregation modes, each a name -> entry map filled by decorators where the part is defined.

The pattern users of this field know from verl (``core_algos.register_adv_est`` /
``register_policy_loss``): a new estimator is one function and one registration, in one file (Sleuth's
own, or a plugin module named in the config's ``plugins``), and the config's allowed values are the
registered names. Entries are frozen dataclasses that say what the part needs (a critic, group structure,
per-turn gold-answer probabilities, ...), so the trainer asks the entry instead of testing names.

The :class:`Registry` class itself is the one every pluggable choice of every layer uses
(:mod:`corpora.registry`, the lowest layer: retrievers, backends and tool protocols sit below training).
"""

from __future__ import annotations

from corpora.registry import Registry, decorator

__all__ = ["Registry", "decorator"]
