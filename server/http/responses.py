"""``/v1/responses`` (OpenAI API reference, Responses): ``POST`` creates a response, as JSON or
as server-sent events (``event: <type>`` and ``data: <event>``, no ``[DONE]``); ``GET`` and
``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read the store.

A request is parsed into the typed request the chat path runs (``server/responses/request.py``),
which runs it (``Generator.chat``); its deltas are re-shaped by
``server/responses/output.py``; ``store: true`` keeps it in ``server/responses/store.py``'s
store, scoped to the tenant. The ``x-response-stored`` header says whether it was stored
(``false`` with ``store: false`` or while the store is unavailable; for a stream, whether the
store was available when it started).
"""
from __future__ import annotations

import logging
from typing import Iterator

import falcon

from engine.errors import ClientDisconnected, InvalidRequest
from server.config import ServerConfig
from server.errors import http_error
from server.generation.generation import Generation
from server.model_router import CHAT, ModelRouter
from server.http.body import read_json
from server.http.json import dumps, obfuscated, sse_headers
from server.responses.output import ResponseBuilder
from server.responses.request import RENDER, ResponsesRequest, new_id, parse
from server.responses.store import StoreUnavailable, previous

log = logging.getLogger("responses")
STORED_HEADER = "x-response-stored"


def event(e: dict, obfuscate: bool = False) -> bytes:
    """One server-sent event as OpenAI sends Responses events: its type, then its JSON; a delta
    event padded by :func:`server.http.json.obfuscated` when ``obfuscate``."""
    text = dumps(e)
    if obfuscate and e["type"].endswith(".delta"):
        text = obfuscated(text)
    return f"event: {e['type']}\ndata: {text}\n\n".encode("utf-8")


class Responses:
    """``POST /v1/responses``. ``store``: a :class:`server.responses.store.LocalStore` or
    ``RedisStore``."""

    observed = True  # telemetry and admission (server/http/middleware.py)

    def __init__(self, config: ServerConfig, models: ModelRouter, store):
        self.config, self.models, self.store = config, models, store

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        tenant = req.context.tenant
        model, served, tenant = self.models.pick(body, tenant, CHAT)
        served.generator.chat_template("input")  # a model without one: that, before any field
        rr = parse(body, lambda rid: previous(self.store, tenant.id, rid), self.config.max_messages)
        gen = served.generator.chat(rr.messages, rr.generation, prompt_param="input", render=dict(RENDER), tenant=tenant,
                                  watch_socket=req.env.get("gunicorn.socket"))
        req.context.record.attach(gen, body.get("input"))
        builder = ResponseBuilder(new_id("resp"), model, self._echo(body, rr))
        will_store = rr.store and self.store.available
        if rr.stream:
            sse_headers(resp)
            resp.set_header(STORED_HEADER, "true" if will_store else "false")
            resp.stream = self.sse_events(gen, builder, rr, tenant.id if will_store else None)
            return
        finish = None
        for d in gen.deltas():
            builder.feed(d)
            finish = d.finish_reason or finish
        builder.finish(finish, gen.usage())
        stored = rr.store and self._store(tenant.id, builder, rr)
        resp.set_header(STORED_HEADER, "true" if stored else "false")
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps(builder.response())

    def sse_events(self, gen: Generation, builder: ResponseBuilder, rr: ResponsesRequest,
                   store_for: str | None) -> Iterator[bytes]:
        """The event stream; keep-alive comments while nothing is due, as chat's streams. The
        response is stored for tenant ``store_for`` (None: not, as its header said)."""
        yield b""
        try:
            for e in builder.start():
                yield event(e)
            finish = None
            for d in gen.deltas(keepalive_s=self.config.sse_keepalive_s or None):
                if d is None:
                    yield b": keep-alive\n\n"
                    continue
                finish = d.finish_reason or finish
                for e in builder.feed(d):
                    yield event(e, rr.generation.obfuscate)
            events = builder.finish(finish, gen.usage())
            if store_for is not None:
                self._store(store_for, builder, rr)  # before the last event: a client may continue at once
            for e in events:
                yield event(e)
        except ClientDisconnected:
            return
        except Exception as ex:  # noqa: BLE001 - headers are sent: the error becomes events
            status, body, _ = http_error(ex)
            err = body["error"]
            for e in builder.fail(status, err["message"], err["code"], err["param"]):
                yield event(e)
        finally:
            gen.close()

    def _store(self, tenant: str, builder: ResponseBuilder, rr: ResponsesRequest) -> bool:
        """Keep the response; False (logged) when the store is unavailable."""
        doc = {"response": builder.response(), "input_items": rr.input_items,
               "conversation": rr.conversation + builder.chat_messages()}
        try:
            self.store.put(tenant, builder.id, doc)
            return True
        except StoreUnavailable:
            log.warning("response %s not stored: the store is unavailable", builder.id)
            return False

    @staticmethod
    def _echo(body: dict, rr: ResponsesRequest) -> dict:
        echo = dict(rr.echo)
        for name in ("temperature", "top_p", "max_output_tokens", "parallel_tool_calls", "metadata", "user"):
            if body.get(name) is not None:
                echo[name] = body[name]
        echo["store"], echo["previous_response_id"] = rr.store, rr.previous_response_id
        return echo


class StoredResponse:
    """``GET`` and ``DELETE /v1/responses/{response_id}``: the tenant's stored response."""

    def __init__(self, store):
        self.store = store

    def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        _no_query(req, ())
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps(self.store.get(req.context.tenant.id, response_id)["response"])

    on_head = on_get  # every GET answers HEAD (HTTP requires it)

    def on_delete(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        self.store.delete(req.context.tenant.id, response_id)
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps({"id": response_id, "object": "response", "deleted": True})


class InputItems:
    """``GET /v1/responses/{response_id}/input_items``: a ``ResponseItemList`` of the items the
    request gave (``limit`` 1..100, default 20; ``order`` ``desc`` (default) or ``asc``;
    ``after`` an item id), each with its id."""

    def __init__(self, store):
        self.store = store

    def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        _no_query(req, ("limit", "order", "after"))
        limit = req.get_param("limit") or "20"
        if not (limit.isascii() and limit.isdecimal() and 1 <= int(limit) <= 100):  # not "٣"
            raise InvalidRequest("limit must be an integer from 1 to 100", "limit")
        order = req.get_param("order") or "desc"
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be asc or desc", "order")
        items = self.store.get(req.context.tenant.id, response_id)["input_items"]
        if order == "desc":
            items = items[::-1]
        after = req.get_param("after")
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise InvalidRequest(f"after {after!r} is no item of this response", "after")
            items = items[ids.index(after) + 1:]
        page = items[:int(limit)]
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps({"object": "list", "data": page, "has_more": len(items) > len(page),
                           "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None})

    on_head = on_get


def _no_query(req: falcon.Request, allowed: tuple[str, ...]) -> None:
    """A query parameter this route does not implement (``stream``, ``include``...) is a 400."""
    unknown = sorted(set(req.params) - set(allowed))
    if unknown:
        raise InvalidRequest(f"query parameter {unknown[0]} is not supported", unknown[0])
