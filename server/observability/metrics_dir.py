"""The directory of prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``).

Every process that records metrics (gunicorn workers, the gRPC sidecar, the engine, the master)
writes its own memory-mapped files there, named ``<type>_<pid>.db``; a scrape adds them up
(prometheus-client, "Multiprocess Mode (E.g. Gunicorn)"). Three rules keep the sums right:

- **Empty at start.** Files left by an earlier run would be added to this run's counters. The
  master (:func:`prepare`) creates a private directory on tmpfs (``/dev/shm``, so the files
  cost no disk writes), or empties the operator's ``PROMETHEUS_MULTIPROC_DIR``, before any
  process that records metrics starts. A later start removes a private directory whose master
  died without removing it (:mod:`server.private_dir`).
- **Live gauges of dead processes go.** :func:`retire` calls ``mark_process_dead``.
- **Dead processes' counts stay, in one file.** A dead worker's counters and histograms still
  count (its requests happened), but a scrape reads every file: after many worker restarts
  it would slow down with each. :func:`retire` adds the dead process's values into
  ``counter_retired.db`` / ``histogram_retired.db`` and deletes its files, so a scrape reads at
  most one file per live process plus two. Scrapes hold a shared ``flock`` on
  ``.lock`` while they read (:func:`read_lock`), and :func:`retire` an exclusive one, so no scrape
  sees a value both in the dead process's file and in the retired file, or in neither.

prometheus-client picks its file-backed values when it is imported, so :func:`prepare` must run
before anything in the process imports it (checked).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import sys
from typing import Iterator

from server import private_dir

ENV = "PROMETHEUS_MULTIPROC_DIR"
TMPFS = "/dev/shm"
PREFIX = "inference-metrics-"
_LOCK = ".lock"
_RETIRED = "retired"


def prepare() -> tuple[str, bool]:
    """Create or empty the directory and export it as ``PROMETHEUS_MULTIPROC_DIR`` for this
    process and its children.

    Returns:
        ``(path, owned)``: ``owned`` when this call created it (then ``server.private_dir.remove`` deletes it).
    Raises:
        RuntimeError: prometheus-client was imported first (its values would not be shared).
    """
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before its multiprocess directory was prepared")
    path = os.environ.get(ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        for f in glob.glob(os.path.join(path, "*.db")):  # only prometheus-client's files
            os.remove(f)
        owned = False
    else:
        path, owned = private_dir.create(PREFIX, TMPFS if os.access(TMPFS, os.W_OK) else None), True
        os.environ[ENV] = path
    open(os.path.join(path, _LOCK), "a").close()
    return path, owned


@contextlib.contextmanager
def _locked(path: str, how: int) -> Iterator[None]:
    with open(os.path.join(path, _LOCK), "a") as f:
        fcntl.flock(f, how)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_lock(path: str):
    """Hold while reading the directory's files for a scrape (shared with other scrapes)."""
    return _locked(path, fcntl.LOCK_SH)


def retire(pid: int, path: str | None = None) -> None:
    """Book-keeping for a process that exited: drop its live gauges and fold its counters and
    histograms into the retired files. Call once the process is gone (its files are final)."""
    from prometheus_client.mmap_dict import MmapedDict
    from prometheus_client.multiprocess import mark_process_dead

    path = path or os.environ.get(ENV)
    if not path:
        return
    mark_process_dead(pid, path)
    with _locked(path, fcntl.LOCK_EX):
        for typ in ("counter", "histogram"):
            dead = os.path.join(path, f"{typ}_{pid}.db")
            if not os.path.exists(dead):
                continue
            retired = MmapedDict(os.path.join(path, f"{typ}_{_RETIRED}.db"))
            try:
                # Raw per-key sums are exact: histogram buckets are stored per bucket (not
                # cumulative) in these files, so adding them is what a scrape does anyway.
                for key, value, _, _ in MmapedDict.read_all_values_from_file(dead):
                    retired.write_value(key, retired.read_value(key)[0] + value, 0.0)
            finally:
                retired.close()
            os.remove(dead)
