"""The tests' one HTTP client: a request to a real server over a socket, or to the in-process app
(:class:`tests.support.servers.AppServer`) through ``falcon.testing``, answered as a
:class:`Reply`; and the checks every test makes of an answer (an OpenAI error object, an SSE
stream's framing, a stream's text against the same request not streamed).

A support module, not a test module."""
from __future__ import annotations

import contextlib
import http.client
import json
import urllib.parse
from typing import Iterator, NamedTuple

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MODEL = "local-model"  # the name the servers the tests start serve their model under


class Reply(NamedTuple):
    """One HTTP response: ``status``, ``headers`` (lower-case names), raw ``body`` bytes. It
    unpacks as ``status, headers, body``."""

    status: int
    headers: dict
    body: bytes

    def json(self):
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        return json.loads(self.body.decode("utf-8"))

    def parsed(self) -> tuple[int, dict, object]:
        """``(status, headers, the JSON body)``, for a test that unpacks the three."""
        return self.status, self.headers, self.json()

    def events(self, comments: bool = False) -> list:
        """The SSE stream as its ``data:`` payloads, parsed; ``"[DONE]"`` stays a string;
        ``comments`` as :func:`parse_sse`'s."""
        assert self.headers.get("content-type", "").startswith("text/event-stream"), self.headers
        return parse_sse(self.body, comments)


#: What reading a stream raises when the server (or a proxy before it) cut it: see
#: :func:`open_stream`.
STREAM_CUT = (http.client.IncompleteRead, ConnectionError)


def _prepared(body, headers: dict | None, key: str | None, key_header: str) -> tuple[bytes | None, dict]:
    """``body`` as bytes and the headers to send: a non-bytes body as JSON (with ``Content-Type:
    application/json`` unless ``headers`` name one); ``key`` in ``key_header``."""
    headers = dict(headers or {})
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode("utf-8")
        if not any(name.lower() == "content-type" for name in headers):
            headers["Content-Type"] = "application/json"
    if key is not None:
        headers[key_header] = f"Bearer {key}" if key_header.lower() == "authorization" else key
    return body, headers


