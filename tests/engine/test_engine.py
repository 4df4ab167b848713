"""The engine through shared memory: real model, real engine process, real producer processes."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from engine.errors import DeadlineExceeded, PromptTooLong
from engine.request import Priority, SamplingParams
from tests.support.servers import assert_idle_and_clean, running_engine, wait_steps
from tests.support.producers import generate_many

GREEDY = {"temperature": 0.0}
SPAWN = mp.get_context("spawn")

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers.", "Say hello in Spanish.", "What is 2 + 2?",
         "Name a color of the rainbow.", "Describe a cat in one sentence.",
         "Why is the sky blue?"]


@pytest.fixture(scope="module")
def producer():
    """One spawned producer process, for every test here (a spawn costs half a CPU-second)."""
    with ProcessPoolExecutor(1, mp_context=SPAWN) as pool:
        yield pool


def _in_other_process(pool: ProcessPoolExecutor, name: str, jobs: list[dict]) -> list[dict]:
    """``generate_many(name, jobs)`` in the producer process ``pool``."""
    return pool.submit(generate_many, name, jobs).result(timeout=300)


def test_batch_isolation_outputs_equal_solo_runs(chat, producer):
    prompts = [chat.encode([{"role": "user", "content": c}]) for c in CHATS]
    # ignore_eos: every sequence runs its 32 steps, so all 8 overlap even when the producer, on a
    # busy machine, submits them over several engine steps (a reply of 7 tokens once ended before
    # the last was admitted)
    jobs = [{"prompt": p, "params": {**GREEDY, "max_new_tokens": 32, "ignore_eos": True}} for p in prompts]
    with running_engine(max_slots=8) as (client, _):
        together = _in_other_process(producer, client.t.name, jobs)
        alone = [_in_other_process(producer, client.t.name, [job])[0] for job in jobs]
        assert_idle_and_clean(client)
    # All 8 really ran together: each was admitted before any finished.
    assert max(r["timings"]["step_admitted"] for r in together) < min(r["timings"]["step_finished"] for r in together)
    for t, a in zip(together, alone):
        assert len(t["ids"]) > 0
        assert t["ids"] == a["ids"]


def test_64_mixed_requests_from_4_producers_through_4_slots():
    jobs = [[{"prompt": list(range(100 + p, 100 + p + 3 + (7 * i) % 40)),
              "params": {**GREEDY, "max_new_tokens": 1 + (5 * i + p) % 23, "ignore_eos": True},
              "tenant": p}
             for i in range(16)] for p in range(4)]
    with running_engine(max_slots=4, max_queued=60) as (client, _):
        violations = []
        stop = threading.Event()

        def watch_kv():  # a free slot never keeps KV cells, at any step
            while not stop.is_set():
                snap = client.snapshot()
                violations.extend((snap.step, s) for s in range(4)
                                  if snap.slot_mailbox[s] == -1 and snap.kv_pos_max[s] != -1)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch_kv)
        watcher.start()
        with ProcessPoolExecutor(4, mp_context=SPAWN) as pool:
            results = list(pool.map(generate_many, [client.t.name] * 4, jobs, timeout=600))
        stop.set()
        watcher.join()
        assert_idle_and_clean(client)
    assert not violations
    for p in range(4):
        for job, r in zip(jobs[p], results[p]):
            assert r["finish"] == "length"
            assert len(r["ids"]) == job["params"]["max_new_tokens"]


def _spans(results):
    return [(r["timings"]["step_admitted"], r["timings"]["step_finished"]) for r in results]


def test_static_admits_only_into_an_empty_batch(producer):
    jobs = [{"prompt": [300 + i, 301, 302], "params": {**GREEDY, "max_new_tokens": n, "ignore_eos": True}}
            for i, n in enumerate([3, 12, 5, 9, 4, 7])]
    with running_engine(max_slots=2, policy="static") as (client, _):
        results = _in_other_process(producer, client.t.name, jobs)
    spans = sorted(_spans(results))
    for admitted, _ in spans:
        running = [s for s in spans if s[0] < admitted <= s[1]]
        assert not running, f"admitted at step {admitted} while {running} still ran"


def test_fifo_never_runs_two_sequences_at_once(producer):
    jobs = [{"prompt": [400 + i, 401], "params": {**GREEDY, "max_new_tokens": 4, "ignore_eos": True}}
            for i in range(5)]
    with running_engine(max_slots=4, policy="fifo") as (client, _):
        results = _in_other_process(producer, client.t.name, jobs)
    spans = sorted(_spans(results))
    for (a1, f1), (a2, _) in zip(spans, spans[1:]):
        assert a2 > f1


def test_continuous_admits_into_a_freed_slot_on_the_next_step(producer):
    # Submitted together; the short ones run 20 steps, so the third is surely queued by then.
    jobs = [{"prompt": [500, 501], "params": {**GREEDY, "max_new_tokens": 20, "ignore_eos": True}},
            {"prompt": [502, 503], "params": {**GREEDY, "max_new_tokens": 80, "ignore_eos": True}},
            {"prompt": [504, 505], "params": {**GREEDY, "max_new_tokens": 20, "ignore_eos": True}}]
    with running_engine(max_slots=2) as (client, _):
        results = _in_other_process(producer, client.t.name, jobs)
    spans = _spans(results)
    # The producer's threads submit in any order: the queued one is the one admitted last.
    queued = max(range(3), key=lambda i: spans[i][0])
    running = [spans[i] for i in range(3) if i != queued]
    assert all(spans[queued][0] > admitted for admitted, _ in running), "one request must have waited for a slot"
    # Admitted on the step after the first of the running ones finished (a short one).
    assert spans[queued][0] == min(finished for _, finished in running) + 1, spans
    if queued != 1:  # a short one waited, and still finished before the long one beside it
        assert spans[queued][1] < spans[1][1], spans


def _blocker(client, n=60):
    """A running sequence holding a slot: returns (stream, its iterator past the first token)."""
    stream = client.submit([600, 601], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    it = iter(stream)
    next(it)
    return stream, it


def test_deadline_while_queued_and_while_running():
    with running_engine(max_slots=1) as (client, _):
        blocker, it = _blocker(client)
        with blocker:
            queued = client.submit([7, 8], SamplingParams(max_new_tokens=5, temperature=0), deadline_ms=150)
            with pytest.raises(DeadlineExceeded):
                list(queued)
            assert queued.timings().admitted == 0.0
            assert list(it)
        running = client.submit([9, 10], SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True),
                                deadline_ms=400)
        ids = [t.id for t in running]
        assert running.finish_reason == "deadline"
        assert 0 < len(ids) < 200
        assert_idle_and_clean(client)


def test_cancel_while_queued_and_while_running_frees_within_one_step():
    with running_engine(max_slots=1) as (client, _):
        blocker, it = _blocker(client, 200)
        with blocker:
            queued = client.submit([7, 8], SamplingParams(max_new_tokens=5, temperature=0))
            wait_steps(client, 2)
            queued.cancel()
            queued.close()
            assert queued.timings().admitted == 0.0 and queued.finish_reason is None
            for _ in range(3):
                next(it)
            at_cancel = client.step()
            blocker.cancel()
            assert list(it) is not None
            assert blocker.finish_reason == "cancelled"
            assert blocker.timings().step_finished <= at_cancel + 2
        assert_idle_and_clean(client)


def test_priority_then_deadline_order_when_slots_are_busy():
    with running_engine(max_slots=1) as (client, _):
        blocker, it = _blocker(client, 40)
        with blocker:
            p = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
            streams = {
                "low": client.submit([11, 12], p, priority=Priority.LOW),
                "normal": client.submit([13, 14], p, priority=Priority.NORMAL),
                "normal+deadline": client.submit([15, 16], p, priority=Priority.NORMAL, deadline_ms=60_000),
                "high": client.submit([17, 18], p, priority=Priority.HIGH),
            }
            list(it)
        order = []
        for name, s in streams.items():
            with s:
                list(s)
                order.append((s.timings().step_admitted, name))
        assert [n for _, n in sorted(order)] == ["high", "normal+deadline", "normal", "low"]


def test_low_priority_completes_under_sustained_high_load():
    with running_engine(max_slots=1, aging_s=0.5) as (client, _):
        p = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        stop = threading.Event()
        high_done = []

        def flood():
            while not stop.is_set():
                with client.submit([21, 22], p, priority=Priority.HIGH) as s:
                    list(s)
                    high_done.append(s.timings().step_finished)

        flooders = [threading.Thread(target=flood) for _ in range(3)]
        for f in flooders:
            f.start()
        time.sleep(0.3)
        with client.submit([23, 24], p, priority=Priority.LOW) as low:
            assert len(list(low)) == 4
            low_finished = low.timings().step_finished
        time.sleep(0.3)
        stop.set()
        for f in flooders:
            f.join()
        assert any(step > low_finished for step in high_done), "high traffic had stopped"


def test_too_long_prompts_are_rejected_before_the_engine():
    with running_engine(max_slots=1, max_seq_len=64) as (client, _):
        before = client.step()
        with pytest.raises(PromptTooLong, match=r"64 tokens.*limit of 63|prompt has 64 tokens"):
            client.submit(list(range(100, 164)), SamplingParams(max_new_tokens=1))
        with pytest.raises(PromptTooLong, match=r"\(50 tokens\) \+ max_tokens \(20\).*64"):
            client.submit(list(range(100, 150)), SamplingParams(max_new_tokens=20))
        with pytest.raises(ValueError):
            client.submit([], SamplingParams(max_new_tokens=1))
        assert client.mailboxes_in_use() == 0
        with client.submit([5, 6], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)) as s:
            assert len(list(s)) == 3
        assert client.step() > before


def test_logprobs_and_seeded_sampling():
    with running_engine(max_slots=2) as (client, _):
        def run(**kw):
            with client.submit([30, 31, 32], SamplingParams(max_new_tokens=8, ignore_eos=True, **kw)) as s:
                return list(s)
        a, b = run(temperature=0.9, seed=7), run(temperature=0.9, seed=7)
        assert [t.id for t in a] == [t.id for t in b]
        greedy = run(temperature=0, logprobs=5)
        for tok in greedy:
            assert len(tok.top) == 5 and tok.top[0][0] == tok.id  # greedy = the most likely
            assert tok.logprob <= 0 and abs(tok.logprob - tok.top[0][1]) < 1e-5
            assert [lp for _, lp in tok.top] == sorted((lp for _, lp in tok.top), reverse=True)


def test_compaction_moves_kv_cells_without_changing_outputs(chat):
    """Short sequences in low slots retire first; the survivors are moved down (their KV
    cells copied to the freed slots) so the batch stays one micro-batch. Every output must
    still equal the same request run alone."""
    prompts = [chat.encode([{"role": "user", "content": c}]) for c in CHATS[:4]]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (4, 30, 8, 40)]
    with running_engine(max_slots=4) as (client, _):
        streams = [client.submit(p, sp) for p, sp in zip(prompts, params)]  # slots 0..3 in order
        together = []
        for s in streams:
            with s:
                together.append([t.id for t in s])
        assert client.t.control.kv_moves >= 1
        alone = []
        for p, sp in zip(prompts, params):
            with client.submit(p, sp) as s:
                alone.append([t.id for t in s])
        assert_idle_and_clean(client)
    assert together == alone


def test_growing_sequences_beyond_the_kv_budget_are_preempted_and_finish_as_alone(chat, producer):
    """Admission counts KV cells, not slots: four sequences of 60 + 60 tokens cannot all grow in
    300 cells, so the youngest is preempted and requeued, prefills its prompt and the tokens it
    had generated again, and goes on. No request fails, the budget holds at every step, and
    (deterministic profile) every output equals its solo run."""
    jobs = [{"prompt": list(range(200 + 7 * i, 260 + 7 * i)),
             "params": {**GREEDY, "max_new_tokens": 60, "ignore_eos": True}} for i in range(4)]
    with running_engine(max_slots=4, kv_cache_tokens=300, deterministic=True) as (client, _):
        alone = [_in_other_process(producer, client.t.name, [job])[0] for job in jobs]
        before = client.snapshot().preemptions
        over, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                if (snap := client.snapshot()).kv_cells > 300:
                    over.append(snap.kv_cells)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        together = _in_other_process(producer, client.t.name, jobs)
        stop.set()
        watcher.join()
        assert client.snapshot().preemptions > before
        assert_idle_and_clean(client)
    assert not over
    assert [r["finish"] for r in together] == ["length"] * 4
    assert all(len(r["ids"]) == 60 for r in together)
    assert [r["ids"] for r in together] == [r["ids"] for r in alone]


def test_an_inproc_engine_that_cannot_load_raises_and_leaves_no_segment(tmp_path):
    """InprocEngine loads the model in its own thread (engine/inproc.py): a model that does not
    load is the caller's ConfigError, its thread ends and its shared memory is gone."""
    import os

    from engine.config import ConfigError, EngineConfig
    from engine.inproc import InprocEngine
    from shm import segment

    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"not a GGUF file")
    def mine() -> set[str]:  # this process's segments (Transport.create names them by pid)
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"{segment.PREFIX}{os.getpid()}-")}

    before, threads = mine(), set(threading.enumerate())
    with pytest.raises(ConfigError):
        InprocEngine(EngineConfig(model_path=str(bad), max_slots=2, max_seq_len=256))
    assert mine() == before
    assert set(threading.enumerate()) <= threads


