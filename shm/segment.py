"""The segment's life on tmpfs: its pages reserved at creation, an owner lock held for its life,
and the leftovers of dead owners removed.

Two faults of POSIX shared memory on ``/dev/shm`` (a tmpfs) shape this module:

- **Lazy pages.** ``ftruncate`` only sets a size; tmpfs allocates a page when it is first
  touched. A segment larger than the free room is created "successfully", and the engine dies
  with SIGBUS much later, when it first writes past the room (Docker's default ``/dev/shm`` is
  64 MB). :func:`reserve` allocates every page up front (``posix_fallocate``), so a start-up
  that cannot fit fails at once, with the numbers and the fix (:class:`SharedMemoryTooSmall`).
- **Crash leftovers.** A SIGKILLed owner never unlinks; a Kubernetes memory volume keeps the
  files across container restarts. PIDs cannot tell a dead owner from a live one (in a container
  the new master is PID 1 again), so the owner holds an ``flock`` on ``<name>.d/owner`` for its
  lifetime (:class:`OwnerLock`), which the kernel releases when it dies however it dies;
  :func:`remove_orphans` removes the segments whose lock is free.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import time

SHM_DIR = "/dev/shm"
#: Every segment this product creates is named ``infer-...`` (``shm.transport``).
PREFIX = "infer-"
OWNER_FILE = "owner"
#: A segment or folder with no owner file is a leftover once this old: the owner file is made
#: before the segment (:meth:`shm.transport.Transport.create`), so only a crash leaves one without it.
OWNERLESS_S = 60.0

_FIX = ("lower --max-seq-len, --max-queued or --max-slots, or give /dev/shm more room: "
        "`docker run --shm-size=...`, compose `shm_size:`, or in Kubernetes an emptyDir "
        "{medium: Memory, sizeLimit: ...} mounted at /dev/shm")


class SharedMemoryTooSmall(OSError):
    """The shared-memory file system cannot hold the segment.

    Attributes: ``needed`` and ``available`` (bytes). The message is one line with both and the
    settings that fix it.
    """

    def __init__(self, needed: int, available: int, directory: str = SHM_DIR):
        self.needed, self.available = needed, available
        super().__init__(f"{directory} has {_mib(available)} free but the shared memory segment needs "
                         f"{_mib(needed)} ({needed} bytes); {_FIX}")
        self.errno = errno.ENOSPC


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def available_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate on ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def reserve(name: str, size: int, directory: str = SHM_DIR) -> None:
    """Allocate every page of the segment file ``directory/name`` (``size`` bytes) now.

    Raises:
        SharedMemoryTooSmall: the file system has less room than ``size`` (tmpfs returns
            ENOSPC and gives back what it had allocated).
    """
    available = available_bytes(directory)  # before: a failed fallocate frees its pages again
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise SharedMemoryTooSmall(size, available, directory) from None
        raise
    finally:
        os.close(fd)


class OwnerLock:
    """An exclusive ``flock`` on ``<folder>/owner``, held until :meth:`release` or death.

    The file is created and locked under a temporary name and only then renamed to ``owner``:
    a sweep (:func:`owner_gone`) that runs between the creation and the lock would otherwise take
    the free lock for a dead owner's and remove the folder being made. Processes forked from the
    owner (gunicorn workers) share the lock: a folder is not a leftover while any of them lives.

    Raises:
        OSError: ``folder`` cannot be written.
    """

    def __init__(self, folder: str):
        staging = os.path.join(folder, f"{OWNER_FILE}.new")
        self._file = open(staging, "w")
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else can know this file yet
        os.rename(staging, os.path.join(folder, OWNER_FILE))

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if not self._file.closed:
            self._file.close()


def owner_gone(folder: str) -> bool:
    """Whether ``folder`` is a dead owner's: the lock on ``<folder>/owner`` is free, or there is
    no such file and the folder is older than :data:`OWNERLESS_S` (a crash between its creation
    and :class:`OwnerLock`'s rename; a live one is ownerless for microseconds)."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while the owner lives
            return True
    except BlockingIOError:
        return False
    except FileNotFoundError:
        return _older_than(folder, OWNERLESS_S)


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime >= seconds
    except FileNotFoundError:
        return False


def remove_orphans(directory: str = SHM_DIR) -> list[str]:
    """Remove this product's segments (and their ``.d`` folders) whose owner is dead.

    A segment is an orphan when its folder's owner lock is free, or when it has no folder (or its
    folder no owner file) and is older than :data:`OWNERLESS_S`. Returns the removed names.
    """
    removed = []
    for path in glob.glob(os.path.join(directory, PREFIX + "*")):
        name = os.path.basename(path)
        if name.endswith(".d"):
            if os.path.exists(path[:-2]) or not owner_gone(path):
                continue  # its segment decides (below), or it is alive
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
            continue
        folder = path + ".d"
        if not (owner_gone(folder) if os.path.isdir(folder) else _older_than(path, OWNERLESS_S)):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # another starting server removed it first
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(name)
    return removed
