"""``inference.v1`` request messages (``proto/inference.proto``) -> the typed requests the HTTP
routes parse (``server.api``), with the same checks and the same field paths (a chat body's),
so both front ends accept and refuse the same requests in the same words.

The proto's scalar fields are named as the JSON body's, so they are read by reflection
(:func:`scalar_fields`: proto3's empties left out, enums as their JSON names) and checked by the
HTTP parsers' own code; the fields whose proto shape differs from the JSON one (tools, tool
choice, messages, schemas as JSON text) are converted here, one by one, into the typed values.
"""
from __future__ import annotations

from engine.errors import InvalidRequest
from proto import inference_pb2 as pb
from server.api import json_text
from server.api.embeddings import EmbeddingRequest, parse_embedding
from server.api.infer import parse_infer
from server.api.requests import generation_request, parse_role, render_options
from server.api.tools import answered, call_arguments, choice_mode, function_tool, tool_array, tool_request
from server.generation.request import GenerationRequest
from server.api.structured import parse_structured
from server.tenancy.tenants import Tenant, TenantRegistry
from server.tools.spec import AUTO, NAMED

#: Strings whose empty value means "the default" (``proto/inference.proto``): the server's first
#: model, the API key's tenant.
EMPTY_IS_UNSET = {"model", "tenant_id"}
#: ``ChatRequest`` fields that are not scalars of the chat body (converted below).
_CONVERTED = {"messages", "tools", "tool_choice", "response_format", "structured_outputs"}


def scalar_fields(message, skip=()) -> dict:
    """The fields of ``message`` a client set, as the JSON body of the matching HTTP request
    holds them: unset optional fields, ``*_UNSPECIFIED`` enums, empty repeated fields and empty
    :data:`EMPTY_IS_UNSET` strings are left out (the default applies; proto3 cannot tell ``""``
    from unset, and any other empty string is what HTTP gets for an empty value);
    ``Priority`` becomes ``high | normal | low``; a map an object with string keys
    (``logit_bias``); a nested message (``ResponseFormat``...) its own fields so read.

    Raises:
        InvalidRequest: an enum number the proto does not define.
    """
    body = {}
    for field in message.DESCRIPTOR.fields:
        if field.name in skip:
            continue
        value = getattr(message, field.name)
        if field.is_repeated:
            if not value:
                continue
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value = {str(k): v for k, v in value.items()}  # a JSON object: string keys, as HTTP sends
            elif field.message_type is not None:
                value = [scalar_fields(v) for v in value]
            else:
                value = list(value)
        elif field.has_presence:  # optional scalars and messages
            if not message.HasField(field.name):
                continue
            if field.message_type is not None:
                value = scalar_fields(value)
        elif field.enum_type is not None:
            if value == 0:
                continue
            known = field.enum_type.values_by_number.get(value)
            if known is None:
                names = ", ".join(v.name for v in field.enum_type.values)
                raise InvalidRequest(f"{field.name} must be one of {names}, got {value}", field.name)
            value = known.name.removeprefix(f"{field.enum_type.name.upper()}_").lower()
        elif value == "" and field.name in EMPTY_IS_UNSET:
            continue
        body[field.name] = value
    return body


def infer_request(message: pb.InferRequest, tenant: Tenant,
                  tenants: TenantRegistry) -> tuple[str, GenerationRequest, str]:
    """An ``InferRequest`` -> :func:`server.api.infer.parse_infer`'s ``(tenant_id, request,
    payload)``; its fields are ``/infer``'s body's, one for one."""
    return parse_infer(scalar_fields(message), tenant, tenants)


def model_field(message) -> dict:
    """A request message's ``model`` as a body holds it (``ModelRouter.pick``): absent when
    empty (the default model)."""
    return {"model": message.model} if message.model else {}


def chat_request(message: pb.ChatRequest, max_messages: int) -> tuple[GenerationRequest, list[dict], dict]:
    """A ``ChatRequest`` -> ``(request, messages, render options)``, as
    ``/v1/chat/completions`` parses its body (its ``model`` is picked first: :func:`model_field`).

    Raises:
        InvalidRequest: a refused field, named as the chat body names it
            (``tools[0].function.parameters``, ``response_format.json_schema.schema``...).
    """
    fields = scalar_fields(message, skip=_CONVERTED | {"model"})
    request = generation_request(fields, chat=True, structured=lambda: _structured(message),
                                 tools=lambda: _tools(message))
    messages = _messages(message.messages, max_messages)
    return request, messages, render_options({}, messages)


