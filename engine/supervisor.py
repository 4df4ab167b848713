"""Starts the engine process, watches it, restarts it, and reclaims leases of dead processes.

Runs in the process that owns the transport (the ``inference-server`` / gunicorn master).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Callable

from engine.config import EngineConfig
from engine.threads import wait_environment
from shm import EngineState, ErrorCode
from shm.segment import SharedMemoryTooSmall  # noqa: F401 - raised by create(), caught by the server
from shm.transport import Transport

log = logging.getLogger("supervisor")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stop_child(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc``, SIGKILL it if it has not exited after ``timeout`` seconds, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pid_alive(pid: int) -> bool:
    """True if a process with ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, IndexError):
        return False


class EngineSupervisor:
    """Keeps exactly one engine process running over ``transport``.

    When the engine exits unexpectedly, every in-flight mailbox is failed (readers raise
    ``EngineUnavailable``), unread ring records are dropped, and a new engine is started after
    ``restart_delay_s``, doubling (up to ``max_restart_delay_s``) while restarts keep failing
    before the engine gets ready. Every ``sweep_s`` the engine's liveness is checked, an engine
    that has made no progress for ``stall_s`` seconds is killed (and so restarted), and the leases
    of dead owner processes are reclaimed. Progress is a completed step or, inside a decode, a
    computed node of llama.cpp's graph (:mod:`shm.control`): a slow step under contention keeps
    beating, a stopped or deadlocked engine does not.

    Args:
        transport: the shared memory the engine attaches to; :meth:`create` makes one that the
            supervisor owns and unlinks in :meth:`stop`.
        env: extra environment for the engine (e.g. ``OMP_WAIT_POLICY``). The engine gets the
            server's environment with it, plus a short libgomp spin
            (:func:`engine.threads.wait_environment`) unless either sets the wait itself
            (docs/performance.md "Threads").
        on_exit: called from the watching thread with ``(pid, crashed)`` after an engine process
            exited (``crashed``: not told to stop and not :attr:`failed`, so it is restarted; the
            master counts restarts, retires the process's metric files and stops when
            :attr:`failed`).
    """

    def __init__(self, config: EngineConfig, transport: Transport, env: dict | None = None,
                 sweep_s: float = 0.2, restart_delay_s: float = 0.5, max_restart_delay_s: float = 30.0,
                 stall_s: float = 30.0, owns_transport: bool = False,
                 on_exit: Callable[[int, bool], None] | None = None):
        self.config = config
        self._of = f" of {config.name}" if config.name else ""  # which model's, in its log lines
        self.on_exit = on_exit
        self.t = transport
        self.owns_transport = owns_transport
        given = {**os.environ, **(env or {})}
        self.env = {**given, **wait_environment(given)}
        self.sweep_s = sweep_s
        self.restart_delay_s = restart_delay_s
        self.max_restart_delay_s = max_restart_delay_s
        self.stall_s = stall_s
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        #: The engine could not load the model (``EngineState.FAILED``) and never had: no
        #: restart follows.
        self.failed = False
        self._ready_once = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def create(cls, config: EngineConfig, name: str | None = None, **kwargs) -> "EngineSupervisor":
        """A supervisor over a new transport sized for ``config`` (named ``name``, or a fresh
        name), which :meth:`stop` unlinks. Not started yet.

        Raises:
            FileExistsError: a segment of that name exists.
            SharedMemoryTooSmall: ``/dev/shm`` cannot hold the segment (the message says what fixes it).
        """
        return cls(config, Transport.create(config.layout(), name=name), owns_transport=True, **kwargs)

    @property
    def transport_name(self) -> str:
        return self.t.name

    def start(self) -> None:
        self._spawn()
        self._thread = threading.Thread(target=self._watch, name="engine-supervisor", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        args = [sys.executable, "-m", "engine.process", self.t.name,
                json.dumps(dataclasses.asdict(self.config))]
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(args, env=env)

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Block until the engine reports ready; False on timeout or when no engine will come.

        A crashing engine is restarted (with back-off), so this waits for the restarts too.
        """
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.t.control.state == EngineState.READY and pid_alive(self.t.control.engine_pid):
                return True  # not a stale READY: a killed engine's, before this loop saw it die
            if self._thread is None or not self._thread.is_alive():
                return False  # stopped, or the engine stopped for good
            time.sleep(0.05)
        return False

    def reclaim(self) -> list[int]:
        """Reclaim mailboxes leased by processes that no longer exist."""
        return self.t.mailboxes.reclaim(pid_alive)

    def _watch(self) -> None:
        # Liveness is polled, and the exit is judged by the engine's own state, not its exit
        # status: under gunicorn the master's ``waitpid(-1)`` may reap the engine first, and
        # Popen then reports 0 whatever happened.
        failures = 0
        while not self._stopping.wait(self.sweep_s):
            if self.proc.poll() is None:
                self.reclaim()
                if self.t.control.state == EngineState.READY:
                    failures = 0
                    self._ready_once = True
                    self._kill_if_stalled()
                continue
            stopped = self.t.control.state == EngineState.STOPPED
            # A model that loaded once and fails on a restart (memory short for a moment) is
            # retried as a crash; only one that never loaded stops the server.
            self.failed = self.t.control.state == EngineState.FAILED and not self._ready_once
            self.t.control.set_state(EngineState.DEAD)
            crashed = not stopped and not self.failed
            if crashed:
                self.restarts += 1  # counted before readers wake, so they see the restart coming
            self.t.ring.reset()
            self.t.mailboxes.fail_in_flight(ErrorCode.ENGINE_DIED)
            self.t.control.clear_slots()
            if self.on_exit is not None:
                self.on_exit(self.proc.pid, crashed)
            if stopped:  # it was told to stop (SIGTERM to our process group)
                log.info("engine%s stopped", self._of)
                return
            if self.failed:  # it said why in its log; the same model will not load next time
                return
            failures += 1
            delay = min(self.max_restart_delay_s, self.restart_delay_s * 2 ** (failures - 1))
            log.error("engine%s died; failed its in-flight requests; restarting in %.1f s", self._of, delay)
            if self._stopping.wait(delay):
                return
            self._spawn()

    def _kill_if_stalled(self) -> None:
        """A ready engine that has made no progress for ``stall_s`` is hung (a deadlocked
        decode, a SIGSTOP): kill it, so its requests fail and a new engine takes over."""
        silent = self.t.control.seconds_since_progress()
        if silent > self.stall_s:
            log.error("engine%s made no progress for %.0f s; killing it", self._of, silent)
            self.t.control.set_state(EngineState.DEAD)  # not ready from now: its streams may see it gone first
            self.proc.kill()

    # -- the server's drain -------------------------------------------------------------------------
    def start_draining(self) -> None:
        """Front ends take no new request from now on (they answer ``ShuttingDown``)."""
        self.t.control.start_draining()

    def in_flight(self) -> int:
        """Requests holding a mailbox (queued, running, or being read by their front end)."""
        return self.t.mailboxes.in_use()

    def stop(self, timeout: float = 10.0) -> None:
        """:meth:`stop_engine`, then unlink the transport if this supervisor created it."""
        self.stop_engine(timeout)
        if self.owns_transport:
            self.t.close()

    def stop_engine(self, timeout: float = 10.0) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after ``timeout``) for good: it ends every
        sequence with ``ErrorCode.SHUTDOWN``, and what it left is failed the same way. The
        transport stays (front ends read those endings). Idempotent."""
        self._stopping.set()
        if self.proc is not None:
            stop_child(self.proc, timeout)
        if self._thread is not None:
            self._thread.join(timeout)
        if self.t.mailboxes is not None:
            self.t.mailboxes.fail_in_flight(ErrorCode.SHUTDOWN)
