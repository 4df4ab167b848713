"""The control block: the engine's state and the per-step slot table, written by the engine only.

The heartbeat is the time of the engine's last progress: the end of a step, or, inside a long
decode, the last graph node llama.cpp computed (:meth:`ControlBlock.beat`). The watchdog and
readiness read it, so an engine that works through a long step is neither killed nor reported
unready, and one that makes no progress (stopped, deadlocked) is.

The slot table is published under a seqlock: the writer sets ``publishing``, rewrites the
fields, stores the new ``step`` and clears ``publishing``; a reader that saw ``publishing`` 0
before and after and the same ``step`` both times holds a consistent snapshot.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from shm.layout import EngineState


@dataclass(frozen=True)
class Snapshot:
    """The engine's slot table as of one completed step.

    Attributes:
        step: the step number. slot_mailbox: ``[max_slots]`` mailbox index per KV slot (-1:
        free). kv_pos_max: ``[max_slots]`` highest KV position per slot (-1: no cells).
        n_waiting: sequences queued in the engine.
        cache_entries, cache_tokens: prefix-cache entries and the tokens they hold.
        cache_kv_pos_max: ``[cache streams]`` highest KV position per cache stream (-1: none).
        kv_cells: KV cells the running sequences hold or are promised.
        preemptions: sequences preempted so far, for the KV budget or a tenant's fair share of slots.
    """

    step: int
    slot_mailbox: list[int]
    kv_pos_max: list[int]
    n_waiting: int
    cache_entries: int = 0
    cache_tokens: int = 0
    cache_kv_pos_max: list[int] = ()
    kv_cells: int = 0
    preemptions: int = 0


class ControlBlock:
    """Verbs over the segment's one-record ``control`` array."""

    def __init__(self, control: np.ndarray):
        self._c = control[0]
        self._heartbeat = control["heartbeat"]  # a one-element view: the cheapest store (beat())

    # -- engine state (engine process and its supervisor) ----------------------------------------
    @property
    def state(self) -> EngineState:
        return EngineState(int(self._c["engine_state"]))

    def set_state(self, state: EngineState, pid: int | None = None) -> None:
        if pid is not None:
            self._c["engine_pid"] = pid
        if state == EngineState.READY:
            self._c["heartbeat"] = time.monotonic()  # ready means "stepped just now"
        self._c["engine_state"] = state

    @property
    def engine_pid(self) -> int:
        return int(self._c["engine_pid"])

    def beat(self) -> None:
        """The engine made progress inside a step (called from the decode's progress hook)."""
        self._heartbeat[0] = time.monotonic()

    def seconds_since_progress(self) -> float:
        """Seconds since the engine last completed a step or, within a decode, a graph node."""
        return time.monotonic() - float(self._heartbeat[0])

    def ready(self, stall_s: float) -> bool:
        """The engine is READY and made progress within ``stall_s`` seconds."""
        return self.state == EngineState.READY and self.seconds_since_progress() < stall_s

    # -- what an embedding engine computes (engine process) ------------------------------------
    def set_n_embd(self, n_embd: int) -> None:
        """An embedding engine's vector dimension, set once its model loaded (before READY)."""
        self._c["n_embd"] = n_embd

    @property
    def n_embd(self) -> int:
        """The embedding engine's vector dimension; 0 before it loaded, and for a generation engine."""
        return int(self._c["n_embd"])

    # -- the server's drain (gunicorn master) ------------------------------------------------------
    def start_draining(self) -> None:
        self._c["draining"] = 1

    @property
    def draining(self) -> bool:
        return bool(self._c["draining"])

    # -- per-step publication (engine) -----------------------------------------------------------
    @property
    def step(self) -> int:
        """The last completed step number."""
        return int(self._c["step"])

    def count_kv_move(self) -> None:
        self._c["kv_moves"] += 1

    @property
    def kv_moves(self) -> int:
        return int(self._c["kv_moves"])

    def count_preemption(self) -> None:
        self._c["preemptions"] += 1

    @property
    def preemptions(self) -> int:
        """Running sequences preempted (requeued) since the segment was made: for the KV budget or
        a tenant's fair share of slots."""
        return int(self._c["preemptions"])

    def publish(self, step: int, slot_mailbox, kv_pos_max, n_waiting: int,
                cache_entries: int = 0, cache_tokens: int = 0, cache_kv_pos_max=(), kv_cells: int = 0) -> None:
        """Seqlock writer: the slot table, queue sizes and prefix-cache occupancy as of
        ``step``; also the heartbeat."""
        c = self._c
        c["publishing"] = 1
        c["heartbeat"] = time.monotonic()
        c["n_waiting"] = n_waiting
        c["slot_mailbox"] = slot_mailbox
        c["slot_kv_pos_max"] = kv_pos_max
        c["cache_entries"], c["cache_tokens"] = cache_entries, cache_tokens
        c["kv_cells"] = kv_cells
        c["cache_kv_pos_max"] = -1
        c["cache_kv_pos_max"][:len(cache_kv_pos_max)] = cache_kv_pos_max
        c["step"] = step
        c["publishing"] = 0

    def clear_slots(self) -> None:
        """After the engine died: no slot is held (its supervisor's view)."""
        self._c["slot_mailbox"] = -1

    def snapshot(self) -> Snapshot:
        """Seqlock reader: a consistent :class:`Snapshot` of the last completed step."""
        c = self._c
        while True:
            step = int(c["step"])
            if not c["publishing"]:
                snap = Snapshot(step, c["slot_mailbox"].tolist(), c["slot_kv_pos_max"].tolist(),
                                int(c["n_waiting"]), int(c["cache_entries"]),
                                int(c["cache_tokens"]), c["cache_kv_pos_max"].tolist(), int(c["kv_cells"]),
                                int(c["preemptions"]))
                if not c["publishing"] and int(c["step"]) == step:
                    return snap
            time.sleep(0)
