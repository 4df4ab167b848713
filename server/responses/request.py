"""A ``POST /v1/responses`` body (OpenAI API reference, Responses) -> the Chat Completions body
it means, so that a Responses request runs the chat path unchanged (template, tools, grammar,
prefix cache, tenants, limits, telemetry): ``server.api.requests.parse_generation`` and
``parse_messages`` check the translated body, and a refusal is turned back into the Responses
field it came from (``server/responses/errors.py``, with each message's :class:`Origin`).

- ``instructions`` -> a first ``system`` message (not carried to a continuation, as OpenAI's);
- ``previous_response_id`` -> the stored conversation's chat messages first (the earlier
  inputs and outputs, re-sent, so their KV cells are found in the prefix cache);
- ``input`` (a string, or items: messages with text content, ``function_call``,
  ``function_call_output``) -> user/system/developer/assistant messages, an assistant message's
  ``tool_calls``, ``tool`` messages;
- ``tools`` (``{"type": "function", "name", ...}``) and ``tool_choice`` -> chat's nested form;
- ``text.format`` -> ``response_format``; ``max_output_tokens`` -> ``max_tokens``.

Every rejection is an :class:`engine.errors.InvalidRequest` naming the Responses field.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

import ujson

from engine.errors import InvalidRequest
from server.responses.errors import Origin

#: Fields this route implements, or accepts because they cannot change what is generated.
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "text", "metadata", "user", "stream", "stream_options", "store",
          "previous_response_id", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
          "service_tier",
          # served at their default only (below)
          "background", "include", "reasoning", "truncation", "top_logprobs", "max_tool_calls", "prompt",
          "conversation", "context_management", "moderation"}
#: field -> (values served, why another value is refused).
DEFAULT_ONLY = {
    "background": ([False], "background responses are not supported"),
    "include": ([[]], "include is not supported: there is nothing more to include"),
    "reasoning": ([{}, {"effort": None}, {"effort": None, "summary": None}],
                  "reasoning is not supported: the model does not reason"),
    "truncation": (["disabled"], "truncation other than \"disabled\" is not supported"),
    "top_logprobs": ([0], "top_logprobs (logprobs) are not supported on /v1/responses"),
    "max_tool_calls": ([], "max_tool_calls is not supported: there are no built-in tools"),
    "prompt": ([], "prompt templates are not supported"),
    "conversation": ([], "conversations are not supported: continue with previous_response_id"),
    "context_management": ([], "context_management is not supported"),
    "moderation": ([], "moderation is not supported"),
}
#: Passed to the chat body as they are (checked there).
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "metadata", "user", "stream",
          "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier")
MAX_INPUT_ITEMS = 2048
ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


def new_id(prefix: str) -> str:
    """An item or response id: ``<prefix>_`` and 48 random hex digits (OpenAI's id form)."""
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class ResponsesRequest:
    """A parsed Responses request: ``chat`` (the chat body it means: messages, tools,
    sampling), ``input_items`` (this request's input as stored items, with ids, for
    ``GET .../input_items``), ``conversation`` (the chat messages of every turn so far without
    the instructions: what a continuation re-sends), and what the response object echoes."""

    chat: dict
    input_items: list[dict]
    conversation: list[dict]
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    echo: dict = field(default_factory=dict)
    #: Where each of ``chat["messages"]`` came from (to name a refusal's field).
    origins: list[Origin] = field(default_factory=list)
    #: ``stream_options.include_obfuscation``: delta events padded (``server.http.json.obfuscated``).
    obfuscate: bool = False


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def check_fields(body: dict) -> None:
    """Every field is one this route takes, and the unimplemented ones are at their default."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, (served, why) in DEFAULT_ONLY.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in served):
            raise InvalidRequest(why, name)


def previous_id(body: dict) -> str | None:
    """``previous_response_id``, checked to be an id."""
    value = body.get("previous_response_id")
    if value is not None and not (isinstance(value, str) and ID_RE.fullmatch(value)):
        raise InvalidRequest("previous_response_id must be a response id", "previous_response_id")
    return value


def parse(body: dict, load_previous: Callable[[str], dict]) -> ResponsesRequest:
    """``body`` -> :class:`ResponsesRequest`. ``load_previous(id)``: the stored document of
    ``previous_response_id``, called (once, when there is one) after the fields are checked,
    so a malformed request is refused before the store is asked.

    Raises:
        InvalidRequest: a field this route refuses or that is malformed (``param`` names it);
        and what ``load_previous`` raises.
    """
    check_fields(body)
    prev = previous_id(body)
    previous = load_previous(prev) if prev is not None else None
    for name in ("store", "stream"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequest(f"{name} must be a boolean", name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions must be a string", "instructions")
    items, messages, origins = _input(body.get("input"))
    history = list(previous["conversation"]) if previous else []
    conversation = history + messages
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    origins = ([Origin("instructions", "system")] if instructions else []) + \
        [Origin("previous_response_id", m["role"]) for m in history] + origins
    chat["add_generation_prompt"] = True  # a new assistant turn, even after an assistant message
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"} or \
                type(options.get("include_obfuscation")) not in (type(None), bool):  # null is absent, as on chat
            raise InvalidRequest("stream_options may only hold include_obfuscation (a boolean)", "stream_options")
        if not body.get("stream"):  # as chat's and legacy's
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return ResponsesRequest(chat, items, conversation, store=body.get("store") is not False,
                            stream=body.get("stream") is True, previous_response_id=body.get("previous_response_id"),
                            echo={"instructions": instructions, "tools": body.get("tools") or [],
                                  "tool_choice": body.get("tool_choice") or "auto", "text": body.get("text")},
                            origins=origins, obfuscate=bool((options or {}).get("include_obfuscation")))


# -- input -------------------------------------------------------------------------------------------
def _input(raw) -> tuple[list[dict], list[dict], list[Origin]]:
    """``input`` -> (stored items with ids, chat messages, where each message came from)."""
    if isinstance(raw, str):
        return [_message_item("user", raw)], [{"role": "user", "content": raw}], [Origin("input", "user")]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("input must be a string or a non-empty array of input items", "input")
    if len(raw) > MAX_INPUT_ITEMS:
        raise InvalidRequest(f"input holds {len(raw)} items, more than {MAX_INPUT_ITEMS}", "input")
    items, messages, origins, ids = [], [], [], set()
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role, text = _message(item, where)
            items.append(_message_item(role, text, _item_id(item, where, "msg")))
            messages.append({"role": role, "content": text})
            origins.append(Origin(where, role))
        elif kind == "function_call":
            call = _function_call(item, where)
            items.append(call)
            last = messages[-1] if messages else None
            chat_call = {"id": call["call_id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(chat_call)  # one assistant turn: text and calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
                messages[-1]["tool_calls"].append(chat_call)
                origins.append(Origin(where, "assistant"))
            origins[-1].calls.append(where)
        elif kind == "function_call_output":
            out = _function_call_output(item, where)
            items.append(out)
            messages.append({"role": "tool", "tool_call_id": out["call_id"], "content": out["output"]})
            origins.append(Origin(where, "tool"))
        else:
            raise InvalidRequest(f"{where}.type {ujson.dumps(kind)} is not supported: input items may be messages, "
                                 "function_call and function_call_output", f"{where}.type")
        if items[-1]["id"] in ids:  # GET .../input_items pages by id (OpenAI refuses the same)
            raise InvalidRequest(f"Duplicate item found with id {items[-1]['id']}", f"{where}.id")
        ids.add(items[-1]["id"])
    return items, messages, origins


def _message(item: dict, where: str) -> tuple[str, str]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(f"{where}.role must be user, assistant, system or developer, got {ujson.dumps(role)}",
                             f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return role, content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or an array of text parts", f"{where}.content")
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequest(f"{at} has type {ujson.dumps(kind)}; this model accepts text parts only "
                                 "(input_text, output_text)", f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{at}.text must be a string", f"{at}.text")
        texts.append(part["text"])
    return role, "".join(texts)


def _item_id(item: dict, where: str, prefix: str) -> str:
    given = item.get("id")
    if given is None:
        return new_id(prefix)
    if not isinstance(given, str):
        raise InvalidRequest(f"{where}.id must be a string", f"{where}.id")
    return given


def _message_item(role: str, text: str, item_id: str | None = None) -> dict:
    """A message as ``GET .../input_items`` lists it (InputMessageResource, or OutputMessage
    for an assistant's); ``item_id`` None: a new one."""
    item = {"id": item_id or new_id("msg"), "type": "message", "role": role, "status": "completed"}
    if role == "assistant":
        return {**item, "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
    return {**item, "content": [{"type": "input_text", "text": text}]}


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where}.{name} must be a non-empty string", f"{where}.{name}")
    return value


def _function_call(item: dict, where: str) -> dict:
    return {"id": _item_id(item, where, "fc"), "type": "function_call", "status": "completed",
            "call_id": _string(item, "call_id", where), "name": _string(item, "name", where),
            "arguments": _string(item, "arguments", where)}


def _function_call_output(item: dict, where: str) -> dict:
    output = item.get("output")
    if isinstance(output, list):  # text parts only
        if not all(isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str)
                   for p in output):
            raise InvalidRequest(f"{where}.output may hold input_text parts only", f"{where}.output")
        output = "".join(p["text"] for p in output)
    if not isinstance(output, str):
        raise InvalidRequest(f"{where}.output must be a string or an array of input_text parts", f"{where}.output")
    return {"id": _item_id(item, where, "fco"), "type": "function_call_output", "status": "completed",
            "call_id": _string(item, "call_id", where), "output": output}


# -- tools and format --------------------------------------------------------------------------------
def _tools(raw) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest("tools must be an array of tools", "tools")
    out = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidRequest(f"{where} must be an object", where)
        if t.get("type") != "function":
            raise InvalidRequest(f"{where}.type {ujson.dumps(t.get('type'))} is not supported: built-in tools are not "
                                 "available here; send function tools", f"{where}.type")
        unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidRequest(f"Unrecognized tool field: {unknown[0]}", f"{where}.{unknown[0]}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def _tool_choice(raw):
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and set(raw) == {"type", "name"} and \
            isinstance(raw["name"], str):  # else chat's check would quote chat's shape
        return {"type": "function", "function": {"name": raw.get("name")}}
    raise InvalidRequest('tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                         "tool_choice")


def _text_format(text) -> dict | None:
    """``text`` -> chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidRequest("text must be an object with format (and verbosity)", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequest("text.verbosity other than medium is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema":
        unknown = sorted(set(fmt) - {"type", "name", "schema", "description", "strict"})
        if unknown:
            raise InvalidRequest(f"Unrecognized text.format field: {unknown[0]}", f"text.format.{unknown[0]}")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "description", "strict")
                                                       if k in fmt}}
    raise InvalidRequest("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or a json_schema "
                         "format", "text.format")
