"""``inference.v1.InferenceService`` (``proto/inference.proto``): the gRPC front end.

A request message becomes the same dict an HTTP body would be (:func:`message_body`) and goes
through the same parsers (``server.api.requests``, ``server.api.infer``), the same :class:`Generator`
(tokenizer, chat template, engine client, detokenizer with stop strings, rate limits) and the same
error mapping (``server.errors.grpc_error``) as the HTTP routes, so the two front ends accept
and refuse the same requests.

Metadata: ``authorization: Bearer <key>`` or ``x-tenant-id: <key>`` names the tenant. The call's
gRPC deadline becomes the request's deadline in the engine, and a cancelled call (or a client
that went away) cancels its sequences, queued or running.
"""
from __future__ import annotations

import functools
import inspect
import secrets

import grpc

from engine.errors import DeadlineExceeded, EngineError, InvalidRequest, RequestError, Unauthenticated
from engine.request import DEADLINE_MS_BOUNDS
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from server.api import json_text
from server.api.infer import infer_result, parse_infer
from server.api.requests import check_model, parse_generation, parse_messages, render_options
from server.config import ServerConfig
from server.errors import grpc_error
from server.generation.pipeline import Generation, Generator
from server.generation.request import Delta
from server.observability.telemetry import RequestRecord, Telemetry
from server.tenancy.tenants import Tenant, TenantRegistry, key_of

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


def message_body(message) -> dict:
    """The message as the JSON body of the matching HTTP request. Unset optional fields,
    ``*_UNSPECIFIED`` enums and empty repeated fields are left out (the default applies); a
    plain string is always there (proto3 cannot tell ``""`` from unset, and ``""`` is what HTTP
    gets for an empty payload or message); ``Priority`` becomes ``high | normal | low``; nested
    messages become dicts, and maps objects with string keys (``logit_bias``).

    Raises:
        InvalidRequest: an enum number the proto does not define.
    """
    body = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.is_repeated:
            if not value:
                continue
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value = {str(k): v for k, v in value.items()}  # a JSON object: string keys, as HTTP sends
            elif field.message_type is not None:
                value = [message_body(v) for v in value]
            else:
                value = list(value)
        elif field.has_presence:  # optional scalars and messages
            if not message.HasField(field.name):
                continue
            if field.message_type is not None:
                value = message_body(value)
        elif field.enum_type is not None:
            if value == 0:
                continue
            known = field.enum_type.values_by_number.get(value)
            if known is None:
                names = ", ".join(v.name for v in field.enum_type.values)
                raise InvalidRequest(f"{field.name} must be one of {names}, got {value}", field.name)
            value = known.name.removeprefix(f"{field.enum_type.name.upper()}_").lower()
        body[field.name] = value
    return body


def _schemas_from_text(body: dict) -> None:
    """``ResponseFormat``'s schemas travel as JSON text (proto/inference.proto): made JSON values
    in place, as an HTTP body holds them (``StructuredOutputs.json`` may stay text, as in HTTP).

    Raises:
        InvalidRequest: text that is not JSON, naming the field.
    """
    fmt = body.get("response_format") or {}
    for holder, param in ((fmt, "response_format.schema"),
                          (fmt.get("json_schema") or {}, "response_format.json_schema.schema")):
        if isinstance(holder.get("schema"), str):
            try:
                holder["schema"] = json_text.loads(holder["schema"])
            except ValueError as e:
                raise InvalidRequest(f"{param} is not JSON: {e}", param) from None


def _metadata(context) -> dict[str, list[str]]:
    metadata: dict[str, list[str]] = {}
    for name, value in context.invocation_metadata():
        metadata.setdefault(name, []).append(value)
    return metadata


