"""``/infer``, the original endpoint, protocol-neutral: the body's parser and the response.

Request: ``{"tenant_id", "payload", "priority": "high|normal|low", "deadline_ms",
"max_new_tokens", "model"}`` (``model``: which served model, the default one without it);
``payload`` is the user's message, rendered with the chat template (for a
model without one, a plain prompt the model continues: ``Generator.infer``), decoded greedily.
Response: ``{"tenant_id", "text", "tokens", "cached_tokens", "finish_reason":
"stop|length|deadline", "queue_wait_ms", "latency_ms"}``. The HTTP route (``server/http/infer.py``)
and the gRPC ``Infer`` method share :func:`parse_infer` and :func:`infer_result`.
"""
from __future__ import annotations

import time

from engine.errors import InvalidRequest
from engine.request import DEADLINE_MS_BOUNDS, SamplingParams
from server.api.errors import PermissionDenied
from server.api.fields import FieldPolicy, number, priority
from server.generation.generation import Generation
from server.generation.request import Choice, GenerationRequest
from server.tenancy.tenants import Tenant, TenantRegistry

INFER_FIELDS = frozenset({"tenant_id", "payload", "priority", "deadline_ms", "max_new_tokens", "model"})
INFER = FieldPolicy(INFER_FIELDS)
#: At least 1: only a scoring request may generate nothing, and /infer does not score.
MAX_NEW_TOKENS_BOUNDS = {**SamplingParams.bounds("max_new_tokens"), "lo": 1}


def parse_infer(body: dict, tenant: Tenant, tenants: TenantRegistry) -> tuple[str, GenerationRequest, str]:
    """An ``/infer`` body (HTTP or gRPC) -> ``(tenant_id, request, payload)``.

    With a tenant file, ``tenant_id`` (if given) must name the key's tenant: a body can never
    spend another tenant's quota. Without one, it is echoed.

    Raises:
        InvalidRequest: an unknown or mistyped field. PermissionDenied: another tenant's id.
    """
    INFER.check(body)
    tenant_id = body.get("tenant_id", tenant.id)
    if not isinstance(tenant_id, str):
        raise InvalidRequest("tenant_id must be a string", "tenant_id")
    if not tenants.open and tenant_id != tenant.id:
        raise PermissionDenied("tenant_id names another tenant than the API key's", "tenant_id")
    payload = body.get("payload")
    if not isinstance(payload, str):
        raise InvalidRequest("payload must be a string", "payload")
    max_new_tokens = number(body, "max_new_tokens", **MAX_NEW_TOKENS_BOUNDS)
    greq = GenerationRequest(
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
        max_tokens_param="max_new_tokens", priority=priority(body.get("priority")),
        deadline_ms=number(body, "deadline_ms", **DEADLINE_MS_BOUNDS))
    return tenant_id, greq, payload


def infer_result(tenant_id: str, choice: Choice, gen: Generation, started: float) -> dict:
    """The ``/infer`` response of a finished generation; ``started``: ``time.monotonic()`` at
    the request's arrival."""
    timings = gen.timings()
    admitted = timings.admitted or timings.finished
    usage = gen.usage()
    return {"tenant_id": tenant_id, "text": choice.text, "tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens, "finish_reason": choice.finish_reason,
            "queue_wait_ms": round(max(0.0, admitted - timings.queued) * 1000, 3),
            "latency_ms": round((time.monotonic() - started) * 1000, 3)}
