"""Result mailboxes: leased by a front-end thread, written by the engine, read by that thread.

State machine of one mailbox (``state`` field)::

    FREE --lease--> LEASED --submit--> QUEUED --admit--> RUNNING --retire--> DONE --release--> FREE

Only the lease holder moves LEASED->QUEUED and DONE->FREE; only the engine (or, when the engine
died, its supervisor) moves QUEUED/RUNNING->DONE. ``generation`` grows at every lease, so a
record or reader that names an older generation is recognised as stale and ignored.
"""
from __future__ import annotations

import os

import numpy as np

from shm.layout import (DONE, ERR_NONE, FINISH_ERROR, FINISH_NONE, FREE, LEASED, QUEUED,
                        RUNNING)
from shm.transport import Transport


class Mailboxes:
    """Lease bookkeeping over a transport's mailbox array."""

    def __init__(self, transport: Transport):
        self.t = transport

    def lease(self) -> tuple[int, int] | None:
        """Take a free mailbox for this process.

        Returns:
            ``(index, generation)``, or None when every mailbox is in use (server saturated).
        """
        mb = self.t.mailboxes
        with self.t.lock:
            free = np.flatnonzero(mb["state"] == FREE)
            if free.size == 0:
                return None
            i = int(free[0])
            generation = int(mb["generation"][i]) + 1
            box = mb[i]
            box["generation"] = generation
            box["owner_pid"] = os.getpid()
            box["cancel"] = 0
            box["n_tokens"] = 0
            box["finish"] = FINISH_NONE
            box["error"] = ERR_NONE
            box["slot"] = -1
            box["step_admitted"] = box["step_finished"] = 0
            for field in ("t_queued", "t_admitted", "t_first_token", "t_finished", "t_prefill_done"):
                box[field] = 0.0
            box["state"] = LEASED
        self.t.bells.drain(i)  # wake-ups left over from the previous lease
        return i, generation

    def release(self, index: int, generation: int) -> None:
        """Give back a mailbox whose request is DONE (or was never submitted)."""
        mb = self.t.mailboxes
        with self.t.lock:
            if int(mb["generation"][index]) == generation:
                mb["owner_pid"][index] = 0
                mb["state"][index] = FREE

    def in_use(self) -> int:
        """Number of mailboxes not FREE."""
        return int(np.count_nonzero(self.t.mailboxes["state"] != FREE))

    def reclaim(self, is_alive) -> list[int]:
        """Recover the leases of dead owners (called by the supervisor, periodically).

        A dead owner's LEASED or DONE mailbox is freed at once; a QUEUED or RUNNING one gets its
        cancel flag, so the engine retires it and a later call frees it.

        Args:
            is_alive: ``pid -> bool``.
        Returns:
            indices freed by this call.
        """
        mb = self.t.mailboxes
        freed = []
        with self.t.lock:
            for i in np.flatnonzero(mb["state"] != FREE):
                pid = int(mb["owner_pid"][i])
                if pid == 0 or is_alive(pid):
                    continue
                state = int(mb["state"][i])
                if state in (LEASED, DONE):
                    mb["owner_pid"][i] = 0
                    mb["state"][i] = FREE
                    freed.append(int(i))
                else:
                    mb["cancel"][i] = 1
        return freed

    def fail_in_flight(self, error: int) -> int:
        """Finish every QUEUED/RUNNING mailbox with ``error`` and wake its reader.

        Called by the supervisor when the engine process died, so no client waits forever.
        Returns the number failed.
        """
        mb = self.t.mailboxes
        failed = []
        with self.t.lock:
            for i in np.flatnonzero((mb["state"] == QUEUED) | (mb["state"] == RUNNING)):
                mb["error"][i] = error
                mb["finish"][i] = FINISH_ERROR
                mb["state"][i] = DONE
                failed.append(int(i))
        for i in failed:
            self.t.bells.ring(i)
        return len(failed)
