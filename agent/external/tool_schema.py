"""The ``tools`` of a chat request to the training proxy, checked and put in the one form chat templates
render: OpenAI's ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``.

A tool the proxy cannot read is never dropped in silence (the policy would then be prompted without it and
trained on episodes that differ from what the agent meant): it is converted when its meaning is
unambiguous, else refused with an error naming the field.

* OpenAI's form is taken as it is (``strict`` and other keys of ``function`` are kept for the template).
* Anthropic's form ``{"name", "description"?, "input_schema"}`` (what an agent written for Claude's API
  declares) is converted: ``input_schema`` is the function's ``parameters``.
* Anything else is refused: a tool of another ``type`` (``web_search``, ``code_interpreter``: the proxy
  runs no tools), a function without a name, ``parameters`` that is not a JSON-schema object.

The legacy ``functions`` / ``function_call`` fields (before OpenAI's ``tools``) are refused by
:func:`check_legacy_fields` with the form to send instead, and so is a ``tool_choice`` that forces a call
(``"required"``, a named function): the proxy samples the policy freely and cannot force one.
"""

from __future__ import annotations

from typing import Any

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")  # as OpenAI's API


class ToolSchemaError(ValueError):
    """A ``tools`` entry (or tool field) the proxy cannot take; ``param`` names it (``tools[1].function.name``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` in OpenAI's function form (see the module docstring); ``None`` for none. Raises
    :class:`ToolSchemaError` naming the first entry or field that is neither OpenAI's nor Anthropic's form."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ToolSchemaError(f"tools must be a list of tool objects, got {type(tools).__name__}", "tools")
    return [_one(t, f"tools[{i}]") for i, t in enumerate(tools)]


def _one(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ToolSchemaError(f"{where} must be an object, got {type(tool).__name__}", where)
    if "input_schema" in tool and "function" not in tool:  # Anthropic's form
        fn = {"name": tool.get("name")}  # in OpenAI's order: the template renders what it is given
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        _check_function(fn, where, f"{where}.input_schema")
        return {"type": "function", "function": fn}
    kind = tool.get("type", "function")
    if kind != "function":
        raise ToolSchemaError(f"{where}.type is {kind!r}: the proxy serves a policy that calls functions its agent "
                              "runs; only tools of type 'function' are taken", f"{where}.type")
    fn = tool.get("function")
    if fn is None:
        hint = (" (this looks like a legacy 'functions' entry: wrap it as {\"type\": \"function\", \"function\": "
                "{...}})" if "name" in tool else "")
        raise ToolSchemaError(f"{where}.function is missing: a tool is {{\"type\": \"function\", \"function\": "
                              f"{{\"name\", \"description\", \"parameters\"}}}}{hint}", f"{where}.function")
    if not isinstance(fn, dict):
        raise ToolSchemaError(f"{where}.function must be an object", f"{where}.function")
    _check_function(fn, f"{where}.function", f"{where}.function.parameters")
    return {**tool, "type": "function", "function": dict(fn)}


def _check_function(fn: dict[str, Any], prefix: str, schema_field: str) -> None:
    name = fn.get("name")
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS or len(name) > 64:
        raise ToolSchemaError(f"{prefix}.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}",
                              f"{prefix}.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ToolSchemaError(f"{prefix}.description must be a string", f"{prefix}.description")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise ToolSchemaError(f"{schema_field} must be a JSON schema of type 'object', got {params!r:.80}",
                              schema_field)


def check_legacy_fields(body: dict[str, Any]) -> None:
    """Raise :class:`ToolSchemaError` for the legacy ``functions`` / ``function_call`` fields (unless empty or
    ``"none"``/``"auto"``) and for a ``tool_choice`` the proxy cannot honour (see the module docstring)."""
    if body.get("functions") not in (None, []):
        raise ToolSchemaError("functions (the legacy form of tools) is not supported: send tools=[{\"type\": "
                              "\"function\", \"function\": {\"name\", \"description\", \"parameters\"}}]", "functions")
    if body.get("function_call") not in (None, "none", "auto"):
        raise ToolSchemaError("function_call (the legacy form of tool_choice) is not supported: send tool_choice",
                              "function_call")
    choice = body.get("tool_choice")
    if choice in (None, "none", "auto"):
        return
    if choice == "required" or isinstance(choice, dict):
        raise ToolSchemaError(f"tool_choice={choice!r:.80} would force a tool call, which the proxy cannot do (it "
                              "samples the policy as it is, to train on what it does); send 'auto' or 'none', or "
                              "leave it out", "tool_choice")
    raise ToolSchemaError(f"tool_choice must be 'auto' or 'none', got {choice!r:.80}", "tool_choice")
