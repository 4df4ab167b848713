"""Shared-memory transport between the front ends and the engine (DESIGN.md section 3).

One ``multiprocessing.shared_memory`` segment holds, as fixed-size numpy structured arrays:

* a control block (engine state and pid, step counter, slot table),
* the request ring: many producers (front-end threads) push fixed-size records holding a
  request's header and prompt token ids; one consumer (the engine) pops them,
* the result mailboxes: one per in-flight request, leased by the front-end thread that submits
  it, written only by the engine, read only by that thread.

Wake-ups are named FIFOs (``mkfifo``) next to the segment, so a reader can ``poll()`` its
mailbox and its client's socket at once and never sleep-polls.

Publication and memory-ordering rule
------------------------------------
Every writer publishes in this order: **write the data, then the counter (or state), then
ring the wake-up**. Every reader reads **after** its wake-up: it drains the FIFO, then reads
the counter, then reads only the data the counter covers. The ``write(2)`` that rings and the
``poll(2)``/``read(2)`` that wakes are system calls and act as full memory barriers; between
them, x86-64 stores are seen in program order (TSO), so a counter seen by a reader never runs
ahead of the data it covers. Data behind a counter is never rewritten while the counter covers
it: mailboxes hold the whole generation (no wrap-around) and a ring record is reused only after
the consumer moved ``head`` past it.

Cross-process mutual exclusion uses ``fcntl.flock`` on a file in the segment's directory: the
kernel releases it when its holder dies, so a producer SIGKILLed inside its critical section
cannot freeze the others (a ``multiprocessing.Lock`` would stay held forever).
"""
from shm.layout import Layout
from shm.transport import Transport

__all__ = ["Layout", "Transport"]
