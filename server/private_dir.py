"""Private directories of the gunicorn master: created at start, removed at exit, and removed by
a later start when the master died without removing them (``SIGKILL``, the OOM killer).

The master holds an ``flock`` on the directory's ``.owner`` file for its lifetime; the kernel
drops it when the process dies, however it dies, so a free lock means nobody uses the
directory (flock(2)). Two directories follow this rule: prometheus-client's multiprocess
directory (:mod:`server.observability.metrics_dir`) and the Responses API's SQLite store
(``server.gunicorn_conf``, without ``--redis-url``). The shared-memory segments hold the same
kind of lock on themselves (:mod:`shm.segment`).
"""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
import time
from typing import IO

OWNER = ".owner"
#: A directory without an owner file this old is a leftover (a live one is ownerless only
#: between ``mkdtemp`` and the owner file's rename, microseconds).
OWNERLESS_S = 60.0
_held: dict[str, IO] = {}  # path -> its open owner file (the flock lives as long as it does)


def create(prefix: str, base: str | None = None) -> str:
    """Remove the orphans of ``prefix`` under ``base`` (default: the system's temporary
    directory), then create a new directory ``<base>/<prefix><random>`` owned by this process.

    Returns:
        its path. Raises: OSError if ``base`` cannot be written.
    """
    base = base or tempfile.gettempdir()
    remove_orphans(prefix, base)
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    # Locked before it has its name: a sweep by another start in between would otherwise find
    # the lock free and remove the directory being made (shm.segment.OwnerLock does the same;
    # server/ does not import shm/).
    owner = open(os.path.join(path, OWNER + ".new"), "w")
    fcntl.flock(owner, fcntl.LOCK_EX)
    os.rename(owner.name, os.path.join(path, OWNER))
    _held[path] = owner
    return path


def remove_orphans(prefix: str, base: str) -> list[str]:
    """Remove the directories ``<base>/<prefix>*`` whose owner is gone (the ``.owner`` lock is
    free, or there is no owner file and the directory is older than :data:`OWNERLESS_S`).

    Returns:
        the removed paths.
    """
    removed = []
    for path in glob.glob(os.path.join(base, glob.escape(prefix) + "*")):
        try:
            with open(os.path.join(path, OWNER)) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while the owner lives
        except BlockingIOError:
            continue
        except FileNotFoundError:
            try:
                if time.time() - os.stat(path).st_mtime < OWNERLESS_S:
                    continue
            except FileNotFoundError:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove(path: str) -> None:
    """Delete ``path`` and everything in it, and release its owner lock if this process holds it."""
    shutil.rmtree(path, ignore_errors=True)
    owner = _held.pop(path, None)
    if owner is not None:
        owner.close()
