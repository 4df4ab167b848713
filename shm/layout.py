"""Fixed layout of the shared segment: numpy structured dtypes sized from configuration."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Most alternatives per generated token a request may ask for (OpenAI caps top_logprobs at 20).
MAX_TOP_LOGPROBS = 20
#: Most request-specific stop token ids carried in one ring record.
MAX_STOP_IDS = 8

# Mailbox states.
FREE, LEASED, QUEUED, RUNNING, DONE = range(5)
# Finish reasons written by the engine (index into FINISH_REASONS).
FINISH_REASONS = ("", "stop", "length", "deadline", "cancelled", "error")
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_DEADLINE, FINISH_CANCELLED, FINISH_ERROR = range(6)
# Error codes carried with FINISH_ERROR.
ERR_NONE, ERR_ENGINE_DIED, ERR_BAD_REQUEST, ERR_SHUTDOWN, ERR_DECODE = range(5)
# Engine states in the control block. STOPPED: exited because it was asked to; DEAD: crashed
# (or its supervisor saw it gone without STOPPED).
ENGINE_STARTING, ENGINE_READY, ENGINE_DEAD, ENGINE_STOPPED = range(4)
# Priority classes, in admission order.
PRIORITIES = ("high", "normal", "low")


@dataclass(frozen=True)
class Layout:
    """Sizes of every array in the segment.

    Attributes:
        max_slots: KV slots (= llama ``seq_id`` values) the engine decodes at once.
        n_mailboxes: in-flight requests (``max_slots + max_queued``); also the ring capacity,
            so a producer holding a mailbox always finds a free ring record.
        max_seq_len: tokens per sequence, prompt plus generation (the per-slot KV cells).
    Raises:
        ValueError: on a non-positive size.
    """

    max_slots: int
    n_mailboxes: int
    max_seq_len: int

    def __post_init__(self):
        for field in ("max_slots", "n_mailboxes", "max_seq_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.n_mailboxes < self.max_slots:
            raise ValueError("n_mailboxes must be >= max_slots")

    def control_dtype(self) -> np.dtype:
        return np.dtype([
            # "publishing" is 1 while the engine rewrites the fields below and "step" changes
            # last: a reader whose "step" did not move and who saw "publishing" 0 before and
            # after holds a consistent snapshot (a seqlock).
            ("engine_state", np.int32), ("engine_pid", np.int64), ("step", np.uint64),
            ("publishing", np.int32),
            ("heartbeat", np.float64),  # time.monotonic() at the engine's last step
            ("kv_moves", np.uint64),  # sequences moved down to close a gap in the slots
            ("n_waiting", np.int32), ("n_running", np.int32),
            ("ring_head", np.uint64), ("ring_tail", np.uint64),
            # slot -> mailbox index (-1: free) and the slot's highest KV position (-1: empty),
            # refreshed by the engine every step, read by tests and metrics.
            ("slot_mailbox", np.int32, (self.max_slots,)),
            ("slot_kv_pos_max", np.int32, (self.max_slots,)),
        ])

    def record_dtype(self) -> np.dtype:
        """One request-ring record: header then prompt token ids."""
        return np.dtype([
            ("mailbox", np.int32), ("generation", np.uint64), ("tenant", np.int32),
            ("weight", np.float32), ("priority", np.int8), ("ignore_eos", np.int8),
            ("n_logprobs", np.int8),  # -1: none; 0..20: sampled token's logprob + top-n
            ("n_prompt", np.int32), ("max_new_tokens", np.int32),
            ("deadline", np.float64),  # time.monotonic() seconds; 0: none
            ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
            ("min_p", np.float32), ("repeat_penalty", np.float32),
            ("presence_penalty", np.float32), ("frequency_penalty", np.float32),
            ("penalty_last_n", np.int32), ("seed", np.uint32),
            ("n_stop", np.int32), ("stop_ids", np.int32, (MAX_STOP_IDS,)),
            ("prompt", np.int32, (self.max_seq_len,)),
        ])

    def mailbox_dtype(self) -> np.dtype:
        return np.dtype([
            ("state", np.int32), ("generation", np.uint64), ("owner_pid", np.int64),
            ("cancel", np.int32), ("n_tokens", np.int32), ("finish", np.int32),
            ("error", np.int32), ("n_prompt", np.int32), ("slot", np.int32),
            # time.monotonic() seconds, for queue-wait / TTFT / latency metrics.
            ("t_queued", np.float64), ("t_admitted", np.float64),
            ("t_first_token", np.float64), ("t_finished", np.float64),
            ("t_prefill_done", np.float64),
            # engine step numbers (control "step") at admission and at retirement.
            ("step_admitted", np.uint64), ("step_finished", np.uint64),
        ])

    def arrays(self) -> list[tuple[str, np.dtype, tuple]]:
        """(name, dtype, shape) of every array, in segment order."""
        n, s, k = self.n_mailboxes, self.max_seq_len, MAX_TOP_LOGPROBS
        return [
            ("control", self.control_dtype(), (1,)),
            ("ring", self.record_dtype(), (self.n_mailboxes,)),
            ("mailboxes", self.mailbox_dtype(), (n,)),
            ("tokens", np.dtype(np.int32), (n, s)),
            ("logprobs", np.dtype(np.float32), (n, s)),
            ("top_ids", np.dtype(np.int32), (n, s, k)),
            ("top_logprobs", np.dtype(np.float32), (n, s, k)),
        ]

    def offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of each array (64-byte aligned) and the total segment size."""
        offsets, pos = {}, 0
        for name, dtype, shape in self.arrays():
            pos = (pos + 63) // 64 * 64
            offsets[name] = pos
            pos += dtype.itemsize * int(np.prod(shape))
        return offsets, pos
