"""Fixed layout of the shared segment: numpy structured dtypes sized from configuration, and the
ordered states and codes stored in it (see docs/architecture.md, "Shared memory")."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from shm.buckets import BUCKET_DTYPE

#: Most alternatives per generated token a mailbox can hold (OpenAI caps top_logprobs at 20).
MAX_TOP_LOGPROBS = 20
#: Token buckets the node's processes share (two per rate-limited tenant; see shm.buckets).
N_BUCKETS = 4096


class MailboxState(IntEnum):
    """A mailbox's life cycle, in order (diagram in :mod:`shm.mailbox`)."""

    FREE = 0
    LEASED = 1
    QUEUED = 2
    RUNNING = 3
    DONE = 4


class Finish(IntEnum):
    """Why the engine finished a sequence. ``NONE`` while it runs."""

    NONE = 0
    STOP = 1  # an end-of-generation or stop token
    LENGTH = 2  # max_new_tokens
    DEADLINE = 3
    CANCELLED = 4
    ERROR = 5  # see ErrorCode


class ErrorCode(IntEnum):
    """Carried with :attr:`Finish.ERROR`."""

    NONE = 0
    ENGINE_DIED = 1
    BAD_REQUEST = 2
    SHUTDOWN = 3
    DECODE = 4
    CONSTRAINT = 5  #: the sequence's grammar refused every token left (engine/llama/grammar.py)


class EngineState(IntEnum):
    """The engine process's state in the control block. ``STOPPED``: exited because it was asked
    to; ``DEAD``: crashed (or its supervisor saw it gone without ``STOPPED``); ``FAILED``: could
    not load the model, which a restart would not change."""

    STARTING = 0
    READY = 1
    DEAD = 2
    STOPPED = 3
    FAILED = 4


@dataclass(frozen=True)
class Layout:
    """Sizes of every array in the segment.

    Attributes:
        max_slots: KV slots (= llama ``seq_id`` values) the engine decodes at once.
        n_mailboxes: in-flight requests (``max_slots + max_queued``); also the ring capacity,
            so a producer holding a mailbox always finds a free ring record.
        max_seq_len: tokens per sequence, prompt plus generation (the per-slot KV cells).
        record_bytes: payload bytes of one request-ring record. The transport does not know what
            a request is; ``engine.request.EngineRequest`` defines the payload's format.
        cache_streams: KV streams of the engine's prefix cache (their occupancy is published).
        embed: the engine computes embeddings (``EngineConfig.kind`` ``embed``): a mailbox's
            ``logprobs`` row holds its input's vector (:meth:`shm.mailbox.Mailboxes.publish_vector`),
            and the top-logprob arrays have no room (``[n_mailboxes, max_seq_len, 0]``).
    Raises:
        ValueError: on a non-positive size.
    """

    max_slots: int
    n_mailboxes: int
    max_seq_len: int
    record_bytes: int
    cache_streams: int = 0
    embed: bool = False

    def __post_init__(self):
        for field in ("max_slots", "n_mailboxes", "max_seq_len", "record_bytes"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.n_mailboxes < self.max_slots:
            raise ValueError("n_mailboxes must be >= max_slots")
        if self.cache_streams < 0:
            raise ValueError(f"cache_streams must be >= 0, got {self.cache_streams}")

    def control_dtype(self) -> np.dtype:
        return np.dtype([
            # "publishing" is 1 while the engine rewrites the fields below and "step" changes
            # last: a reader whose "step" did not move and who saw "publishing" 0 before and
            # after holds a consistent snapshot (a seqlock; shm.control).
            ("engine_state", np.int32), ("engine_pid", np.int64), ("step", np.uint64),
            ("publishing", np.int32),
            ("heartbeat", np.float64),  # time.monotonic() at the engine's last progress (shm.control)
            ("kv_moves", np.uint64),  # sequences moved down to close a gap in the slots
            ("preemptions", np.uint64),  # running sequences requeued for the KV budget
            ("kv_cells", np.int64),  # KV cells the running sequences hold or are promised
            ("n_waiting", np.int32),
            ("ring_head", np.uint64), ("ring_tail", np.uint64),
            # slot -> mailbox index (-1: free) and the slot's highest KV position (-1: empty),
            # refreshed by the engine every step, read by tests and metrics.
            ("slot_mailbox", np.int32, (self.max_slots,)),
            ("slot_kv_pos_max", np.int32, (self.max_slots,)),
            # The prefix cache: entries, tokens they hold, and each cache stream's highest KV
            # position (one stays -1 when there are none).
            ("cache_entries", np.int32), ("cache_tokens", np.int64),
            ("cache_kv_pos_max", np.int32, (max(self.cache_streams, 1),)),
            # 1 from the server's SIGTERM on: front ends refuse new requests, readiness is 503.
            ("draining", np.int32),
            # An embedding engine's vector dimension (llama_model_n_embd_out), set before it is
            # ready; 0 for a generation engine.
            ("n_embd", np.int32),
        ])

    def record_dtype(self) -> np.dtype:
        """One request-ring record: the mailbox lease it answers to, then the request's bytes."""
        return np.dtype([("mailbox", np.int32), ("lease", np.uint64),
                         ("payload", np.uint8, (self.record_bytes,))])

    def mailbox_dtype(self) -> np.dtype:
        return np.dtype([
            ("state", np.int32), ("lease", np.uint64), ("owner_pid", np.int64),
            ("tenant", np.int64),  # the lease holder's tenant (per-tenant concurrency limits)
            ("cancel", np.int32), ("n_tokens", np.int32), ("finish", np.int32),
            ("error", np.int32), ("n_prompt", np.int32), ("slot", np.int32),
            ("n_cached", np.int32),  # prompt tokens reused from the prefix cache (at admission)
            # prompt positions whose log-probabilities are published (scoring; shm.mailbox)
            ("n_prompt_logprobs", np.int32),
            # time.monotonic() seconds, for queue-wait / TTFT / latency metrics.
            ("t_queued", np.float64), ("t_admitted", np.float64),
            ("t_first_token", np.float64), ("t_finished", np.float64),
            ("t_prefill_done", np.float64),
            # engine step numbers (control "step") at admission and at retirement.
            ("step_admitted", np.uint64), ("step_finished", np.uint64),
        ])

    def arrays(self) -> list[tuple[str, np.dtype, tuple]]:
        """(name, dtype, shape) of every array, in segment order."""
        n, s, k = self.n_mailboxes, self.max_seq_len, 0 if self.embed else MAX_TOP_LOGPROBS
        return [
            ("control", self.control_dtype(), (1,)),
            ("ring", self.record_dtype(), (self.n_mailboxes,)),
            ("mailboxes", self.mailbox_dtype(), (n,)),
            ("tokens", np.dtype(np.int32), (n, s)),
            ("logprobs", np.dtype(np.float32), (n, s)),
            ("top_ids", np.dtype(np.int32), (n, s, k)),
            ("top_logprobs", np.dtype(np.float32), (n, s, k)),
            ("buckets", BUCKET_DTYPE, (N_BUCKETS,)),
        ]

    def offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of each array (64-byte aligned) and the total segment size."""
        offsets, pos = {}, 0
        for name, dtype, shape in self.arrays():
            pos = (pos + 63) // 64 * 64
            offsets[name] = pos
            pos += dtype.itemsize * int(np.prod(shape))
        return offsets, pos
