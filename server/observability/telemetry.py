"""What every finished request leaves behind: its metrics (``server/observability/metrics.py``) and one JSON
log line, from one :class:`RequestRecord` filled along the request path, whatever the protocol.

The log line (logger ``inference.requests``, on stdout) holds ``request_id``, ``tenant``,
``route``, ``status``, ``finish_reason``, ``prompt_tokens``, ``cached_tokens``,
``completion_tokens``, ``tool_calls`` (the tool calls of every choice: a count; their arguments
are never logged), ``queue_wait_s``, ``time_to_first_token_s``, ``latency_s`` and, with
``--log-prompts`` only, ``prompt``. It never holds an API key.

Label values stay bounded: ``tenant`` is a tenant of the tenant file or ``default`` (the keyless
tenant, and requests refused before a key named a tenant); ``route`` one of the routes served;
``status`` an HTTP status or gRPC code name; ``finish_reason`` choice 0's (``stop``, ``length``,
``deadline``) or how the request ended otherwise (``cancelled``: the client left; ``error``).
"""
from __future__ import annotations

import logging
import re
import sys
import time
import uuid
from dataclasses import dataclass, field

import ujson

from engine.errors import ClientDisconnected, DeadlineExceeded, RateLimited
from server.generation.embedding import EmbeddingRun
from server.generation.generation import Generation, GenerationStats
from server.generation.request import Usage
from server.tenancy.tenants import DEFAULT_TENANT, Tenant

log = logging.getLogger("inference.requests")
#: A client's ``X-Request-ID`` is kept when it is this short and printable; otherwise a new id
#: is made (a header must not inject anything into logs or responses).
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def request_id(given: str | None) -> str:
    """The client's request id if it is 1-128 printable ASCII characters, else a new UUID4 hex."""
    return given if given is not None and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


@dataclass
class RequestRecord:
    """One request as it goes: filled by the front end, closed once by :meth:`Telemetry.finish`.

    Attributes:
        request_id: echoed as ``X-Request-ID`` (gRPC: ``x-request-id`` metadata).
        route: the route or gRPC method. started: ``time.monotonic()`` at arrival.
        tenant: who asked (set once authenticated). generation: its sequences, once submitted
            (a ``Generation``, or an embedding request's ``EmbeddingRun``: anything whose
            ``stats()`` is a ``GenerationStats``).
        prompt: the prompt as the client sent it (logged only with ``--log-prompts``).
    """

    request_id: str
    route: str
    started: float = field(default_factory=time.monotonic)
    tenant: Tenant = DEFAULT_TENANT
    generation: Generation | EmbeddingRun | None = None
    prompt: object = None
    finished: bool = False

    def attach(self, generation: Generation | EmbeddingRun, prompt: object) -> None:
        self.generation, self.prompt = generation, prompt


def finish_reason(stats: GenerationStats | None, error: BaseException | None) -> str:
    """Choice 0's finish reason, or how the request ended without one (see the module)."""
    if isinstance(error, (ClientDisconnected, GeneratorExit)):
        return "cancelled"
    if isinstance(error, DeadlineExceeded):
        return "deadline"
    if error is not None or stats is None or stats.finish_reasons[0] is None:
        return "error"
    return stats.finish_reasons[0]


LIMIT_KINDS = ("requests", "tokens", "requests_per_day", "concurrency", "quota")


def limit_kind(error: RateLimited) -> str:
    """``requests``, ``tokens``, ``requests_per_day`` (the empty bucket; requests first),
    ``concurrency`` or ``quota`` (the spend limit or monthly token quota)."""
    if error.kind in ("concurrency", "quota"):
        return error.kind
    return next((k for k, (_, remaining, _) in error.buckets.items() if remaining < 1), "requests")