def test_a_tenant_below_its_share_gets_a_slot_from_a_flooding_tenant_at_once():
    """Fair slots on the real engine: tenant 1 holds both slots with long answers; tenant 2's
    request is admitted while both still run (the youngest is preempted, its cells kept in the
    prefix cache) and tenant 1's answers finish equal to their solo runs (deterministic profile)."""
    p = SamplingParams(max_new_tokens=80, temperature=0, ignore_eos=True)
    prompts = [[700 + i, 701 + i, 702 + i] for i in range(2)]
    with running_engine(max_slots=2, deterministic=True) as (client, _):
        alone = []
        for prompt in prompts:
            with client.submit(prompt, p, tenant=1) as s:
                alone.append([t.id for t in s])
        before = client.snapshot().preemptions
        flood = [client.submit(prompt, p, tenant=1) for prompt in prompts]
        its = [iter(s) for s in flood]
        firsts = [next(it).id for it in its]
        with client.submit([30, 31], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
                           tenant=2) as light:
            assert len(list(light)) == 4
            admitted = light.timings().step_admitted
        together = [[first] + [t.id for t in it] for first, it in zip(firsts, its)]
        for s in flood:
            with s:
                assert s.timings().step_finished > admitted
        assert client.snapshot().preemptions == before + 1
        assert_idle_and_clean(client)
    assert together == alone
