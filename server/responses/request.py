"""A ``POST /v1/responses`` body (OpenAI API reference, Responses) -> the typed request the chat
path runs (template, tools, grammar, prefix cache, tenants, limits, telemetry): a
:class:`GenerationRequest` and chat messages as ``server.api.requests.parse_messages`` gives
them, parsed with the chat parsers' pieces at the Responses API's own paths, so every refusal
names the field as the client sent it.

- ``instructions`` -> a first ``system`` message (not carried to a continuation, as OpenAI's);
- ``previous_response_id`` -> the stored conversation's messages first (the earlier inputs and
  outputs, re-sent, so their KV cells are found in the prefix cache);
- ``input`` (a string, or items: messages with text content, ``function_call``,
  ``function_call_output``) -> user/system/developer/assistant messages, an assistant message's
  ``tool_calls``, ``tool`` messages (``input[i]...``);
- ``tools`` (``{"type": "function", "name", ...}``, ``tools[i]...``), ``tool_choice``,
  ``parallel_tool_calls`` -> the request's :class:`ToolRequest`;
- ``text.format`` -> the output constraint; ``max_output_tokens``, ``temperature``, ``top_p``
  -> the sampling settings.

Every rejection is an :class:`engine.errors.InvalidRequest` naming the Responses field.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

import ujson

from engine.errors import InvalidRequest
from engine.request import INT32_MAX, SamplingParams
from server.api.fields import FieldPolicy, number
from server.api.requests import INFORMATIONAL, parse_message, sampling_field
from server.api.tools import (FUNCTION_FIELDS, call_arguments, answered, choice_mode, function_tool, tool_array,
                              tool_request)
from server.generation.request import GenerationRequest
from server.structured.constraint import OutputConstraint
from server.api.structured import parse_text_format
from server.tools.spec import AUTO, NAMED

#: Fields this route implements, or accepts because they cannot change what is generated.
FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "metadata", "user", "stream", "stream_options", "store",
    "previous_response_id", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
    # served at their default only (below)
    "background", "include", "reasoning", "truncation", "top_logprobs", "max_tool_calls", "prompt",
    "conversation", "context_management", "moderation"})
POLICY = FieldPolicy(FIELDS, {
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
}, INFORMATIONAL)
MAX_INPUT_ITEMS = 2048
ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: A new assistant turn, even after an assistant message (never a continued one).
RENDER = {"add_generation_prompt": True, "continue_final_message": False}


def new_id(prefix: str) -> str:
    """An item or response id: ``<prefix>_`` and 48 random hex digits (OpenAI's id form)."""
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class ResponsesRequest:
    """A parsed Responses request.

    Attributes:
        generation: what is generated (sampling, constraint, tools, ``stream``, ``obfuscate``:
            ``stream_options.include_obfuscation``).
        messages: the chat messages the prompt renders (``server.api.requests.parse_messages``'s
            form): the instructions, the stored conversation, this input.
        input_items: this request's input as stored items, with ids (``GET .../input_items``).
        conversation: the messages of every turn so far without the instructions, in the stored
            form (a call's ``arguments`` as JSON text): what a continuation re-sends.
        store, previous_response_id, echo: what is stored, and what the response object echoes.
    """

    generation: GenerationRequest
    messages: list[dict]
    input_items: list[dict]
    conversation: list[dict]
    store: bool = True
    previous_response_id: str | None = None
    echo: dict = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return self.generation.stream


def previous_id(body: dict) -> str | None:
    """``previous_response_id``, checked to be an id."""
    value = body.get("previous_response_id")
    if value is not None and not (isinstance(value, str) and ID_RE.fullmatch(value)):
        raise InvalidRequest("previous_response_id must be a response id", "previous_response_id")
    return value


def parse(body: dict, load_previous: Callable[[str], dict], max_messages: int) -> ResponsesRequest:
    """``body`` -> :class:`ResponsesRequest`. ``load_previous(id)``: the stored document of
    ``previous_response_id``, called (once, when there is one) after the fields are checked,
    so a malformed request is refused before the store is asked. ``max_messages``: the
    server's limit on the messages a prompt renders (instructions and stored ones included).

    Raises:
        InvalidRequest: a field this route refuses or that is malformed (``param`` names it);
        and what ``load_previous`` raises.
    """
    POLICY.check(body)
    prev = previous_id(body)
    previous = load_previous(prev) if prev is not None else None
    for name in ("store", "stream"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequest(f"{name} must be a boolean", name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions must be a string", "instructions")
    history = list(previous["conversation"]) if previous else []
    call_ids: set[str] = set()
    messages = [parse_message(m, "previous_response_id", call_ids) for m in history]
    items, stored = _input(body.get("input"), messages, call_ids)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    if len(messages) > max_messages:  # counted as the chat route counts its messages
        raise InvalidRequest(f"messages holds {len(messages)} messages, more than this server's limit of "
                             f"{max_messages}", "input")
    stream = body.get("stream") is True
    obfuscate = _stream_options(body.get("stream_options"), stream)
    tools = _tools(body)
    constraint = _text_format(body.get("text"))
    max_tokens = number(body, "max_output_tokens", lo=0, hi=INT32_MAX, integer=True)
    sampling = {name: sampling_field(body, name) for name in ("temperature", "top_p")}
    generation = GenerationRequest(
        sampling=SamplingParams(max_new_tokens=max_tokens or None,
                                **{k: v for k, v in sampling.items() if v is not None}),
        max_tokens=max_tokens, max_tokens_param="max_output_tokens", stream=stream, obfuscate=obfuscate,
        constraint=constraint, tools=tools)
    return ResponsesRequest(generation, messages, items, history + stored, store=body.get("store") is not False,
                            previous_response_id=prev,
                            echo={"instructions": instructions, "tools": body.get("tools") or [],
                                  "tool_choice": body.get("tool_choice") or "auto", "text": body.get("text")})


def _stream_options(options, stream: bool) -> bool:
    """``stream_options`` -> ``include_obfuscation``."""
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_obfuscation"} or \
            type(options.get("include_obfuscation")) not in (type(None), bool):  # null is absent, as on chat
        raise InvalidRequest("stream_options may only hold include_obfuscation (a boolean)", "stream_options")
    if not stream:  # as chat's and legacy's
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    return bool(options.get("include_obfuscation"))


# -- input -------------------------------------------------------------------------------------------
def _input(raw, messages: list[dict], call_ids: set[str]) -> tuple[list[dict], list[dict]]:
    """``input`` -> (stored items with ids, its messages in the stored form); its messages in
    the parsed form are appended to ``messages``, and its calls' ids to ``call_ids``."""
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        return [_message_item("user", raw)], [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("input must be a string or a non-empty array of input items", "input")
    if len(raw) > MAX_INPUT_ITEMS:
        raise InvalidRequest(f"input holds {len(raw)} items, more than {MAX_INPUT_ITEMS}", "input")
    items, stored, ids = [], [], set()
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role, text = _message(item, where)
            items.append(_message_item(role, text, _item_id(item, where, "msg")))
            messages.append({"role": role, "content": text})
            stored.append({"role": role, "content": text})
        elif kind == "function_call":
            call = _function_call(item, where)
            items.append(call)
            arguments = call_arguments(call["arguments"], f"{where}.arguments")
            parsed = {"id": call["call_id"], "type": "function", "function": {"name": call["name"], "arguments": arguments}}
            sent = {"id": call["call_id"], "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]}}
            if not (stored and stored[-1]["role"] == "assistant"):  # else one assistant turn: text and calls
                messages.append({"role": "assistant", "content": None})
                stored.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(parsed)
            stored[-1].setdefault("tool_calls", []).append(sent)
            call_ids.add(call["call_id"])
        elif kind == "function_call_output":
            out = _function_call_output(item, where)
            items.append(out)
            answered(out["call_id"], f"{where}.call_id", call_ids)
            messages.append({"role": "tool", "content": out["output"], "tool_call_id": out["call_id"]})
            stored.append({"role": "tool", "tool_call_id": out["call_id"], "content": out["output"]})
        else:
            raise InvalidRequest(f"{where}.type {ujson.dumps(kind)} is not supported: input items may be messages, "
                                 "function_call and function_call_output", f"{where}.type")
        if items[-1]["id"] in ids:  # GET .../input_items pages by id (OpenAI refuses the same)
            raise InvalidRequest(f"Duplicate item found with id {items[-1]['id']}", f"{where}.id")
        ids.add(items[-1]["id"])
    return items, stored


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
def _tools(body: dict):
    """``tools`` (function tools, flat: ``{"type": "function", "name", "description",
    "parameters", "strict"}``), ``tool_choice`` and ``parallel_tool_calls`` -> the
    :class:`ToolRequest` (None: no tools)."""
    raw = tool_array(body.get("tools"))
    for i, t in enumerate(raw):  # every tool's shape before any function's fields
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidRequest(f"{where} must be an object", where)
        if t.get("type") != "function":
            raise InvalidRequest(f"{where}.type {ujson.dumps(t.get('type'))} is not supported: built-in tools are not "
                                 "available here; send function tools", f"{where}.type")
        unknown = sorted(set(t) - {"type", *FUNCTION_FIELDS})
        if unknown:
            raise InvalidRequest(f"Unrecognized tool field: {unknown[0]}", f"{where}.{unknown[0]}")
    choice, name = _tool_choice(body.get("tool_choice"))
    tools = tuple(function_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    return tool_request(tools, body.get("parallel_tool_calls"), choice, name, "tool_choice.name")


def _tool_choice(raw) -> tuple[str, str | None]:
    """``none | auto | required`` or ``{"type": "function", "name"}`` -> (mode, function)."""
    if raw is None:
        return AUTO, None
    if isinstance(raw, str):
        return choice_mode(raw), None
    if isinstance(raw, dict) and raw.get("type") == "function" and set(raw) == {"type", "name"} and \
            isinstance(raw["name"], str):
        return NAMED, raw["name"]
    raise InvalidRequest('tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                         "tool_choice")


def _text_format(text) -> OutputConstraint | None:
    """``text`` -> the output constraint of ``text.format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidRequest("text must be an object with format (and verbosity)", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequest("text.verbosity other than medium is not supported", "text.verbosity")
    return None if text.get("format") is None else parse_text_format(text["format"], "text.format")
