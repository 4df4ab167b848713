"""The tool-calling fields of a chat body (OpenAI API reference, Chat Completions): ``tools``,
``tool_choice``, ``parallel_tool_calls``, and the tool fields of messages (an assistant
message's ``tool_calls``, a ``role: "tool"`` message's ``tool_call_id``, ``name`` on any
message). Every rejection is an :class:`engine.errors.InvalidRequest` naming the field."""
from __future__ import annotations

import re

import ujson

from engine.errors import InvalidRequest
from server.api import json_text
from server.tools.spec import AUTO, NAMED, NONE, REQUIRED, Tool, ToolRequest

#: OpenAI's rule for a function's name, and its limit on a request's tools.
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128


def parse_tools(body: dict) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> a :class:`ToolRequest`, or None
    when the request gives no tools (then ``tool_choice`` may only be ``none`` or ``auto``, as
    when a client sends its defaults).

    Raises:
        InvalidRequest: a malformed tool (``tools[i]...``), a duplicate name, a choice that
            names no given tool or cannot be served (``tool_choice``).
    """
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidRequest("tools must be an array of tools", "tools")
    if len(raw or ()) > MAX_TOOLS:
        raise InvalidRequest(f"tools holds {len(raw)} tools, more than {MAX_TOOLS}", "tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw or ()))
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"tools[{i}].function.name {name!r} is given twice", f"tools[{i}].function.name")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice, name = _choice(body.get("tool_choice"), tools)
    if not tools:
        if choice not in (NONE, AUTO):
            raise InvalidRequest("tool_choice requires tools", "tool_choice")
        return None
    # A named function is called once (as vLLM and llama-server do; OpenAI's models make one
    # call): with parallel calls allowed a small model repeated it until max_tokens, and clients
    # that force a function to extract one object (instructor's default mode) saw "length".
    return ToolRequest(tools, choice, name, choice != NAMED and parallel is not False)


def _tool(raw, where: str) -> Tool:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", where)
    if raw.get("type") != "function":
        raise InvalidRequest(f"{where}.type must be \"function\", got {ujson.dumps(raw.get('type'))}", f"{where}.type")
    unknown = sorted(set(raw) - {"type", "function"})
    if unknown:
        raise InvalidRequest(f"Unrecognized tool field: {unknown[0]}", f"{where}.{unknown[0]}")
    f = raw.get("function")
    where = f"{where}.function"
    if not isinstance(f, dict):
        raise InvalidRequest(f"{where} must be an object", where)
    unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequest(f"Unrecognized function field: {unknown[0]}", f"{where}.{unknown[0]}")
    name = f.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidRequest(f"{where}.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got "
                             f"{ujson.dumps(name)}", f"{where}.name")
    description = f.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.description must be a string", f"{where}.description")
    parameters = f.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}  # OpenAI: omitted means no arguments
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequest(f"{where}.parameters must be a JSON Schema of an object", f"{where}.parameters")
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{where}.strict must be a boolean", f"{where}.strict")
    return Tool(name, description or "", parameters, bool(strict))


def _choice(raw, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if raw is None:
        return AUTO, None
    if isinstance(raw, str):
        if raw not in (NONE, AUTO, REQUIRED):
            raise InvalidRequest(f"tool_choice must be none, auto, required or a function, got {ujson.dumps(raw)}",
                                 "tool_choice")
        return raw, None
    function = raw.get("function") if isinstance(raw, dict) else None
    if not (isinstance(raw, dict) and raw.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise InvalidRequest('tool_choice must be none, auto, required or {"type": "function", "function": '
                             '{"name": ...}}', "tool_choice")
    if function["name"] not in {t.name for t in tools}:
        raise InvalidRequest(f"tool_choice names function {function['name']!r}, which is not in tools",
                             "tool_choice.function.name")
    return NAMED, function["name"]


def message_tool_fields(m: dict, where: str, role: str, call_ids: set[str]) -> dict:
    """The tool fields of message ``m`` (at ``where``, e.g. ``messages[3]``) as the chat template
    takes them (Hugging Face's convention): ``name``; an assistant's ``tool_calls`` with each
    call's ``arguments`` parsed into an object; a tool message's ``tool_call_id``, which must
    answer a call of an earlier assistant message (``call_ids``, which this extends).

    Raises:
        InvalidRequest: a malformed field, or a tool message that answers no earlier call.
    """
    out = {}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}.name must be a string", f"{where}.name")
        out["name"] = name
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise InvalidRequest(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise InvalidRequest(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
        if calls:
            out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            call_ids.update(c["id"] for c in out["tool_calls"])
    call_id = m.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str):
            raise InvalidRequest(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        if call_id not in call_ids:
            raise InvalidRequest(f"{where}.tool_call_id {call_id!r} answers no tool call of an earlier assistant "
                                 "message", f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    elif call_id is not None:
        raise InvalidRequest(f"{where}.tool_call_id is only allowed on tool messages", f"{where}.tool_call_id")
    return out


def _history_call(c, where: str) -> dict:
    if not isinstance(c, dict):
        raise InvalidRequest(f"{where} must be an object", where)
    if not isinstance(c.get("id"), str):
        raise InvalidRequest(f"{where}.id must be a string", f"{where}.id")
    if c.get("type", "function") != "function":
        raise InvalidRequest(f"{where}.type must be \"function\"", f"{where}.type")
    f = c.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise InvalidRequest(f"{where}.function must be an object with a name", f"{where}.function")
    arguments = f.get("arguments")
    try:
        parsed = json_text.loads(arguments) if isinstance(arguments, str) else None
    except ValueError as e:
        raise InvalidRequest(f"{where}.function.arguments must be a string holding a JSON object: {e}",
                             f"{where}.function.arguments") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{where}.function.arguments must be a string holding a JSON object",
                             f"{where}.function.arguments")
    return {"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": parsed}}
