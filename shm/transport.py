"""Create or attach the shared segment and expose its arrays as numpy views."""
from __future__ import annotations

import os
import secrets
import shutil
import sys
import threading
from types import SimpleNamespace
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from shm.buckets import SharedBuckets
from shm.control import ControlBlock
from shm.layout import Layout
from shm.lock import FlockLock
from shm import segment
from shm.mailbox import Mailboxes
from shm.ring import RequestRing
from shm.wakeup import Wakeups

_MAGIC = 0x494E4652  # "INFR"
_META = np.dtype([("magic", np.uint32), ("max_slots", np.int32),
                  ("n_mailboxes", np.int32), ("max_seq_len", np.int32), ("record_bytes", np.int32),
                  ("cache_streams", np.int32), ("embed", np.int32)])
_META_BYTES = 64
SHM_DIR = segment.SHM_DIR


class Transport:
    """One shared segment plus its FIFO/lock folder ``/dev/shm/<name>.d``.

    Use :meth:`create` in the process that owns the transport (it unlinks everything in
    :meth:`close`) and :meth:`attach` everywhere else. The segment's arrays (``control``,
    ``ring``, ``mailboxes``, ``tokens`` ``[n_mailboxes, max_seq_len]``, ``logprobs``,
    ``top_ids`` and ``top_logprobs`` ``[n_mailboxes, max_seq_len, 20]``, 0 wide for an embedding
    engine) are numpy views used
    through the verbs of four objects: :attr:`control` (:class:`shm.control.ControlBlock`),
    :attr:`ring` (:class:`shm.ring.RequestRing`), :attr:`mailboxes`
    (:class:`shm.mailbox.Mailboxes`) and :attr:`buckets` (:class:`shm.buckets.SharedBuckets`).
    """

    def __init__(self, shm: shared_memory.SharedMemory, layout: Layout, owner: bool):
        self.name = shm.name
        self.layout = layout
        self.owner = owner
        self._shm = shm
        self._owner_lock: segment.OwnerLock | None = None
        self.directory = os.path.join(SHM_DIR, f"{shm.name}.d")
        offsets, _ = layout.offsets()
        views = SimpleNamespace(**{
            name: np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=_META_BYTES + offsets[name])
            for name, dtype, shape in layout.arrays()})
        self.lock = FlockLock(os.path.join(self.directory, "lock"))
        self.wakeups = Wakeups(self.directory, layout.n_mailboxes)
        self.control = ControlBlock(views.control)
        self.ring = RequestRing(views.ring, views.control, self.lock)
        self.mailboxes = Mailboxes(views, self.ring, self.lock, self.wakeups)
        self.buckets = SharedBuckets(views.buckets, self.lock)

    @classmethod
    def create(cls, layout: Layout, name: str | None = None) -> "Transport":
        """Allocate and zero a new segment, every page reserved (``shm.segment``), after removing
        the segments of dead owners. This process holds the segment's owner lock until
        :meth:`close`.

        Raises:
            FileExistsError: a segment of that name exists.
            shm.segment.SharedMemoryTooSmall: ``/dev/shm`` has less room than the segment.
        """
        name = name or f"{segment.PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        size = _META_BYTES + layout.offsets()[1]
        segment.remove_orphans(SHM_DIR)
        directory = os.path.join(SHM_DIR, f"{name}.d")
        os.mkdir(directory, 0o700)  # first, with the owner lock: no sweep takes a segment being made
        shm = None
        try:
            owner = segment.OwnerLock(directory)
            # The creator stays registered with Python's resource tracker, which unlinks the
            # segment should this process die without closing it.
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            segment.reserve(name, size, SHM_DIR)
            transport = cls(shm, layout, owner=True)
            transport._owner_lock = owner
            transport.wakeups.create_all()
        except BaseException:
            if shm is not None:
                shm.close()
                shm.unlink()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        np.ndarray((), _META, buffer=shm.buf)[()] = (_MAGIC, layout.max_slots, layout.n_mailboxes,
                                                     layout.max_seq_len, layout.record_bytes,
                                                     layout.cache_streams, layout.embed)
        transport.mailboxes.boxes["slot"] = -1
        transport.control.publish(0, -1, -1, 0)
        return transport

    @classmethod
    def attach(cls, name: str) -> "Transport":
        """Map an existing segment by name; its layout is read from its header.

        Raises:
            FileNotFoundError: no such segment.
            ValueError: the segment is not one of ours.
        """
        shm = _attach(name)
        meta = np.ndarray((), _META, buffer=shm.buf)[()]
        if int(meta["magic"]) != _MAGIC:
            shm.close()
            raise ValueError(f"shared memory segment {name!r} is not an inference transport")
        layout = Layout(int(meta["max_slots"]), int(meta["n_mailboxes"]), int(meta["max_seq_len"]),
                        int(meta["record_bytes"]), int(meta["cache_streams"]), bool(meta["embed"]))
        return cls(shm, layout, owner=False)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment and removes its folder. Idempotent."""
        if self._shm is None:
            return
        self.wakeups.close()
        self.lock.close()
        self.ring = self.mailboxes = self.control = self.buckets = None  # drop the views before unmapping
        shm, self._shm = self._shm, None
        try:
            shm.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes with the process
        if self.owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
            shutil.rmtree(self.directory, ignore_errors=True)
            self._owner_lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: Held while :func:`_attach` has Python's resource tracker's ``register`` swapped out.
_UNTRACKED = threading.Lock()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map the existing segment ``name`` without registering it with Python's resource tracker.
    Only the creator owns a segment; Python < 3.13 registers attachers too (cpython issue
    #82300), and an attacher's tracker would unlink the segment when that process exits. Never
    registering also spares a process that only attaches (the engine, the gRPC sidecar) a
    resource-tracker process of its own, 7 MB of resident memory. Python 3.13 says so with
    ``track=False``; before it, ``SharedMemory`` looks ``register`` up in its module at each call.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    with _UNTRACKED:
        register, resource_tracker.register = resource_tracker.register, lambda *_: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register
