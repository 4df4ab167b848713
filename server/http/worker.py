"""The gunicorn worker: gunicorn's ``gthread`` worker with two defences at the connection level.

- **No thread waits for a request head.** gthread hands a new (or kept-alive) connection to a
  pool thread, which blocks until the whole request head has arrived, with no time limit: a
  slowloris client (one header byte every few seconds) holds a thread for as long as it likes,
  and as many such clients as threads deny service. :class:`Worker` first reads what has
  arrived, never blocking, into gunicorn's parser buffer (:func:`read_head`); until the head
  is complete the connection goes back to gunicorn's poller, holding no thread, and it is closed
  with ``408`` once :data:`HEADER_TIMEOUT_S` seconds have passed (nginx's
  ``client_header_timeout``).
- **A refused body is read before the close** (:func:`discard_body`): the ``413`` for an
  oversized body is sent without reading it, and closing a socket with unread data makes the
  kernel send a reset, which clients that write the whole body before reading (Python's
  ``http.client``, many SDK transports) report instead of the ``413``. As nginx's lingering
  close does, the rest is read and thrown away, up to ``--max-discard-bytes`` and
  :data:`LINGER_S` seconds.

A body is read by the app's thread, within bounds of its own (``server.http.body``), which
closes the connection after its 408 through :func:`close_after_response`.

Use it as ``worker_class = "server.http.worker.Worker"`` (``server.gunicorn_conf`` does).
"""
from __future__ import annotations

import os
import socket
import ssl
import threading
import time

from gunicorn.workers import gthread

#: The most bytes buffered while waiting for the end of a request head. A head this long
#: without its blank line is handed to gunicorn's parser, which enforces its own limits
#: (``limit_request_line``, ``limit_request_fields``...).
HEAD_BYTES = 64 * 1024
#: Seconds a request head may take to arrive, counted from its first incomplete read (nginx's
#: ``client_header_timeout`` is 60). gunicorn also closes a connection that sends nothing for
#: ``keepalive`` seconds (5).
HEADER_TIMEOUT_S = 10.0
#: Seconds a refused body is read for at most, in all (nginx's ``lingering_time`` is 30)...
LINGER_S = 10.0
#: ...and between two reads (nginx's ``lingering_timeout`` is 5).
LINGER_READ_S = 2.0
_408 = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
#: The gunicorn request each worker thread is handling (for :func:`close_after_response`).
_handling = threading.local()


def close_after_response(sock: socket.socket | None = None) -> None:
    """From the app, in a worker's thread: close the connection once the current answer is
    sent, and say ``Connection: close`` in it (gunicorn ignores the app's own ``Connection``
    header, a hop-by-hop one). A no-op outside this worker (in-process tests).

    With ``sock`` (the client's socket), nothing more is read from it: gunicorn closes such a
    connection gracefully, reading what the client still sends until it closes or for 2 s, on
    the worker's main thread, which every other connection of the worker waits for meanwhile;
    a client that never closes would hold it for those 2 s each time.
    """
    req = getattr(_handling, "request", None)
    if req is not None:
        req.must_close = True
        # Not under TLS: an SSLSocket's shutdown drops its TLS state, and the answer would then
        # go out in clear.
        if sock is not None and not isinstance(sock, ssl.SSLSocket):
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass


def read_head(conn) -> bool:
    """Move what the client sent so far into the connection's parser buffer, never blocking,
    and say whether the request head is complete.

    Returns True when the head's blank line arrived (empty lines before a request line do not
    count), the buffer reached :data:`HEAD_BYTES` (gunicorn's parser enforces its own limits),
    or the peer closed or failed (gunicorn's parser reports that); False when more is to come.
    """
    unreader = conn.parser.unreader
    while True:
        try:
            data = conn.sock.recv(HEAD_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            return True
        if not data:
            return True
        unreader.buf.seek(0, os.SEEK_END)  # after what is buffered (gunicorn's unread() prepends)
        unreader.buf.write(data)
        if unreader.buf.tell() >= HEAD_BYTES:
            return True
    head = unreader.buf.getvalue().lstrip(b"\r\n")
    return b"\r\n\r\n" in head or b"\n\n" in head or len(head) >= HEAD_BYTES


def discard_body(sock: socket.socket, max_bytes: int, seconds: float = LINGER_S) -> int:
    """Lingering close, first half: send FIN after the response, then read and drop what the
    client still sends, until it closes, ``max_bytes`` were read, or ``seconds`` passed.

    Reads 1 MiB at a time: each ``recv`` gives up the GIL, so small reads would be slowed down
    by the worker's busy threads. Returns the bytes discarded. Never raises for socket errors.
    """
    buf = bytearray(1 << 20)
    discarded = 0
    deadline = time.monotonic() + seconds
    try:
        sock.shutdown(socket.SHUT_WR)
        while discarded < max_bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sock.settimeout(min(remaining, LINGER_READ_S))
            n = sock.recv_into(buf, min(len(buf), max_bytes - discarded))
            if not n:
                break
            discarded += n
    except OSError:
        pass
    return discarded


class Worker(gthread.ThreadWorker):
    """gthread, where a connection holds a thread only while its request head is complete."""

    def handle_request(self, req, conn):
        """gthread's, with ``req`` known to :func:`close_after_response` meanwhile."""
        _handling.request = req
        try:
            return super().handle_request(req, conn)
        finally:
            _handling.request = None

    def handle(self, conn):
        """Defer a connection (back to the poller, no thread held) until its head is complete;
        close one whose head is not complete :data:`HEADER_TIMEOUT_S` after it was first
        deferred; then let gthread handle it."""
        if self.cfg.is_ssl or conn.is_http2:
            return super().handle(conn)  # TLS and HTTP/2 keep gthread's own handling
        conn.init()  # the parser, whose buffer collects the head (idempotent)
        if read_head(conn):
            conn.head_deadline = None
            return super().handle(conn)
        now = time.monotonic()
        deadline = getattr(conn, "head_deadline", None)
        if deadline is None:
            conn.head_deadline = now + HEADER_TIMEOUT_S
        elif now >= deadline:
            try:
                conn.sock.send(_408, socket.MSG_DONTWAIT)
                # gthread closes the connection gracefully, reading for up to 2 s on the worker's
                # main thread what the client still sends: 20 slowloris clients held every other
                # connection of the worker for 34 s. Nothing more is read.
                conn.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            self.log.debug("closed a connection from %s: request head incomplete after %.0f s",
                           conn.client[0] if conn.client else "?", HEADER_TIMEOUT_S)
            return False
        return gthread._DEFER  # noqa: SLF001 - gthread's own "back to the poller" result