def _connection(target, timeout: float) -> http.client.HTTPConnection:
    u = urllib.parse.urlsplit(target if isinstance(target, str) else target.url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def request(target, method: str, path: str, body=None, headers: dict | None = None, *, key: str | None = None,
            key_header: str = "Authorization", timeout: float = 120.0) -> Reply:
    """One request to ``target``: the in-process app (an object with ``client``, as ``AppServer``),
    a real server (an object with ``url``, as ``RunningServer`` or ``Nginx``) or a base URL
    (``http://host:port``, any host: a replica on 127.0.0.2 is ``replica.url`` or
    ``f"http://127.0.0.2:{port}"``). ``body``: bytes as they are, None for none, anything else as
    JSON (with ``Content-Type: application/json`` unless ``headers`` name one); ``key``: sent as
    ``Authorization: Bearer <key>``, or, with ``key_header`` another header (``X-Tenant-ID``), as
    that header's whole value. ``timeout`` in seconds, per socket operation (a real server that
    has not answered within it raises :class:`TimeoutError`)."""
    body, headers = _prepared(body, headers, key, key_header)
    if hasattr(target, "client"):
        return Reply(*target.request(method, path, body, headers))
    conn = _connection(target, timeout)
    try:
        conn.request(method, path, body, headers)
        r = conn.getresponse()
        data = r.read()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
    finally:
        conn.close()


def post(target, path: str, body, content_type: str | None = "application/json", *, headers: dict | None = None,
         key: str | None = None, key_header: str = "Authorization", timeout: float = 120.0) -> Reply:
    """POST ``body`` (a dict/list/... is sent as JSON; bytes as they are) with ``content_type``
    (None: no Content-Type header) and ``headers``; ``target``, ``key``, ``key_header`` and
    ``timeout`` as :func:`request`'s."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
    return request(target, "POST", path, data, {**({"Content-Type": content_type} if content_type else {}),
                                                **(headers or {})}, key=key, key_header=key_header, timeout=timeout)


def get(target, path: str, *, headers: dict | None = None, key: str | None = None, key_header: str = "Authorization",
        timeout: float = 30.0) -> Reply:
    """GET ``path``; as :func:`request`. An error status is a :class:`Reply` like any other."""
    return request(target, "GET", path, None, headers, key=key, key_header=key_header, timeout=timeout)


@contextlib.contextmanager
def open_stream(target, path: str, body, *, headers: dict | None = None, key: str | None = None,
                key_header: str = "Authorization", timeout: float = 120.0
                ) -> Iterator[http.client.HTTPResponse]:
    """POST ``body`` to a real server (``target`` as :func:`request`'s, not the in-process app)
    and yield the response as soon as its head came, its body unread: for a test that reads a
    stream while it comes (``readline()``, or iterating its lines, ``b"\\n"`` kept), holds it open
    while it does something else, or times its lines. ``status`` and ``getheader()`` as
    ``http.client``'s. Reading a stream that was cut raises one of :data:`STREAM_CUT`. The
    connection is closed on leaving. ``body``, ``headers``, ``key``, ``key_header`` and
    ``timeout`` as :func:`request`'s."""
    body, headers = _prepared(body, headers, key, key_header)
    conn = _connection(target, timeout)
    try:
        conn.request("POST", path, body, headers)
        yield conn.getresponse()
    finally:
        conn.close()


def chat_body(content: str = "hi", **fields) -> dict:
    """A chat request of one user message ``content``, with ``fields``."""
    return {"messages": [{"role": "user", "content": content}], **fields}


def parse_sse(raw: bytes, comments: bool = False) -> list:
    """``data:`` payloads of an SSE body. Every line must be strict UTF-8 and every payload JSON,
    except a final ``[DONE]``; events are separated by one blank line. With ``comments``, an
    event that is one comment line (``: keep-alive``, which a stream that waits in the queue
    gets every ``--sse-keepalive-s``) is skipped; without, it fails."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    out = []
    for event in raw[:-2].split(b"\n\n"):
        lines = event.split(b"\n")
        if comments and len(lines) == 1 and lines[0].startswith(b":"):
            continue
        assert len(lines) == 1 and lines[0].startswith(b"data: "), event
        text = lines[0][len(b"data: "):].decode("utf-8")  # strict: raises on invalid UTF-8
        out.append(text if text == "[DONE]" else json.loads(text))
    return out


def ok(reply: Reply) -> dict:
    assert reply.status == 200, reply.body[:500]
    return reply.json()


def assert_error_shape(body, status_type: str | None = None) -> dict:
    """The OpenAI error object of a parsed error ``body``: exactly ``{"error": {"message", "type",
    "param", "code"}}`` with a message; its ``type`` is ``status_type`` when given."""
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if status_type:
        assert err["type"] == status_type, err
    return err


#: OpenAI's error ``type`` of a status that is not ``invalid_request_error`` (below 500) or
#: ``server_error`` (from 500).
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 424: "server_error", 429: "rate_limit_error"}


def error(reply: Reply, status: int, param=..., code=...) -> dict:
    """The OpenAI error object of ``reply``, after checking status, shape, JSON content type and
    the type its status gives (:data:`ERROR_TYPES`); ``param`` and ``code`` when given."""
    assert reply.status == status, (reply.status, reply.body[:500])
    err = assert_error_shape(reply.json(),
                             ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"))
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def stream_chunks(events: list) -> list[dict]:
    """The JSON chunks of a stream after checking it ends with exactly one ``[DONE]``."""
    assert events and events[-1] == "[DONE]", events[-3:]
    assert events.count("[DONE]") == 1, events
    chunks = events[:-1]
    for c in chunks:
        assert "error" not in c, c
    return chunks


def streamed_texts(chunks: list[dict], chat_: bool = True) -> dict[int, list[str]]:
    """Per choice index, the text pieces in order (``delta.content`` or ``text``)."""
    out: dict[int, list[str]] = {}
    for c in chunks:
        for ch in c["choices"]:
            piece = ch["delta"].get("content", "") if chat_ else ch["text"]
            out.setdefault(ch["index"], []).append(piece or "")
    return out


def equal_streamed(server, path: str, body: dict) -> tuple[dict, list[dict]]:
    """The equality property: the same request streamed and not gives byte-identical text.

    Returns the non-streamed response and the stream's chunks."""
    is_chat = path == CHAT
    full = ok(post(server, path, {**body, "stream": False}))
    r = post(server, path, {**body, "stream": True})
    assert r.status == 200, r.body[:500]
    chunks = stream_chunks(r.events())
    pieces = streamed_texts(chunks, is_chat)
    for choice in full["choices"]:
        text = choice["message"]["content"] if is_chat else choice["text"]
        joined = "".join(pieces[choice["index"]])
        assert joined.encode("utf-8") == text.encode("utf-8"), (joined, text)
    return full, chunks


def content(resp: dict, i: int = 0) -> str:
    return resp["choices"][i]["message"]["content"]
