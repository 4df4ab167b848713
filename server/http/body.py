"""Reading an HTTP request's body: Falcon's request -> one JSON object, checked for media type,
encoding, size and text before any field is looked at (the fields are ``server/api``'s)."""
from __future__ import annotations

import heapq
import itertools
import os
import socket
import ssl
import threading
import time

import falcon

from engine.errors import InvalidRequest
from server.api import json_text
from server.errors import APIError
from server.http.worker import close_after_response

#: Seconds a request body may pause between two reads (nginx's ``client_body_timeout`` is the
#: same gap, 60 s there)...
BODY_GAP_S = 10.0
#: ...and may take in all, counted once its head is in (1 MiB, the default --max-body-bytes, in
#: that time is 140 kbit/s). A client that stalls or trickles its body otherwise holds a worker
#: thread for as long as it likes: a few hundred such connections took every thread.
BODY_TIMEOUT_S = 60.0
_CHUNK = 64 * 1024


def read_json(req: falcon.Request, max_body_bytes: int) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 415 not ``application/json``; 413 over ``max_body_bytes`` (the connection is
        then closed, the body left unread); 408 (then closed too) when the body stalls
        :data:`BODY_GAP_S` or takes :data:`BODY_TIMEOUT_S` in all; 400 not UTF-8, not JSON, or
        not an object.
    """
    media = (req.content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {req.content_type or 'none'}",
                       code="unsupported_media_type")
    encoding = (req.get_header("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise APIError(415, f"Content-Encoding {encoding} is not supported; send plain JSON",
                       code="unsupported_media_type")
    too_large = APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large",
                         headers={"Connection": "close"})
    if req.content_length is not None and req.content_length > max_body_bytes:
        raise too_large
    # Without Content-Length (a chunked body), Falcon's bounded stream reads nothing; gunicorn's
    # own input stream decodes the chunks and ends at the body's end.
    stream = req.bounded_stream if req.content_length is not None else req.stream
    sock = req.env.get("gunicorn.socket")
    try:
        raw = read_bounded(stream, sock, max_body_bytes + 1)
    except TimeoutError:
        close_after_response(sock)  # the rest of the body will not be read
        raise APIError(408, f"request body not received within {BODY_GAP_S:.0f} s of its last bytes or "
                            f"{BODY_TIMEOUT_S:.0f} s in all", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except Exception as e:  # noqa: BLE001 - gunicorn's malformed-chunk errors have no common base
        raise InvalidRequest(f"request body could not be read: {type(e).__name__}") from None
    if len(raw) > max_body_bytes:
        raise too_large
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json_text.loads(text)
    except json_text.TooDeep as e:
        raise InvalidRequest(f"request body: {e}") from None
    except ValueError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def read_bounded(stream, sock, limit: int, gap_s: float = BODY_GAP_S, total_s: float = BODY_TIMEOUT_S) -> bytes:
    """Up to ``limit`` bytes of ``stream`` (a file-like body reader over the client's socket
    ``sock``; None: no socket, as in-process tests), each read of the socket bounded by
    ``gap_s`` seconds (its timeout) and all of them by ``total_s`` (:class:`Deadlines`: the
    reader's own loop reads on until it has what it was asked for, so a client that keeps each
    gap short is cut off from outside). The socket's own timeout is restored afterwards (a
    response has no such bound).

    Raises:
        TimeoutError: a bound passed.
    """
    if sock is None:
        return stream.read(limit)
    before = sock.gettimeout()
    deadline = DEADLINES.add(time.monotonic() + total_s, sock)
    parts, size = [], 0
    try:
        sock.settimeout(gap_s)
        while size < limit:
            part = stream.read(min(_CHUNK, limit - size))
            if not part:
                break
            parts.append(part)
            size += len(part)
    finally:
        DEADLINES.done(deadline)
        sock.settimeout(before)
    if deadline.expired:  # its read side was shut: what was read ends early
        raise TimeoutError
    return b"".join(parts)


class _Deadline:
    __slots__ = ("at", "seq", "sock", "expired", "live")

    def __init__(self, at: float, seq: int, sock):
        self.at, self.seq, self.sock, self.expired, self.live = at, seq, sock, False, True

    def __lt__(self, other: "_Deadline") -> bool:
        return (self.at, self.seq) < (other.at, other.seq)


class Deadlines:
    """Shuts the read side of a socket whose body is not in by its deadline (a blocked read then
    returns the end at once), from one thread per process, started at the first use in it (a
    gunicorn worker forks after the app is imported). Not for a TLS socket: an ``SSLSocket``'s
    shutdown drops its TLS state; its body has the gap bound only."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[_Deadline] = []
        self._seq = itertools.count()
        self._pid = None

    def add(self, at: float, sock) -> _Deadline:
        """Watch ``sock`` until :meth:`done`; ``at``: ``time.monotonic()`` seconds."""
        entry = _Deadline(at, next(self._seq), sock)
        if isinstance(sock, ssl.SSLSocket):
            return entry
        with self._cond:
            if self._pid != os.getpid():
                self._pid, self._heap = os.getpid(), []
                threading.Thread(target=self._run, name="body-deadlines", daemon=True).start()
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:  # else the thread already wakes no later than it is due
                self._cond.notify()
        return entry

    def done(self, entry: _Deadline) -> None:
        """The body is read (or failed): stop watching (its entry leaves at its deadline)."""
        with self._cond:
            entry.live = False

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and not self._heap[0].live:
                    heapq.heappop(self._heap)
                wait = self._heap[0].at - time.monotonic() if self._heap else None
                if wait is None or wait > 0:
                    self._cond.wait(wait)
                    continue
                entry = heapq.heappop(self._heap)
                entry.expired, entry.live = True, False
                try:
                    entry.sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass


DEADLINES = Deadlines()
