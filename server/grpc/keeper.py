"""The gunicorn master's keeper of the gRPC sidecar (:func:`server.grpc.server.main`).

The sidecar is forked from the master, as a worker is, and imports gRPC only then: gRPC's core
does not survive ``fork`` once it is loaded, and the master never imports it. A fork shares the
master's pages (its imports and every model's tokenizer: ``server.http.worker_app.preload``),
where a new interpreter (``python -m server.grpc.server``) holds its own copy of them: 120 MB of
resident memory beside Gemma 3 270M's vocabulary, against 55. The child leaves the master's
signal handlers and listening sockets behind, names itself ``SIDECAR_NAME`` (``ps``, and
``/proc/<pid>/comm``, where its command line is the master's), and never returns into the
master's code. A sidecar that exits while the server runs is started again after ``RESTART_S``,
and the mailboxes it leased are reclaimed as a dead worker's are. One that cannot bind its port
(another process took it after the master's :func:`check_port`: two servers started at once
with one ``--grpc-port``, or a process that took the port while the sidecar restarted) exits with
:data:`BIND_FAILED` after saying so on a pipe (:func:`report_bind_failed`), and the server stops
rather than serve HTTP with no gRPC behind a ready health check.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn

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
#: The module whose ``main()`` the sidecar runs.
SIDECAR_MODULE = "server.grpc.server"
#: The sidecar's process name (``prctl(PR_SET_NAME)``: at most 15 bytes).
SIDECAR_NAME = "grpc-sidecar"
#: ``prctl`` options (linux/prctl.h).
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


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
        self.proc: Forked | None = None
        self._report: int | None = None  # the read end of the running sidecar's report pipe
        self._stopping = threading.Event()
        self._draining = threading.Event()
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
            master = os.getpid()
            pid = os.fork()
            if pid == 0:
                _run_sidecar(self.env, write, master)
        finally:
            os.close(write)
        self.proc = Forked(pid)
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
            if self._stopping.wait(RESTART_S):
                return
            if self._draining.is_set():
                log.info("gRPC sidecar (pid %d) exited with %s while the server drains; not restarted",
                         self.proc.pid, code)
                return
            log.error("gRPC sidecar (pid %d) exited with %s; restarted after %.1f s", self.proc.pid, code, RESTART_S)
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn()

    def drain(self) -> None:
        """The server drains: a sidecar that exits from now on is not started again. New calls
        would be refused anyway, and one sent the SIGTERM with the master (a signal to the whole
        process group, as systemd's ``KillMode=control-group`` sends) has drained its own calls.
        An exit within ``RESTART_S`` before this call counts too."""
        self._draining.set()

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


class Forked:
    """A forked child as ``subprocess.Popen`` shows one, as far as :class:`Sidecar` and
    ``engine.supervisor.stop_child`` use it. The gunicorn master's ``waitpid(-1)`` may reap the
    child first; its exit status is then unknown and read as 0, as ``Popen`` reads it."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid and self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, once it exited (blocking; polled every 50 ms with a ``timeout``).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_sidecar(env: dict[str, str], report: int, master: int) -> NoReturn:
    """In the forked child of ``master``: leave the master's state behind, run the sidecar
    (:func:`server.grpc.server.main`) in ``env``, exit with its status. Never returns: the
    forking thread's stack is the master's (gunicorn's start-up, or :meth:`Sidecar._keep`)."""
    code = 1
    try:
        # Ended with the master from the first instruction on (its main sets this again for a
        # sidecar run alone): one left behind would hold the gRPC port, and the next start be
        # refused. A master already gone by now would never send the signal.
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != master:
            os._exit(1)
        # The master's objects stay out of the collector's walks, which would write to each
        # one's header and so copy the pages this process shares with the master.
        gc.freeze()
        for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)  # gunicorn's arbiter's handlers are the master's
        # A tenant reload (the master's SIGHUP) asked while the sidecar starts waits until its
        # main can carry it out, rather than end it as SIGHUP's default action would.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        _leave_descriptors(keep=(0, 1, 2, report))
        ctypes.CDLL(None).prctl(PR_SET_NAME, SIDECAR_NAME.encode())
        os.environ.clear()
        os.environ.update({**env, REPORT_FD_ENV: str(report)})
        # by name, as ``python -m`` ran it: that module imports this one, and gRPC
        code = importlib.import_module(SIDECAR_MODULE).main()
    except BaseException:  # noqa: BLE001 - said, then the exit status
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _leave_descriptors(keep: tuple[int, ...]) -> None:
    """Put ``/dev/null`` in place of every open file descriptor but ``keep``, as ``subprocess``'s
    ``close_fds`` would close them: the master's listening sockets (the HTTP port would stay
    bound while a sidecar outlived it), pipes and locks. ``dup2`` rather than ``close``: the
    master's objects that hold those numbers, should one be finalized here, close ``/dev/null``
    and not a descriptor this process opened since."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep and fd != null:
            with contextlib.suppress(OSError):  # the directory's own descriptor, closed by now
                os.dup2(null, fd)
    os.close(null)
