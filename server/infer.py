"""``POST /infer``: the original endpoint.

Request: ``{"tenant_id", "payload", "priority": "high|normal|low", "deadline_ms",
"max_new_tokens"}``; ``payload`` is the user's message, rendered with the chat template.
Response: ``{"tenant_id", "text", "tokens", "finish_reason": "stop|length|deadline",
"queue_wait_ms", "latency_ms"}``.
"""
from __future__ import annotations

import time

import falcon

from server.completions import dumps
from server.errors import bad_request
from server.generation import Generation
from server.params import GenerationRequest, number, parse_priority, read_json


class Infer:
    def __init__(self, config, engine, tokenizer, template):
        self.config, self.engine, self.tokenizer, self.template = config, engine, tokenizer, template

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        started = time.monotonic()
        body = read_json(req, self.config.max_body_bytes)
        tenant_id = body.get("tenant_id", "default")
        if not isinstance(tenant_id, str):
            raise bad_request("tenant_id must be a string", "tenant_id")
        payload = body.get("payload")
        if not isinstance(payload, str):
            raise bad_request("payload must be a string", "payload")
        greq = GenerationRequest(max_tokens=number(body, "max_new_tokens", 1, 2**31 - 1, integer=True),
                                 max_tokens_param="max_new_tokens", sampling={"temperature": 0.0},
                                 deadline_ms=number(body, "deadline_ms", 0, 1e9, lo_open=True))
        greq.priority = parse_priority(body)
        gen = Generation(self.engine, self.tokenizer.pieces,
                         self.template.encode([{"role": "user", "content": payload}]), greq, "payload",
                         watch_socket=req.env.get("gunicorn.socket"))
        (choice,) = gen.collect()
        timings = gen.streams[0].timings()
        admitted = timings.admitted or timings.finished
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps({
            "tenant_id": tenant_id, "text": choice.text, "tokens": gen.usage()["completion_tokens"],
            "finish_reason": choice.finish_reason,
            "queue_wait_ms": round(max(0.0, admitted - timings.queued) * 1000, 3),
            "latency_ms": round((time.monotonic() - started) * 1000, 3)})
