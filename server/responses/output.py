"""A chat generation's deltas re-shaped into the Responses API's output (OpenAI API reference,
Responses: the response object, its output items, and the streaming events).

:class:`ResponseBuilder` is fed the :class:`server.generation.request.Delta` s of one choice and
returns the events each one causes; a non-streamed answer feeds the same deltas and keeps only
:meth:`ResponseBuilder.response`, so the streamed and the whole answer are one rule. Events, in
OpenAI's order: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``,
for a function call ``response.function_call_arguments.delta`` ..., ``.done``; then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` ended it). Every event carries ``sequence_number`` from 0. An engine
failure mid-way is an ``error`` event and ``response.failed`` (:data:`FAILURE_CODES`).
"""
from __future__ import annotations

import time

from server.generation.request import Delta, Usage
from server.responses.request import new_id

#: ``response.failed``'s ``error.code`` (OpenAI's ``ResponseErrorCode`` has no code per field): a
#: client's mistake found once the stream had begun (a tool's schema that allows no call, found
#: at the first token it refuses) is the request's, an exhausted quota is the rate limit's, and
#: anything else the server's.
FAILURE_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def usage_object(u: Usage) -> dict:
    """OpenAI's ``ResponseUsage``."""
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                                                      "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def echo_tools(tools: list[dict]) -> list[dict]:
    """The request's function tools as a response lists them (``FunctionTool``)."""
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters") or {"type": "object", "properties": {}},
             "strict": t.get("strict")} for t in tools]


class ResponseBuilder:
    """The response object of one request, built from its deltas (see the module).

    Args:
        response_id: ``resp_...``. model: the name echoed. echo: the request's fields a
            response repeats (``instructions``, ``tools``, ``tool_choice``, ``text``,
            ``temperature``, ``top_p``, ``max_output_tokens``, ``parallel_tool_calls``,
            ``metadata``, ``user``, ``store``, ``previous_response_id``).
    """

    def __init__(self, response_id: str, model: str, echo: dict):
        self.id, self.model, self.echo = response_id, model, echo
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.status, self.error, self.incomplete, self.usage = "in_progress", None, None, None
        self.completed_at = None
        self._seq = 0
        self._open: dict | None = None  # the item receiving deltas
        self._calls: dict[int, dict] = {}  # the choice's call index -> its function_call item

    # -- the response object ------------------------------------------------------------------
    def response(self) -> dict:
        e = self.echo
        text = e.get("text") or {}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "completed_at": self.completed_at, "error": self.error, "incomplete_details": self.incomplete,
            "instructions": e.get("instructions"), "max_output_tokens": e.get("max_output_tokens"),
            "model": self.model, "output": [dict(i) for i in self.output],
            "parallel_tool_calls": e.get("parallel_tool_calls", True),
            "previous_response_id": e.get("previous_response_id"),
            "reasoning": None, "store": e.get("store", True),
            "temperature": e.get("temperature", 1.0), "top_p": e.get("top_p", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": e.get("tool_choice", "auto"), "tools": echo_tools(e.get("tools") or []),
            "truncation": "disabled",
            "metadata": e.get("metadata") or {}, "background": False, "service_tier": "default", "top_logprobs": 0,
            **({"user": e["user"]} if e.get("user") is not None else {}),
            **({"usage": usage_object(self.usage)} if self.usage is not None else {}),  # not nullable
        }

    def output_text(self) -> str:
        return "".join(c["text"] for i in self.output if i["type"] == "message" for c in i["content"])

    # -- events ---------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, d: Delta) -> list[dict]:
        """The events of one delta (choice 0's)."""
        events = []
        if d.text:
            if self._open is None or self._open["type"] != "message":
                events += self._close() + self._open_message()
            self._open["content"][0]["text"] += d.text
            events.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                      output_index=len(self.output) - 1, content_index=0, delta=d.text, logprobs=[]))
        for c in d.tool_calls:
            if c.id is not None:  # a new call
                events += self._close()
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": c.id,
                        "name": c.name, "arguments": ""}
                self._calls[c.index] = item
                events += self._open_item(item)
            item = self._calls[c.index]
            if c.arguments:
                item["arguments"] += c.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.output.index(item), delta=c.arguments))
        return events

    def finish(self, finish_reason: str | None, usage: Usage) -> list[dict]:
        """Close the open item; ``response.completed``, or ``response.incomplete`` when the
        token limit ended it (``incomplete_details.reason: max_output_tokens``)."""
        incomplete = finish_reason == "length"
        events = [] if self.output else self._open_message()  # an empty answer is an empty message
        events += self._close("incomplete" if incomplete else "completed")
        self.usage = usage
        if incomplete:
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status, self.completed_at = "completed", int(time.time())
        events.append(self._event("response.incomplete" if incomplete else "response.completed",
                                  response=self.response()))
        return events

    def fail(self, status: int, message: str, code: str | None, param: str | None) -> list[dict]:
        """An ``error`` event (OpenAI's ``ResponseErrorEvent``, with the error's own ``code``),
        then ``response.failed``, whose ``error.code`` is one of ``ResponseErrorCode``'s: the
        HTTP ``status`` the error would have had before the headers went out decides it."""
        self.status, self.error = "failed", {"code": FAILURE_CODES.get(status, "server_error"), "message": message}
        return [self._event("error", code=code, message=message, param=param),
                self._event("response.failed", response=self.response())]

    def _open_message(self) -> list[dict]:
        events = self._open_item({"id": new_id("msg"), "type": "message", "role": "assistant",
                                  "status": "in_progress", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open["content"].append(part)
        return events + [self._event("response.content_part.added", item_id=self._open["id"],
                                     output_index=len(self.output) - 1, content_index=0, part=dict(part))]

    def _open_item(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    def chat_messages(self) -> list[dict]:
        """This response's output as the chat messages a continuation re-sends: one assistant
        message, with its text and its complete calls. A call that ``max_output_tokens`` cut
        (``status: incomplete``) is left out: its arguments are no JSON object, so re-sent it
        made every continuation of this response a 400, and no tool can have run it."""
        text = self.output_text()
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call" and i["status"] == "completed"]
        message = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return [message]


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(c) for c in out["content"]]
    return out