def _observed(method):
    """Around a method, unary or streaming: its :class:`RequestRecord` (the id from
    ``x-request-id`` metadata or a new one, sent back in the initial metadata), a domain error
    (:mod:`engine.errors`) answered with its gRPC status, and the record finished with the code
    the call ended with."""
    route = f"/{SERVICE_NAME}/{method.__name__}"

    def begin(self, context) -> RequestRecord:
        record = self.telemetry.start(route, (_metadata(context).get("x-request-id") or [None])[-1])
        context.send_initial_metadata((("x-request-id", record.request_id),))
        return record

    def fail(self, context, record: RequestRecord, ex: BaseException):
        if isinstance(ex, (RequestError, EngineError)):
            code, message, trailer = grpc_error(ex)
            self.telemetry.finish(record, code, ex)
            context.set_trailing_metadata(trailer)
            context.abort(getattr(grpc.StatusCode, code), message)
        self.telemetry.finish(record, "CANCELLED" if isinstance(ex, GeneratorExit) else "UNKNOWN", ex)

    def succeed(self, context, record: RequestRecord):
        self.telemetry.finish(record, "OK" if context.is_active() else "CANCELLED")

    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def streaming(self, request, context):
            record = begin(self, context)
            try:
                yield from method(self, request, context, record)
            except BaseException as ex:  # GeneratorExit too: the call ended while streaming
                fail(self, context, record, ex)
                raise
            succeed(self, context, record)
        return streaming

    @functools.wraps(method)
    def unary(self, request, context):
        record = begin(self, context)
        try:
            response = method(self, request, context, record)
        except BaseException as ex:
            fail(self, context, record, ex)
            raise
        succeed(self, context, record)
        return response
    return unary


class InferenceService(inference_pb2_grpc.InferenceServiceServicer):
    """The four methods over one :class:`Generator`.

    Args:
        config: the server's settings (model names, message limit). generator: the shared
            request path. tenants: API keys (reloaded on SIGHUP by the sidecar).
        telemetry: request metrics and logs (None: as ``config`` says).
    """

    def __init__(self, config: ServerConfig, generator: Generator, tenants: TenantRegistry,
                 telemetry: Telemetry | None = None):
        self.config, self.generator, self.tenants = config, generator, tenants
        self.telemetry = telemetry or Telemetry(config.metrics, config.log_prompts)

    # -- methods ----------------------------------------------------------------------------------
    @_observed
    def Infer(self, request: pb.InferRequest, context, record: RequestRecord) -> pb.InferResponse:
        tenant_id, gen = self._infer(request, context, record)
        (choice,) = gen.collect()
        _check_deadline(gen, [choice.tokens])
        return pb.InferResponse(**infer_result(tenant_id, choice, gen, record.started))

    @_observed
    def InferStream(self, request: pb.InferRequest, context, record: RequestRecord):
        _, gen = self._infer(request, context, record)
        for d, usage in _with_usage(gen):
            yield pb.InferChunk(text=d.text, token_ids=[t.id for t in d.tokens], finish_reason=d.finish_reason or "",
                                usage=usage)

    @_observed
    def ChatComplete(self, request: pb.ChatRequest, context, record: RequestRecord) -> pb.ChatResponse:
        model, gen = self._chat(request, context, record)
        choices = gen.collect()
        _check_deadline(gen, [c.tokens for c in choices])
        return pb.ChatResponse(
            id=f"chatcmpl-{secrets.token_hex(12)}", model=model, usage=_usage(gen),
            choices=[pb.ChatChoice(index=i, text=c.text, token_ids=[t.id for t in c.tokens],
                                   finish_reason=c.finish_reason or "", logprobs=_logprobs(c.tokens),
                                   tool_calls=[pb.ToolCall(id=t.id, name=t.name, arguments=t.arguments)
                                               for t in c.tool_calls])
                     for i, c in enumerate(choices)])

    @_observed
    def ChatCompleteStream(self, request: pb.ChatRequest, context, record: RequestRecord):
        _, gen = self._chat(request, context, record)
        for d, usage in _with_usage(gen):
            yield pb.ChatChunk(index=d.index, text=d.text, token_ids=[t.id for t in d.tokens],
                               logprobs=_logprobs(d.tokens), finish_reason=d.finish_reason or "", usage=usage,
                               tool_calls=[pb.ToolCallDelta(index=c.index, id=c.id or "", name=c.name or "",
                                                            arguments=c.arguments) for c in d.tool_calls])

    # -- the shared steps ---------------------------------------------------------------------------
    def _tenant(self, context) -> Tenant:
        # A key sent twice is joined, as HTTP joins repeated headers: never one of them silently.
        metadata = _metadata(context)
        key = key_of(*(",".join(metadata[h]) if h in metadata else None for h in ("authorization", "x-tenant-id")))
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            raise Unauthenticated("missing API key: send metadata authorization: Bearer <key>" if key is None
                                  else "unknown API key")
        return tenant

    def _infer(self, request: pb.InferRequest, context, record: RequestRecord) -> tuple[str, Generation]:
        tenant = record.tenant = self._tenant(context)
        body = message_body(request)
        if not body.get("tenant_id"):
            body.pop("tenant_id", None)  # proto3: empty is unset
        tenant_id, greq, messages = parse_infer(body, tenant, self.tenants)
        greq.deadline_ms = _call_deadline_ms(context, greq.deadline_ms)
        gen = self.generator.chat(messages, greq, "payload", tenant=tenant)
        record.attach(gen, body["payload"])
        _cancel_with_call(gen, context)
        return tenant_id, gen

    def _chat(self, request: pb.ChatRequest, context, record: RequestRecord) -> tuple[str, Generation]:
        tenant = record.tenant = self._tenant(context)
        body = _tool_body(message_body(request))
        if not body.get("model"):
            body.pop("model", None)
        _schemas_from_text(body)
        model = check_model(body, self.config.model_ids)
        greq = parse_generation(body, chat=True)
        greq.deadline_ms = _call_deadline_ms(context, greq.deadline_ms)
        messages = parse_messages(body, self.config.max_messages)
        gen = self.generator.chat(messages, greq, render=render_options(body, messages), tenant=tenant)
        record.attach(gen, body.get("messages"))
        _cancel_with_call(gen, context)
        return model, gen


