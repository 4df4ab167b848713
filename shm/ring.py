"""The request ring: many producers push fixed-size records, one consumer (the engine) pops."""
from __future__ import annotations

from typing import Callable

import numpy as np

from shm.transport import Transport
from shm.wakeup import Doorbells


class RingFull(RuntimeError):
    """No free record: cannot happen while every producer holds a mailbox lease (capacity =
    number of mailboxes), so seeing it means a producer pushed without a lease."""


class RequestRing:
    """Producers serialize on the transport's flock; the single consumer needs no lock.

    ``ring_tail`` (producers) and ``ring_head`` (consumer) live in the control block; the
    record at ``tail % capacity`` is written before ``tail`` is advanced (see :mod:`shm`).
    """

    def __init__(self, transport: Transport):
        self.t = transport
        self.capacity = len(transport.ring)

    def push(self, fill: Callable[[np.void], None]) -> None:
        """Write one record with ``fill(record)`` and publish it, then wake the engine.

        Raises:
            RingFull: every record is still unread.
        """
        control = self.t.control
        with self.t.lock:
            tail = int(control["ring_tail"][0])
            if tail - int(control["ring_head"][0]) >= self.capacity:
                raise RingFull("request ring is full")
            fill(self.t.ring[tail % self.capacity])
            control["ring_tail"][0] = tail + 1
        self.t.bells.ring(Doorbells.ENGINE)

    def pop_all(self) -> list[np.void]:
        """Consumer only: copy out every published record and free their places."""
        control = self.t.control
        head, tail = int(control["ring_head"][0]), int(control["ring_tail"][0])
        records = [self.t.ring[i % self.capacity].copy() for i in range(head, tail)]
        control["ring_head"][0] = tail
        return records

    def reset(self) -> None:
        """Drop unread records (after an engine crash, whose requests were failed)."""
        with self.t.lock:
            self.t.control["ring_head"][0] = self.t.control["ring_tail"][0]
