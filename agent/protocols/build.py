"""The tool protocol of a run: :func:`make_protocol` builds the :class:`agent.protocols.base.ToolProtocol`
that ``agent.protocol`` names (``search_r1`` or ``function_call``)."""

from __future__ import annotations

from typing import Any

from agent.protocols.base import ToolProtocol
from agent.protocols.function_call import FunctionCalling
from agent.protocols.search_r1 import SearchR1

PROTOCOLS = ("search_r1", "function_call")


def make_protocol(tokenizer: Any, agent_cfg: Any) -> ToolProtocol:
    """The :class:`ToolProtocol` of ``agent_cfg.protocol`` (default ``search_r1``) for ``tokenizer``. Raises
    ``ValueError`` for an unknown name."""
    name = getattr(agent_cfg, "protocol", "search_r1")
    kinds = {"search_r1": SearchR1, "function_call": FunctionCalling}
    if name not in kinds:
        raise ValueError(f"unknown agent.protocol {name!r}; expected one of {PROTOCOLS}")
    return kinds[name](tokenizer, agent_cfg)


def prompt_ids(tokenizer: Any, question: str, agent_cfg: Any) -> list[int]:
    """Token ids of the task prompt of ``agent_cfg``'s protocol (:meth:`ToolProtocol.prompt_ids`)."""
    return make_protocol(tokenizer, agent_cfg).prompt_ids(question)
