"""The shared-memory transport alone (no model): many producers, one consumer, crashes. Both
sides use the real verbs of ``shm.mailbox`` and ``shm.ring``, as the engine and client do."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from engine.supervisor import pid_alive
from shm import ErrorCode, Finish, Layout, MailboxState, Published, Transport
from shm.wakeup import Wakeups

SPAWN = mp.get_context("spawn")
FREE, LEASED, QUEUED, RUNNING, DONE = MailboxState


@pytest.fixture
def transport():
    t = Transport.create(Layout(max_slots=4, n_mailboxes=8, max_seq_len=16, record_bytes=12))
    yield t
    t.close()
    assert not os.path.exists(f"/dev/shm/{t.name}") and not os.path.exists(t.directory)


def _fill(*values):
    """A payload writer putting three int32 values (producer, thread, sequence number)."""
    def write(payload):
        payload.view(np.int32)[:3] = values
    return write


def producer(name: str, producer_id: int, count: int, threads: int) -> None:
    """Push ``count`` records per thread, each through the whole lease/submit/wait/release
    protocol; each record says (producer, thread, sequence number)."""
    t = Transport.attach(name)
    boxes = t.mailboxes

    def work(thread: int):
        for n in range(count):
            while (lease := boxes.lease()) is None:
                time.sleep(0.0005)
            boxes.submit(lease, 1, _fill(producer_id, thread, n))
            while True:
                n_tokens, done = boxes.read_new(lease)
                if done:
                    break
                boxes.wait([lease], 1.0)
            assert n_tokens == 1 and boxes.token(lease, 0, None)[0] == n
            assert boxes.outcome(lease).finish == Finish.LENGTH
            boxes.release(lease)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    t.close()


def test_many_producers_no_loss_no_duplicate_order_kept(transport):
    n_producers, threads, count = 4, 3, 300
    seen, stop = [], threading.Event()
    boxes = transport.mailboxes

    def consumer():  # the engine's side of the protocol, without a model
        while not stop.is_set():
            transport.wakeups.wait([Wakeups.ENGINE], 0.1)
            transport.wakeups.drain(Wakeups.ENGINE)
            for rec in transport.ring.pop_all():
                assert boxes.is_queued(rec.mailbox, rec.lease)
                p, k, n = rec.payload.view(np.int32)[:3].tolist()
                seen.append((p, k, n))
                boxes.admit(rec.mailbox, 0, 1, time.monotonic())
                boxes.publish([Published(rec.mailbox, 0, n, None)], time.monotonic())
                boxes.finish(rec.mailbox, rec.lease, Finish.LENGTH)

    c = threading.Thread(target=consumer)
    c.start()
    procs = [SPAWN.Process(target=producer, args=(transport.name, p, count, threads)) for p in range(n_producers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    stop.set()
    c.join()
    assert len(seen) == n_producers * threads * count
    assert len(set(seen)) == len(seen)
    for p in range(n_producers):
        for k in range(threads):
            assert [n for (pp, kk, n) in seen if (pp, kk) == (p, k)] == list(range(count))
    assert boxes.in_use() == 0


def test_reader_sees_every_token_in_order_and_the_final_count(transport):
    """The publication rule, exercised: a reader polling with read_new never sees a counter
    ahead of its data, and DONE implies the final count."""
    boxes = transport.mailboxes
    lease = boxes.lease()
    boxes.submit(lease, 1, _fill(0, 0, 0))
    (rec,) = transport.ring.pop_all()
    n_tokens = 15  # max_seq_len 16

    def engine():
        for k in range(n_tokens):
            boxes.publish([Published(rec.mailbox, k, 1000 + k, (-0.5, np.array([1000 + k]), np.array([-0.5])))],
                          time.monotonic())
        boxes.finish(rec.mailbox, rec.lease, Finish.LENGTH)

    threading.Thread(target=engine).start()
    got = []
    while True:
        n, done = boxes.read_new(lease)
        got += [boxes.token(lease, k, 1) for k in range(len(got), n)]
        if done:
            break
        boxes.wait([lease], 1.0)
    assert [tok for tok, _, _ in got] == [1000 + k for k in range(n_tokens)]
    assert all(lp == -0.5 and top == ((tok, -0.5),) for tok, lp, top in got)
    boxes.release(lease)


def hold_leases_then_sleep(name: str, n: int, ready) -> None:
    t = Transport.attach(name)
    for _ in range(n):
        t.mailboxes.lease()
    ready.set()
    time.sleep(600)


def hold_lock_then_sleep(name: str, ready) -> None:
    t = Transport.attach(name)
    t.lock.__enter__()
    ready.set()
    time.sleep(600)


def test_sigkilled_producer_leases_are_reclaimed(transport):
    ready = SPAWN.Event()
    p = SPAWN.Process(target=hold_leases_then_sleep, args=(transport.name, 3, ready))
    p.start()
    assert ready.wait(60)
    boxes = transport.mailboxes
    assert boxes.in_use() == 3
    assert boxes.reclaim(pid_alive) == []  # alive: nothing taken
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert sorted(boxes.reclaim(pid_alive)) == [0, 1, 2]
    assert boxes.in_use() == 0


def test_producer_killed_inside_critical_section_does_not_freeze_others(transport):
    ready = SPAWN.Event()
    p = SPAWN.Process(target=hold_lock_then_sleep, args=(transport.name, ready))
    p.start()
    assert ready.wait(60)
    got = []
    t = threading.Thread(target=lambda: got.append(transport.mailboxes.lease()), daemon=True)
    t.start()
    t.join(0.5)
    assert not got, "the lock should be held by the sleeping producer"
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    t.join(10)
    assert got and got[0] is not None


def test_running_mailbox_of_dead_owner_is_cancelled_then_freed(transport):
    boxes = transport.mailboxes
    lease = boxes.lease()
    boxes.submit(lease, 1, _fill(0, 0, 0))
    boxes.boxes["owner_pid"][lease.index] = 2 ** 22 + 12345  # no such process
    assert boxes.reclaim(pid_alive) == []
    assert boxes.cancelled(lease.index, lease.number)
    boxes.finish(lease.index, lease.number, Finish.CANCELLED)  # the engine retires it
    assert boxes.reclaim(pid_alive) == [lease.index]
    assert MailboxState(int(boxes.boxes["state"][lease.index])) == FREE


def test_stale_lease_can_neither_release_nor_cancel_a_reused_mailbox(transport):
    boxes = transport.mailboxes
    old = boxes.lease()
    boxes.release(old)
    new = boxes.lease()
    assert new == (old.index, old.number + 1)
    boxes.release(old)  # a stale reader
    boxes.cancel(old)
    assert MailboxState(int(boxes.boxes["state"][new.index])) == LEASED
    assert not boxes.cancelled(new.index, new.number)


def test_failed_in_flight_wakes_readers_with_an_error(transport):
    boxes = transport.mailboxes
    lease = boxes.lease()
    boxes.submit(lease, 1, _fill(0, 0, 0))
    assert boxes.fail_in_flight(3) == 1
    woken, _ = boxes.wait([lease], 1.0)
    assert woken == {lease.index} and boxes.read_new(lease) == (0, True)
    assert boxes.outcome(lease).finish == Finish.ERROR


def test_a_reader_fails_only_its_own_lease_and_only_while_in_flight(transport):
    """``Mailboxes.fail``: what a stream does when its engine died with no supervisor left."""
    boxes = transport.mailboxes
    mine, other = boxes.lease(), boxes.lease()
    for lease in (mine, other):
        boxes.submit(lease, 1, _fill(0, 0, 0))
    boxes.fail(mine._replace(number=mine.number + 1), ErrorCode.ENGINE_DIED)  # a lease it does not hold
    assert boxes.read_new(mine) == (0, False)
    boxes.fail(mine, ErrorCode.ENGINE_DIED)
    woken, _ = boxes.wait([mine], 1.0)
    assert woken == {mine.index} and boxes.read_new(mine) == (0, True)
    assert boxes.outcome(mine).error == ErrorCode.ENGINE_DIED and boxes.read_new(other) == (0, False)
    boxes.finish(other.index, other.number, Finish.LENGTH)
    boxes.fail(other, ErrorCode.ENGINE_DIED)  # already DONE: its ending stands
    assert boxes.outcome(other).finish == Finish.LENGTH


def test_close_unlinks_after_an_exception():
    with pytest.raises(RuntimeError):
        with Transport.create(Layout(1, 1, 8, 4)) as t:
            name = t.name
            raise RuntimeError("boom")
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}.d")


def test_layout_is_validated():
    with pytest.raises(ValueError):
        Layout(max_slots=0, n_mailboxes=1, max_seq_len=8, record_bytes=4)
    with pytest.raises(ValueError):
        Layout(max_slots=4, n_mailboxes=2, max_seq_len=8, record_bytes=4)


def test_prompt_logprobs_share_the_token_arrays_from_their_far_end(transport):
    """A scoring request's prompt positions go from the end of the mailbox's per-position arrays,
    generated tokens from the start: with n prompt tokens and fewer than max_seq_len - n
    generated, neither overwrites the other; each has its own counter."""
    boxes = transport.mailboxes
    lease = boxes.lease()
    boxes.submit(lease, 10, _fill(0, 0, 0))
    top = lambda *ids: (np.array(ids, np.int32), np.array([-0.5] * len(ids), np.float32))  # noqa: E731
    rows = lambda *ids: (np.array(ids, np.int32).reshape(-1, 2), np.full((len(ids) // 2, 2), -0.5, np.float32))  # noqa: E731
    boxes.publish_prompt_logprobs(lease.index, 0, np.array([-1.0, -2.0], np.float32), *rows(5, 6, 7, 8))
    boxes.publish_prompt_logprobs(lease.index, 2, np.array([-3.0], np.float32), *rows(9, 1))
    boxes.publish([Published(lease.index, k, 100 + k, (-0.25, *top(3, 4))) for k in range(6)], time.monotonic())
    assert boxes.prompt_logprobs(lease, 2) == [(-1.0, ((5, -0.5), (6, -0.5))), (-2.0, ((7, -0.5), (8, -0.5))),
                                              (-3.0, ((9, -0.5), (1, -0.5)))]
    assert boxes.read_new(lease) == (6, False)
    assert [boxes.token(lease, k, 1) for k in range(6)] == [(100 + k, -0.25, ((3, -0.5),)) for k in range(6)]
    boxes.finish(lease.index, lease.number, Finish.LENGTH)
    boxes.release(lease)
    again = boxes.lease()  # a new lease starts with no prompt positions
    assert boxes.prompt_logprobs(again, 1) == []
    boxes.release(again)


@pytest.mark.parametrize("pending", [0, 1, 4095, 4096, 4097, 20000, 65536])
def test_drain_empties_the_fifo_whatever_is_pending(transport, pending):
    """``Wakeups.drain`` stops at its first short read: the pipe was empty then. Around the read
    size and at a full pipe (65,536 bytes), nothing is left to wake a reader again."""
    w = transport.wakeups
    for _ in range(pending):
        w.wake(0)
    assert w.wait([0], 0)[0] == ({0} if pending else set())
    w.drain(0)
    assert w.wait([0], 0)[0] == set()
