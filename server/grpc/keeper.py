"""The gunicorn master's keeper of the gRPC sidecar (``python -m server.grpc.server``).

gRPC's core does not survive ``fork`` once it is loaded, so the sidecar is a new interpreter
(``subprocess``: fork then exec, from the master, which never imports grpc), not a forked
worker. A sidecar that exits while the server runs is started again after ``RESTART_S``, and
the mailboxes it leased are reclaimed as a dead worker's are. One that cannot bind its port
(another process took it after the master's :func:`check_port`: two servers started at once
with one ``--grpc-port``, or a process that took the port while the sidecar restarted) exits with
:data:`BIND_FAILED` after saying so on a pipe (:func:`report_bind_failed`), and the server stops
rather than serve HTTP with no gRPC behind a ready health check.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import subprocess
import sys
import threading
from typing import Callable

from engine.config import ConfigError
from engine.supervisor import stop_child

log = logging.getLogger("sidecar")
RESTART_S = 0.5
STOP_S = 10.0
#: The sidecar's exit status when gRPC could not bind its port (``server.grpc.server.main``).
BIND_FAILED = 3
#: The environment variable naming the pipe on which the sidecar reports a failed bind
#: (:func:`report_bind_failed`). The keeper cannot rely on the exit status: the gunicorn master's
#: ``waitpid(-1)`` may reap the sidecar first, and ``Popen.wait`` then reads 0.
REPORT_FD_ENV = "INFERENCE_SIDECAR_REPORT_FD"
_BIND_FAILED_REPORT = b"B"


def report_bind_failed() -> None:
    """In the sidecar: tell the keeper that gRPC could not bind the port (before exiting)."""
    fd = os.environ.get(REPORT_FD_ENV)
    if fd:
        with contextlib.suppress(OSError, ValueError):
            os.write(int(fd), _BIND_FAILED_REPORT)


def check_port(host: str, port: int) -> None:
    """Refuse a ``--grpc-port`` another process listens on, before anything starts: the sidecar
    would only fail to bind after the engine loaded, and stop the server then. Binds and
    closes a socket on each address ``host`` resolves to, as gRPC will bind them (``SO_REUSEADDR``,
    no ``SO_REUSEPORT``, :func:`server.grpc.server.options`). A port taken between this check and
    the sidecar's bind stops the server (:class:`Sidecar`'s ``on_bind_failed``).

    Args:
        host: ``ServerConfig.host`` (an IPv6 address without its brackets). port: the gRPC port.
    Raises:
        ConfigError: the port is in use.
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # a host that does not resolve: the HTTP bind, next, says so
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(f"--grpc-port {port} is in use on {address[0]} (another server's gRPC "
                                      "sidecar? give each server its own --grpc-port, or 0 for none)") from None
                # anything else (an address family this host lacks) is gRPC's to report


class Sidecar:
    """Runs and restarts one child process.

    Args:
        env: its environment (the server's configuration variables and ``INFERENCE_SHM``).
        on_exit: called with the pid after every exit (the master reclaims the dead process's
            mailboxes and retires its metric files).
        on_bind_failed: called, from the keeper's thread, instead of a restart when the child
            reported that it could not bind (:func:`report_bind_failed`; the master stops the
            server).
    """

    def __init__(self, env: dict[str, str], on_exit: Callable[[int], None], on_bind_failed: Callable[[], None]):
        self.env, self.on_exit, self.on_bind_failed = env, on_exit, on_bind_failed
        self.proc: subprocess.Popen | None = None
        self._report: int | None = None  # the read end of the running sidecar's report pipe
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # no spawn after stop() began
        self._thread = threading.Thread(target=self._keep, name="grpc-sidecar", daemon=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        self._close_report()
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "server.grpc.server"],
                                         env={**self.env, REPORT_FD_ENV: str(write)}, pass_fds=(write,))
        finally:
            os.close(write)
        os.set_blocking(read, False)  # read once the sidecar is gone: what it wrote, or nothing
        self._report = read

    def _bind_failed(self) -> bool:
        """Whether the sidecar, now gone, reported a failed bind."""
        try:
            return os.read(self._report, 1) == _BIND_FAILED_REPORT
        except BlockingIOError:
            return False

    def _close_report(self) -> None:
        if self._report is not None:
            os.close(self._report)
            self._report = None

    def _keep(self) -> None:
        while True:
            code = self.proc.wait()
            self.on_exit(self.proc.pid)
            if self._stopping.is_set():
                return
            if self._bind_failed():
                self.on_bind_failed()
                return
            log.error("gRPC sidecar (pid %d) exited with %s; restarting in %.1f s", self.proc.pid, code, RESTART_S)
            if self._stopping.wait(RESTART_S):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        """SIGTERM (the sidecar drains its calls), SIGKILL after ``STOP_S`` seconds."""
        with self._lock:
            self._stopping.set()
        if self.proc is None:
            return
        stop_child(self.proc, STOP_S)
        self._thread.join(STOP_S)
        self._close_report()
