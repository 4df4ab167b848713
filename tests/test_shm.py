"""The shared-memory transport alone (no model): many producers, one consumer, crashes."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from engine.supervisor import pid_alive
from shm import Layout, Transport
from shm.layout import DONE, FREE, LEASED, QUEUED
from shm.mailbox import Mailboxes
from shm.ring import RequestRing
from shm.wakeup import Doorbells

SPAWN = mp.get_context("spawn")


@pytest.fixture
def transport():
    t = Transport.create(Layout(max_slots=4, n_mailboxes=8, max_seq_len=16))
    yield t
    t.close()
    assert not os.path.exists(f"/dev/shm/{t.name}") and not os.path.exists(t.directory)


def producer(name: str, producer_id: int, count: int, threads: int) -> None:
    """Push ``count`` records per thread, each through the whole lease/submit/wait/release
    protocol; each record says (producer, thread, sequence number)."""
    t = Transport.attach(name)
    boxes, ring = Mailboxes(t), RequestRing(t)

    def work(thread: int):
        for n in range(count):
            while (lease := boxes.lease()) is None:
                time.sleep(0.0005)
            i, gen = lease

            def fill(rec):
                rec["mailbox"], rec["generation"] = i, gen
                rec["tenant"], rec["priority"], rec["max_new_tokens"] = producer_id, thread, n
            t.mailboxes["state"][i] = QUEUED
            ring.push(fill)
            while int(t.mailboxes["state"][i]) != DONE:
                t.bells.wait(i, timeout=1.0)
                t.bells.drain(i)
            assert int(t.tokens[i, 0]) == n
            boxes.release(i, gen)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    t.close()


def test_many_producers_no_loss_no_duplicate_order_kept(transport):
    n_producers, threads, count = 4, 3, 300
    ring, seen, stop = RequestRing(transport), [], threading.Event()

    def consumer():  # the engine's side of the protocol, without a model
        while not stop.is_set():
            transport.bells.wait(Doorbells.ENGINE, timeout=0.1)
            transport.bells.drain(Doorbells.ENGINE)
            for rec in ring.pop_all():
                i = int(rec["mailbox"])
                seen.append((int(rec["tenant"]), int(rec["priority"]), int(rec["max_new_tokens"])))
                transport.tokens[i, 0] = rec["max_new_tokens"]
                transport.mailboxes["n_tokens"][i] = 1
                transport.mailboxes["state"][i] = DONE
                transport.bells.ring(i)

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
    assert Mailboxes(transport).in_use() == 0


def hold_leases_then_sleep(name: str, n: int, ready) -> None:
    t = Transport.attach(name)
    boxes = Mailboxes(t)
    for _ in range(n):
        boxes.lease()
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
    boxes = Mailboxes(transport)
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
    t = threading.Thread(target=lambda: got.append(Mailboxes(transport).lease()), daemon=True)
    t.start()
    t.join(0.5)
    assert not got, "the lock should be held by the sleeping producer"
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    t.join(10)
    assert got and got[0] is not None


def test_running_mailbox_of_dead_owner_is_cancelled_then_freed(transport):
    boxes = Mailboxes(transport)
    i, gen = boxes.lease()
    transport.mailboxes["state"][i] = QUEUED
    transport.mailboxes["owner_pid"][i] = 2 ** 22 + 12345  # no such process
    assert boxes.reclaim(pid_alive) == []
    assert transport.mailboxes["cancel"][i] == 1
    transport.mailboxes["state"][i] = DONE  # the engine retires it
    assert boxes.reclaim(pid_alive) == [i]
    assert int(transport.mailboxes["state"][i]) == FREE


def test_stale_generation_cannot_release_a_reused_mailbox(transport):
    boxes = Mailboxes(transport)
    i, gen = boxes.lease()
    boxes.release(i, gen)
    j, gen2 = boxes.lease()
    assert (j, gen2) == (i, gen + 1)
    boxes.release(i, gen)  # a stale reader
    assert int(transport.mailboxes["state"][i]) == LEASED


def test_close_unlinks_after_an_exception():
    with pytest.raises(RuntimeError):
        with Transport.create(Layout(1, 1, 8)) as t:
            name = t.name
            raise RuntimeError("boom")
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}.d")


def test_layout_is_validated():
    with pytest.raises(ValueError):
        Layout(max_slots=0, n_mailboxes=1, max_seq_len=8)
    with pytest.raises(ValueError):
        Layout(max_slots=4, n_mailboxes=2, max_seq_len=8)
