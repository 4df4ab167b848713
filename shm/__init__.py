"""Shared-memory transport between the front ends and the engine (docs/architecture.md,
"Shared memory").

One ``multiprocessing.shared_memory`` segment holds fixed-size numpy structured arrays, used
only through the verbs of three objects:

* :class:`shm.control.ControlBlock`: engine state, heartbeat and the per-step slot table
  (a seqlock: ``publish`` / ``snapshot``);
* :class:`shm.ring.RequestRing`: many producers push fixed-size request records, one consumer
  (the engine) pops them; the payload's format belongs to ``engine.request``;
* :class:`shm.mailbox.Mailboxes`: one result mailbox per in-flight request, leased by a
  front-end thread, written only by the engine, read only by that thread. Its module docstring
  holds the publication and memory-ordering rule; no other module writes a mailbox.

Wake-ups are named FIFOs (:mod:`shm.wakeup`) next to the segment, so a reader can ``poll()``
its mailboxes and its client's socket at once and never sleep-polls. Cross-process mutual
exclusion uses ``fcntl.flock`` (:mod:`shm.lock`): the kernel releases it when its holder dies.
"""
from shm.layout import ErrorCode, EngineState, Finish, Layout, MailboxState
from shm.mailbox import Lease, Outcome, Published
from shm.transport import Transport

__all__ = ["EngineState", "ErrorCode", "Finish", "Layout", "Lease", "MailboxState", "Outcome",
           "Published", "Transport"]