def embed_request(message: pb.EmbedRequest) -> EmbeddingRequest:
    """An ``EmbedRequest`` -> what ``/v1/embeddings`` parses from a body whose ``input`` is the
    strings, or the token-id arrays of ``input_ids`` (one of the two).

    Raises:
        InvalidRequest: as :func:`server.api.embeddings.parse_embedding`; both or neither input
            field set.
    """
    fields = scalar_fields(message, skip={"input", "input_ids", "model"})
    if message.input and message.input_ids:
        raise InvalidRequest("set input or input_ids, not both", "input_ids")
    if message.input_ids:
        fields["input"] = [list(t.ids) for t in message.input_ids]
    elif message.input:
        fields["input"] = list(message.input)
    return parse_embedding(fields)


def _tools(message: pb.ChatRequest):
    """``tools`` (``parameters`` as JSON text; empty: none), ``tool_choice`` (unset: auto)."""
    functions = []
    for i, tool in enumerate(tool_array(list(message.tools) or None)):
        where = f"tools[{i}].function"
        f = {"name": tool.name, "description": tool.description}
        if tool.parameters:
            try:
                f["parameters"] = json_text.loads(tool.parameters)
            except ValueError:
                raise InvalidRequest("parameters must be a JSON Schema as JSON text", f"{where}.parameters") from None
        if tool.HasField("strict"):
            f["strict"] = tool.strict
        functions.append(function_tool(f, where))
    kind = message.tool_choice.WhichOneof("choice")
    choice, name = (AUTO, None) if kind is None else \
        (choice_mode(message.tool_choice.mode), None) if kind == "mode" else (NAMED, message.tool_choice.function)
    parallel = message.parallel_tool_calls if message.HasField("parallel_tool_calls") else None
    return tool_request(tuple(functions), parallel, choice, name, "tool_choice.function.name")


def _structured(message: pb.ChatRequest):
    """``response_format`` and ``structured_outputs`` as their JSON values (a schema's JSON text
    parsed, naming its field), through chat's parser."""
    body = {}
    if message.HasField("response_format"):
        fmt = body["response_format"] = scalar_fields(message.response_format)
        for holder, param in ((fmt, "response_format.schema"),
                              (fmt.get("json_schema") or {}, "response_format.json_schema.schema")):
            if "schema" in holder:
                try:
                    holder["schema"] = json_text.loads(holder["schema"])
                except ValueError as e:
                    raise InvalidRequest(f"{param} is not JSON: {e}", param) from None
    if message.HasField("structured_outputs"):
        body["structured_outputs"] = scalar_fields(message.structured_outputs)
    return parse_structured(body)


def _messages(messages, max_messages: int) -> list[dict]:
    """``ChatMessage``s -> ``server.api.requests.parse_messages``'s messages (a ``content`` is
    always a string; an assistant's ``tool_calls`` with their ``arguments`` parsed)."""
    if not messages:
        raise InvalidRequest("messages must be a non-empty array", "messages")
    if len(messages) > max_messages:
        raise InvalidRequest(f"messages holds {len(messages)} messages, more than this server's limit of "
                             f"{max_messages}", "messages")
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        parsed = {"role": parse_role(m.role, where), "content": m.content}
        if m.HasField("name"):
            parsed["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequest(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
            parsed["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name,
                              "arguments": call_arguments(c.arguments, f"{where}.tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
            call_ids.update(c.id for c in m.tool_calls)
        if m.role == "tool":
            if not m.HasField("tool_call_id"):
                raise InvalidRequest(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            parsed["tool_call_id"] = answered(m.tool_call_id, f"{where}.tool_call_id", call_ids)
        elif m.HasField("tool_call_id"):
            raise InvalidRequest(f"{where}.tool_call_id is only allowed on tool messages", f"{where}.tool_call_id")
        out.append(parsed)
    return out
