"""The tool protocols (``agent.protocol``): a :class:`~corpora.registry.Registry` of the
:class:`agent.protocols.base.ToolProtocol` classes, and :func:`make_protocol`, which builds the run's one.

A protocol is one :class:`~agent.protocols.base.ToolProtocol` subclass (or any ``(tokenizer, agent_cfg) ->
ToolProtocol`` factory) registered with :func:`register_protocol`; its entry says whether the policy speaks
Search-R1's ``<search>`` tags under it (the evaluation methods that read the tags, such as Search-o1, need
them). A plugin module (the config's ``plugins``) registers its own::

    from agent.protocols.base import ToolProtocol
    from agent.protocols.build import register_protocol

    @register_protocol("my_tags")
    class MyTags(ToolProtocol):
        ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.protocols.base import ToolProtocol
from agent.protocols.function_call import FunctionCalling
from agent.protocols.search_r1 import SearchR1
from corpora.registry import Registry


@dataclass(frozen=True)
class ProtocolEntry:
    """One tool protocol: ``make(tokenizer, agent_cfg) -> ToolProtocol`` (the class itself); ``tags``: the
    policy searches with Search-R1's ``<search>`` tags under it; ``description`` for help texts."""

    make: Callable[[Any, Any], ToolProtocol]
    tags: bool = False
    description: str = ""


PROTOCOLS: Registry[ProtocolEntry] = Registry("tool protocol", "agent.protocol")


def register_protocol(name: str, *, tags: bool = False, description: str = "", replace: bool = False):
    """Register the decorated :class:`ToolProtocol` subclass (or ``(tokenizer, agent_cfg)`` factory) as
    protocol ``name``. Raises ``ValueError`` for a name already registered, unless ``replace``."""

    def wrap(make: Callable[[Any, Any], ToolProtocol]):
        PROTOCOLS.add(name, ProtocolEntry(make, tags, description), replace=replace)
        return make

    return wrap


register_protocol("search_r1", tags=True, description="Search-R1's <search>/<answer> tags")(SearchR1)
register_protocol("function_call", description="native function calling through the chat template")(FunctionCalling)


def make_protocol(tokenizer: Any, agent_cfg: Any) -> ToolProtocol:
    """The :class:`ToolProtocol` of ``agent_cfg.protocol`` (default ``search_r1``) for ``tokenizer``. Raises
    ``ValueError`` for an unknown name (naming the registered ones)."""
    return PROTOCOLS.get(getattr(agent_cfg, "protocol", "search_r1")).make(tokenizer, agent_cfg)


def speaks_tags(agent_cfg: Any) -> bool:
    """Whether the policy searches with Search-R1's ``<search>`` tags under ``agent_cfg.protocol``."""
    return PROTOCOLS.get(getattr(agent_cfg, "protocol", "search_r1")).tags


def prompt_ids(tokenizer: Any, question: str, agent_cfg: Any) -> list[int]:
    """Token ids of the task prompt of ``agent_cfg``'s protocol (:meth:`ToolProtocol.prompt_ids`)."""
    return make_protocol(tokenizer, agent_cfg).prompt_ids(question)
