"""The request ring: many producers push fixed-size records, one consumer (the engine) pops."""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from shm.lock import FlockLock


class RingFull(RuntimeError):
    """No free record: cannot happen while every producer holds a mailbox lease (capacity =
    number of mailboxes), so seeing it means a producer pushed without a lease."""


class Record(NamedTuple):
    """One popped record: the mailbox and lease it answers to, and a copy of its payload."""

    mailbox: int
    lease: int
    payload: np.ndarray


class RequestRing:
    """Producers serialize on the transport's flock; the single consumer needs no lock.

    ``ring_tail`` (producers) and ``ring_head`` (consumer) live in the control block; the
    record at ``tail % capacity`` is written before ``tail`` is advanced, and a record is reused
    only after the consumer moved ``head`` past it.
    """

    def __init__(self, records: np.ndarray, control: np.ndarray, lock: FlockLock):
        self.records, self.capacity = records, len(records)
        self._c, self._lock = control[0], lock

    def push(self, mailbox: int, lease: int, write: Callable[[np.ndarray], None]) -> None:
        """Write one record (``write(payload)`` fills its bytes) and publish it. The caller
        wakes the engine.

        Raises:
            RingFull: every record is still unread.
        """
        c = self._c
        with self._lock:
            tail = int(c["ring_tail"])
            if tail - int(c["ring_head"]) >= self.capacity:
                raise RingFull("request ring is full")
            rec = self.records[tail % self.capacity]
            rec["mailbox"], rec["lease"] = mailbox, lease
            write(rec["payload"])
            c["ring_tail"] = tail + 1

    def pop_all(self) -> list[Record]:
        """Consumer only: copy out every published record and free their places."""
        c = self._c
        head, tail = int(c["ring_head"]), int(c["ring_tail"])
        out = []
        for i in range(head, tail):
            rec = self.records[i % self.capacity]
            out.append(Record(int(rec["mailbox"]), int(rec["lease"]), rec["payload"].copy()))
        c["ring_head"] = tail
        return out

    def reset(self) -> None:
        """Drop unread records (after an engine crash, whose requests were failed)."""
        with self._lock:
            self._c["ring_head"] = self._c["ring_tail"]
