"""A cross-process lock the kernel releases when its holder dies (``fcntl.flock``)."""
from __future__ import annotations

import fcntl
import os
import threading


class FlockLock:
    """Mutual exclusion across processes and threads.

    ``flock`` locks belong to an open file description, which threads of one process (and a
    forked child that inherited the descriptor) share; so each process opens the file itself
    (again after ``fork``) and a ``threading.Lock`` serializes its own threads.
    Unlike a ``multiprocessing.Lock``, the lock is released by the kernel when a holder is
    killed, even by SIGKILL, inside its critical section.
    """

    def __init__(self, path: str):
        self.path = path
        self._fd = -1
        self._thread_lock = threading.Lock()
        # A forked child starts with its own (unheld) thread lock and must reopen the file.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._fd = -1
        self._thread_lock = threading.Lock()

    def __enter__(self):
        self._thread_lock.acquire()
        try:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def close(self) -> None:
        with self._thread_lock:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1
