"""A cross-process lock the kernel releases when its holder dies (``fcntl.flock``)."""
from __future__ import annotations

import fcntl
import os
import threading


class FlockLock:
    """Mutual exclusion across processes and threads.

    ``flock`` locks belong to an open file description, which threads of one process (and a
    forked child that inherited the descriptor) share; so each process opens the file itself
    (re-opened after ``fork``) and a ``threading.Lock`` serializes its own threads.
    Unlike a ``multiprocessing.Lock``, the lock is released by the kernel when a holder is
    killed, even by SIGKILL, inside its critical section.
    """

    def __init__(self, path: str):
        self.path = path
        self._pid = -1
        self._fd = -1
        self._thread_lock = threading.Lock()

    def _ensure_open(self) -> None:
        if self._pid != os.getpid():
            self._thread_lock = threading.Lock()  # a lock copied by fork may be held
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()

    def __enter__(self):
        self._ensure_open()
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def close(self) -> None:
        if self._pid == os.getpid() and self._fd >= 0:
            os.close(self._fd)
        self._fd, self._pid = -1, -1
