"""``inference.v1.InferenceService`` (``proto/inference.proto``): the gRPC front end.

A request message becomes the typed request the HTTP routes parse (``server/grpc/convert.py``,
with their checks and field paths) and runs through the same :class:`Generator` (tokenizer,
chat template, engine client, detokenizer with stop strings, rate limits) and the same error
mapping (``server.errors.grpc_error``), so the two front ends accept and refuse the same
requests.

Metadata: ``authorization: Bearer <key>`` or ``x-tenant-id: <key>`` names the tenant. The call's
gRPC deadline becomes the request's deadline in the engine, and a cancelled call (or a client
that went away) cancels its sequences, queued or running.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import secrets

import grpc

from engine.errors import DeadlineExceeded, EngineError, RequestError
from engine.request import DEADLINE_MS_BOUNDS
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from server.api.errors import Unauthenticated
from server.api.infer import infer_result
from server.config import ServerConfig
from server.errors import grpc_error
from server.generation.generation import Generation
from server.generation.request import Delta
from server.model_router import CHAT, EMBEDDINGS, GENERATION, ModelRouter
from server.grpc.convert import chat_request, embed_request, infer_request, model_field
from server.observability.telemetry import RequestRecord, Telemetry
from server.tenancy.tenants import Tenant, TenantRegistry, key_of

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


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
    """The five methods over the served models (``model`` picks one, as over HTTP).

    Args:
        config: the server's settings (message limit). models: every model's request path
            (``ModelRouter``). tenants: API keys (reloaded on SIGHUP by the sidecar).
        telemetry: request metrics and logs (None: as ``config`` says).
    """

    def __init__(self, config: ServerConfig, models: ModelRouter, tenants: TenantRegistry,
                 telemetry: Telemetry | None = None):
        self.config, self.models, self.tenants = config, models, tenants
        self.telemetry = telemetry or Telemetry(config.metrics, config.log_prompts)

    # -- methods ----------------------------------------------------------------------------------
    @_observed
    def Infer(self, request: pb.InferRequest, context, record: RequestRecord) -> pb.InferResponse:
        tenant_id, gen = self._infer(request, context, record)
        (choice,) = gen.collect()
        _check_deadline(gen)
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
        _check_deadline(gen)
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

    @_observed
    def Embed(self, request: pb.EmbedRequest, context, record: RequestRecord) -> pb.EmbedResponse:
        tenant = record.tenant = self._tenant(context)
        model, served, tenant = self.models.pick(model_field(request), tenant, EMBEDDINGS)
        ereq = embed_request(request)
        run = served.embedder.start(ereq, tenant, deadline_ms=_call_deadline_ms(context, None))
        record.attach(run, list(request.input) or [list(t.ids) for t in request.input_ids])
        if not context.add_callback(run.cancel):  # a call that ends early cancels its inputs
            run.cancel()
        result = run.result()
        return pb.EmbedResponse(model=model, data=[pb.Embedding(index=i, embedding=v)
                                                   for i, v in enumerate(result.vectors.tolist())],
                                usage=pb.Usage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens))

    # -- the shared steps ---------------------------------------------------------------------------
    def _tenant(self, context) -> Tenant:
        # A key sent twice is joined, as HTTP joins repeated headers: never one of them silently.
        metadata = _metadata(context)
        key = key_of(*(",".join(metadata[h]) if h in metadata else None for h in ("authorization", "x-tenant-id")))
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            raise Unauthenticated.of(key, "metadata authorization")
        return tenant

    def _infer(self, request: pb.InferRequest, context, record: RequestRecord) -> tuple[str, Generation]:
        tenant = record.tenant = self._tenant(context)
        _, served, tenant = self.models.pick(model_field(request), tenant, GENERATION)
        tenant_id, greq, payload = infer_request(request, tenant, self.tenants)
        greq = dataclasses.replace(greq, deadline_ms=_call_deadline_ms(context, greq.deadline_ms))
        gen = served.generator.infer(payload, greq, tenant=tenant)
        record.attach(gen, request.payload)
        _cancel_with_call(gen, context)
        return tenant_id, gen

    def _chat(self, request: pb.ChatRequest, context, record: RequestRecord) -> tuple[str, Generation]:
        tenant = record.tenant = self._tenant(context)
        model, served, tenant = self.models.pick(model_field(request), tenant, CHAT)
        served.generator.chat_template("messages")  # a model without one: that, before any field
        greq, messages, render = chat_request(request, self.config.max_messages)
        greq = dataclasses.replace(greq, deadline_ms=_call_deadline_ms(context, greq.deadline_ms))
        gen = served.generator.chat(messages, greq, render=render, tenant=tenant)
        record.attach(gen, messages)
        _cancel_with_call(gen, context)
        return model, gen


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


def _check_deadline(gen: Generation) -> None:
    """A deadline that passed before any choice's first token is ``DEADLINE_EXCEEDED`` (with
    tokens, the answer is what was generated, ``finish_reason: deadline``, as over HTTP)."""
    if any(s.missed_deadline for s in gen.streams) and not any(s.n_generated for s in gen.streams):
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
    for d in gen.deltas():
        if d is None:
            continue
        if held is not None:
            yield held, None
            held = None
        if d.finish_reason:
            held = d
        else:
            yield d, None
    _check_deadline(gen)
    if held is not None:
        yield held, _usage(gen)


def _logprobs(tokens) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=t.id, logprob=t.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in t.top])
            for t in tokens if t.logprob is not None]