def _tool_body(body: dict) -> dict:
    """The tool fields of a ``ChatRequest``'s body in the HTTP body's shapes (OpenAI's):
    ``tools[].function`` with ``parameters`` parsed from JSON text, ``tool_choice`` a mode or
    ``{"type": "function", ...}``, messages' ``tool_calls[].function``.

    Raises:
        InvalidRequest: a tool's ``parameters`` that is not JSON text.
    """
    tools = body.get("tools")
    for i, tool in enumerate(tools or ()):
        function = {"name": tool["name"], "description": tool["description"]}
        if tool["parameters"]:
            try:
                function["parameters"] = json_text.loads(tool["parameters"])
            except ValueError:
                raise InvalidRequest("parameters must be a JSON Schema as JSON text",
                                     f"tools[{i}].function.parameters") from None
        if "strict" in tool:
            function["strict"] = tool["strict"]
        tools[i] = {"type": "function", "function": function}
    choice = body.pop("tool_choice", None)
    if choice is not None and "mode" in choice:
        body["tool_choice"] = choice["mode"]
    elif choice is not None and "function" in choice:
        body["tool_choice"] = {"type": "function", "function": {"name": choice["function"]}}
    for m in body.get("messages", ()):
        if "tool_calls" in m:
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
    return body


def _call_deadline_ms(context, deadline_ms: float | None) -> float | None:
    """The earlier of the request's ``deadline_ms`` and the call's gRPC deadline.

    Raises:
        DeadlineExceeded: the call's deadline has already passed.
    """
    remaining = context.time_remaining()
    if remaining is None or remaining * 1000 >= DEADLINE_MS_BOUNDS["hi"]:
        return deadline_ms
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before the request was queued")
    return min(deadline_ms or DEADLINE_MS_BOUNDS["hi"], remaining * 1000)


def _cancel_with_call(gen: Generation, context) -> None:
    """A call that ends early (cancelled, deadline, client gone) cancels the sequences; after a
    normal end the callback finds them finished and does nothing."""
    def cancel():
        for stream in gen.streams:
            stream.cancel()

    if not context.add_callback(cancel):
        cancel()  # the call had already ended


def _check_deadline(gen: Generation, token_lists) -> None:
    """A deadline that passed before any token is ``DEADLINE_EXCEEDED`` (with tokens, the
    answer is what was generated, ``finish_reason: deadline``, as over HTTP)."""
    if any(s.finish_reason == "deadline" for s in gen.streams) and not any(token_lists):
        raise DeadlineExceeded("deadline passed before the first token")


def _usage(gen: Generation) -> pb.Usage:
    u = gen.usage()
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    total_tokens=u.total_tokens, cached_tokens=u.cached_tokens)


def _with_usage(gen: Generation):
    """``(delta, usage or None)`` for every delta, as soon as it comes, but for a choice's
    finishing delta: that one waits for the next delta, so the stream's last delta (always a
    finishing one) can carry the usage, known once every choice finished. Raises
    DeadlineExceeded when the deadline passed before any token."""
    held: Delta | None = None
    produced = False
    for d in gen.deltas():
        if d is None:
            continue
        produced = produced or bool(d.tokens)
        if held is not None:
            yield held, None
            held = None
        if d.finish_reason:
            held = d
        else:
            yield d, None
    _check_deadline(gen, [produced])
    if held is not None:
        yield held, _usage(gen)


def _logprobs(tokens) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=t.id, logprob=t.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in t.top])
            for t in tokens if t.logprob is not None]
