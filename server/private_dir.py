"""Private directories of the gunicorn master: created at start, removed at exit, and removed by
a later start when the master died without removing them (``SIGKILL``, the OOM killer).

The master holds an ``flock`` on the directory's ``.owner`` file for its lifetime
(:class:`shm.segment.OwnerLock`, as the shared-memory segments' folders do); the kernel drops it
when the process dies, however it dies, so a free lock means nobody uses the directory
(flock(2)). Two directories follow this rule: prometheus-client's multiprocess directory
(:mod:`server.observability.metrics_dir`) and the Responses API's SQLite store
(``server.gunicorn_conf``, without ``--redis-url``).
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

from shm.segment import OwnerLock, owner_gone

OWNER = ".owner"
#: A directory without an owner file this old is a leftover (a live one is ownerless only
#: between ``mkdtemp`` and the owner file's rename, microseconds).
OWNERLESS_S = 60.0
_held: dict[str, OwnerLock] = {}  # path -> its owner lock


def create(prefix: str, base: str | None = None) -> str:
    """Remove the orphans of ``prefix`` under ``base`` (default: the system's temporary
    directory), then create a new directory ``<base>/<prefix><random>`` owned by this process.

    Returns:
        its path. Raises: OSError if ``base`` cannot be written.
    """
    base = base or tempfile.gettempdir()
    remove_orphans(prefix, base)
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    _held[path] = OwnerLock(path, OWNER)
    return path


def remove_orphans(prefix: str, base: str) -> list[str]:
    """Remove the directories ``<base>/<prefix>*`` whose owner is gone (``shm.segment.owner_gone``:
    the ``.owner`` lock is free, or there is no owner file and the directory is older than
    :data:`OWNERLESS_S`).

    Returns:
        the removed paths.
    """
    removed = []
    for path in glob.glob(os.path.join(base, glob.escape(prefix) + "*")):
        if owner_gone(path, OWNER, OWNERLESS_S):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove(path: str) -> None:
    """Delete ``path`` and everything in it, and release its owner lock if this process holds it."""
    shutil.rmtree(path, ignore_errors=True)
    owner = _held.pop(path, None)
    if owner is not None:
        owner.release()
