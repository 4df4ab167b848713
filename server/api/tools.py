"""The tool-calling fields of a chat body (OpenAI API reference, Chat Completions): ``tools``,
``tool_choice``, ``parallel_tool_calls``, and the tool fields of messages (an assistant
message's ``tool_calls``, a ``role: "tool"`` message's ``tool_call_id``, ``name`` on any
message). Every rejection is an :class:`engine.errors.InvalidRequest` naming the field as the
client sent it: the pieces (:func:`function_tool`, :func:`tool_request`, :func:`call_arguments`,
:func:`answered`) take the path, so the Responses API's shapes (``server/responses/request.py``)
are parsed with them too."""
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
    """Chat's ``tools`` (``[{"type": "function", "function": {...}}]``), ``tool_choice`` and
    ``parallel_tool_calls`` -> a :class:`ToolRequest`, or None when the request gives no tools
    (then ``tool_choice`` may only be ``none`` or ``auto``, as when a client sends its defaults).

    Raises:
        InvalidRequest: a malformed tool (``tools[i]...``), a duplicate name, a choice that
            names no given tool or cannot be served (``tool_choice``).
    """
    tools = tuple(_chat_tool(t, f"tools[{i}]") for i, t in enumerate(tool_array(body.get("tools"))))
    return tool_request(tools, body.get("parallel_tool_calls"), *_choice(body.get("tool_choice")),
                        "tool_choice.function.name")


def tool_array(raw) -> list:
    """A request's ``tools``: an array of at most :data:`MAX_TOOLS` (absent or null: none)."""
    if raw is not None and not isinstance(raw, list):
        raise InvalidRequest("tools must be an array of tools", "tools")
    if len(raw or ()) > MAX_TOOLS:
        raise InvalidRequest(f"tools holds {len(raw)} tools, more than {MAX_TOOLS}", "tools")
    return raw or []


def tool_request(tools: tuple[Tool, ...], parallel, choice: str, name: str | None,
                 name_param: str) -> ToolRequest | None:
    """The :class:`ToolRequest` of parsed ``tools`` (each named by its :attr:`Tool.path`),
    ``parallel_tool_calls`` as sent, and a ``tool_choice`` mode with the function it names (at
    ``name_param``), or None without tools.

    Raises:
        InvalidRequest: a duplicate name, a ``parallel_tool_calls`` that is no boolean, a named
            function not in ``tools``, or a choice other than none or auto without tools.
    """
    names = [t.name for t in tools]
    for i, tool in enumerate(tools):
        if tool.name in names[:i]:
            raise InvalidRequest(f"{tool.path}.name {tool.name!r} is given twice", f"{tool.path}.name")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if name is not None and name not in names:
        raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools", name_param)
    if not tools:
        if choice not in (NONE, AUTO):
            raise InvalidRequest("tool_choice requires tools", "tool_choice")
        return None
    # A named function is called once (as vLLM and llama-server do; OpenAI's models make one
    # call): with parallel calls allowed a small model repeated it until max_tokens, and clients
    # that force a function to extract one object (instructor's default mode) saw "length".
    return ToolRequest(tools, choice, name, choice != NAMED and parallel is not False)


def _chat_tool(raw, where: str) -> Tool:
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
    unknown = sorted(set(f) - FUNCTION_FIELDS)
    if unknown:
        raise InvalidRequest(f"Unrecognized function field: {unknown[0]}", f"{where}.{unknown[0]}")
    return function_tool(f, where)


#: The fields of a function (chat's ``tools[i].function``, the Responses API's ``tools[i]``).
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def function_tool(f: dict, where: str) -> Tool:
    """A function's fields (``name``, ``description``, ``parameters``, ``strict``), found at
    ``where`` in the request, -> a :class:`Tool` that keeps ``where`` for later refusals.

    Raises:
        InvalidRequest: a malformed field, named ``{where}.<field>``.
    """
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
    return Tool(name, description or "", parameters, bool(strict), path=where)


def choice_mode(raw: str) -> str:
    """A ``tool_choice`` string: ``none``, ``auto`` or ``required``."""
    if raw not in (NONE, AUTO, REQUIRED):
        raise InvalidRequest(f"tool_choice must be none, auto, required or a function, got {ujson.dumps(raw)}",
                             "tool_choice")
    return raw


def _choice(raw) -> tuple[str, str | None]:
    """Chat's ``tool_choice`` -> (mode, the function it names or None)."""
    if raw is None:
        return AUTO, None
    if isinstance(raw, str):
        return choice_mode(raw), None
    function = raw.get("function") if isinstance(raw, dict) else None
    if not (isinstance(raw, dict) and raw.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise InvalidRequest('tool_choice must be none, auto, required or {"type": "function", "function": '
                             '{"name": ...}}', "tool_choice")
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
        out["tool_call_id"] = answered(call_id, f"{where}.tool_call_id", call_ids)
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
    arguments = call_arguments(f.get("arguments"), f"{where}.function.arguments")
    return {"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": arguments}}


def call_arguments(arguments, param: str) -> dict:
    """A past call's ``arguments`` (JSON text of an object, at ``param``) as the object, which
    a chat template takes.

    Raises:
        InvalidRequest: anything but the JSON text of an object, naming ``param``.
    """
    try:
        parsed = json_text.loads(arguments) if isinstance(arguments, str) else None
    except ValueError as e:
        raise InvalidRequest(f"{param} must be a string holding a JSON object: {e}", param) from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{param} must be a string holding a JSON object", param)
    return parsed


def answered(call_id: str, param: str, call_ids: set[str]) -> str:
    """A tool result's call id (at ``param``), which must answer a call of an earlier assistant
    message (``call_ids``).

    Raises:
        InvalidRequest: an id no earlier call has.
    """
    if call_id not in call_ids:
        raise InvalidRequest(f"{param} {call_id!r} answers no tool call of an earlier assistant message", param)
    return call_id
