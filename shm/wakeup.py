"""Wake-ups between processes: one named FIFO per mailbox plus one for the engine.

A FIFO is a file descriptor, so a front-end thread can ``poll()`` the wake-ups of all its
mailboxes and its client's socket together. Every process opens FIFOs ``O_RDWR | O_NONBLOCK``:
on Linux that never blocks and never fails for lack of a peer, and a full pipe (a slow reader)
makes ``wake`` a no-op instead of blocking the engine: the reader is already due to wake.
"""
from __future__ import annotations

import os
import select
import threading


class Wakeups:
    """The FIFOs of one transport, opened lazily per process.

    Args:
        directory: folder holding ``engine.fifo`` and ``mb<i>.fifo`` for ``i < n_mailboxes``.
    """

    ENGINE = -1

    def __init__(self, directory: str, n_mailboxes: int):
        self.directory = directory
        self.n_mailboxes = n_mailboxes
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked child: inherited descriptors are left alone (the parent owns them)."""
        self._fds = {}
        self._lock = threading.Lock()

    def path(self, index: int) -> str:
        name = "engine" if index == self.ENGINE else f"mb{index}"
        return os.path.join(self.directory, f"{name}.fifo")

    def create_all(self) -> None:
        """Make every FIFO (by the segment's owner, once)."""
        for index in [self.ENGINE, *range(self.n_mailboxes)]:
            os.mkfifo(self.path(index), 0o600)

    def fd(self, index: int) -> int:
        """The descriptor for FIFO ``index`` in this process (opened on first use)."""
        fd = self._fds.get(index)
        if fd is None:
            with self._lock:
                fd = self._fds.get(index)
                if fd is None:
                    fd = os.open(self.path(index), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                    self._fds[index] = fd
        return fd

    def wake(self, index: int) -> None:
        """Wake whoever waits on FIFO ``index``; never blocks."""
        try:
            os.write(self.fd(index), b"\x01")
        except BlockingIOError:
            pass  # pipe full: a wake-up is already pending

    def drain(self, index: int) -> None:
        """Consume pending wake-ups of FIFO ``index``. A read that returns less than it asked
        for emptied the pipe, so the usual drain is one ``read(2)``, not a second one that fails."""
        fd = self.fd(index)
        try:
            while len(os.read(fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def wait(self, indices, timeout: float | None, extra_fd: int | None = None) -> tuple[set[int], bool]:
        """Block until a FIFO of ``indices`` is readable or ``extra_fd`` (a client socket) hangs up.

        The socket is watched for ``POLLRDHUP``/``POLLHUP`` only, so bytes a client pipelines
        do not wake the caller.

        Args:
            indices: FIFO indices (mailboxes, or :attr:`ENGINE`).
            timeout: seconds; None waits forever.
        Returns:
            ``(indices woken, socket hung up)``; both empty/False on timeout.
        """
        poller = select.poll()
        by_fd = {self.fd(index): index for index in indices}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        if extra_fd is not None:
            poller.register(extra_fd, select.POLLRDHUP)
        ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
        return {by_fd[fd] for fd, _ in ready if fd in by_fd}, any(fd == extra_fd for fd, _ in ready)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}


def hung_up(sock) -> bool:
    """True if the peer of ``sock`` has already closed (or shut down) its side."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return bool(poller.poll(0))