class Telemetry:
    """Starts and finishes :class:`RequestRecord`s.

    Args:
        metrics: record Prometheus metrics (``--no-metrics``: only the log line).
        log_prompts: put the prompt into the log line (``--log-prompts``).
    """

    def __init__(self, metrics: bool = True, log_prompts: bool = False):
        self.metrics = None
        if metrics:
            from server.observability import metrics as m  # imported only then: its mode is fixed at import
            self.metrics = m
            # Exported from the start (at 0), so dashboards and alerts see them before any event.
            m.DEADLINE_EXCEEDED.labels(DEFAULT_TENANT.id)
            for kind in LIMIT_KINDS:
                m.RATE_LIMITED.labels(DEFAULT_TENANT.id, kind)
        self.log_prompts = log_prompts
        _setup_log()

    def start(self, route: str, given_id: str | None = None) -> RequestRecord:
        return RequestRecord(request_id(given_id), route)

    def finish(self, record: RequestRecord, status: int | str, error: BaseException | None = None) -> None:
        """Record the request's metrics and write its log line (once; later calls do nothing).
        ``status``: the HTTP status or gRPC code name it ended with; ``error``: what ended it,
        if not its own end. Never raises: a failure here must not touch the answer."""
        if record.finished:
            return
        record.finished = True
        try:
            self._finish(record, str(status), error)
        except Exception:  # noqa: BLE001
            logging.getLogger("server").exception("request %s: telemetry failed", record.request_id)

    def _finish(self, record: RequestRecord, status: str, error: BaseException | None) -> None:
        now = time.monotonic()
        stats = record.generation.stats() if record.generation is not None else None
        reason = finish_reason(stats, error)
        usage = stats.usage if stats is not None else Usage()
        timings = stats.timings if stats is not None else None
        queue_wait = timings.admitted - timings.queued if timings is not None and timings.admitted else None
        ttft = stats.first_token_at - record.started if stats is not None and stats.first_token_at else None
        latency = now - record.started
        deadline = reason == "deadline" or (stats is not None and "deadline" in stats.finish_reasons)
        if self.metrics is not None:
            self._observe(record, status, reason, error, stats, queue_wait, ttft, latency, deadline)
        line = {"request_id": record.request_id, "tenant": record.tenant.id, "route": record.route,
                "status": status, "finish_reason": reason, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens, "completion_tokens": usage.completion_tokens,
                "tool_calls": sum(stats.tool_calls) if stats is not None else 0, "queue_wait_s": _round(queue_wait),
                "time_to_first_token_s": _round(ttft), "latency_s": _round(latency)}
        if self.log_prompts:
            line["prompt"] = record.prompt
        log.info(ujson.dumps(line, ensure_ascii=False, escape_forward_slashes=False))

    def _observe(self, record, status, reason, error, stats: GenerationStats | None, queue_wait, ttft, latency,
                 deadline) -> None:
        m, tenant = self.metrics, record.tenant.id
        usage = stats.usage if stats is not None else Usage()
        m.REQUESTS.labels(tenant, record.route, status, reason).inc()
        m.LATENCY.labels(record.route, reason).observe(latency)
        if queue_wait is not None:
            m.QUEUE_WAIT.observe(max(0.0, queue_wait))
        if ttft is not None:
            m.TIME_TO_FIRST_TOKEN.observe(ttft)
        for gap in stats.token_gaps if stats is not None else ():
            m.INTER_TOKEN_LATENCY.observe(gap)
        if usage.prompt_tokens:
            m.PROMPT_TOKENS.labels(tenant).inc(usage.prompt_tokens)
        if usage.cached_tokens:
            m.CACHED_PROMPT_TOKENS.labels(tenant).inc(usage.cached_tokens)
        if usage.completion_tokens:
            m.GENERATED_TOKENS.labels(tenant).inc(usage.completion_tokens)
        if deadline:
            m.DEADLINE_EXCEEDED.labels(tenant).inc()
        if isinstance(error, RateLimited):
            m.RATE_LIMITED.labels(tenant, limit_kind(error)).inc()


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


def _setup_log() -> None:
    """The request log goes to stdout, one JSON object per line and nothing else (the server's
    own log, on stderr, keeps its format)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
