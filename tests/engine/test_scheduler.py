"""The scheduler (engine/scheduler.py) without the model: the step as a value (decoding rows
first, then prompt chunks within the step's budget, slot moves, the one-thread request past the
split-KV limit) and the admission order (VTC fair share by weight, priority classes, deadlines,
aging, the static and FIFO policies)."""
from __future__ import annotations

import numpy as np

from engine.request import EngineRequest, Priority, SamplingParams
from engine.scheduler import MAX_SHARE_PREEMPTIONS, Scheduler
from engine.sequence import Sequence, SequenceStatus

HIGH, NORMAL, LOW = Priority


def make(tenant: int, priority: Priority = NORMAL, deadline: float = 0.0, weight: float = 1.0,
         arrival: float = 0.0) -> Sequence:
    request = EngineRequest(np.array([1, 2], np.int32), SamplingParams(max_new_tokens=4), priority,
                            deadline, tenant, weight)
    return Sequence(mailbox=0, lease=1, request=request, arrival=arrival)


def admitted_tenants(sched: Scheduler, now: float = 0.0) -> list[int]:
    return [s.request.tenant for s in sched.admit(now)]


def test_schedule_plans_decodes_first_then_chunks_within_the_budget():
    """The step as a value: admitted sequences, then one token per decoding sequence and prompt
    chunks of at most the backend's chunk, in slot order within n_batch; statuses move on."""
    from engine.llama.backend import CPU_DETERMINISTIC
    from engine.sequence import SequenceStatus

    sched = Scheduler(max_slots=3, policy="continuous", aging_s=1e9, n_batch=100, backend=CPU_DETERMINISTIC)
    long_prompt = EngineRequest(np.arange(1, 151, dtype=np.int32), SamplingParams(max_new_tokens=4), NORMAL, 0.0, 0)
    a, b = Sequence(0, 1, long_prompt, 0.0), make(tenant=1)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(0.0)
    assert plan.admitted == [a, b] and not plan.moves
    assert [(r.seq, len(r.tokens), r.pos, r.samples) for r in plan.rows] == [(a, 63, 0, False), (b, 2, 0, True)]
    assert a.status == SequenceStatus.PREFILL and b.status == SequenceStatus.DECODE and a.n_past == 63
    b.n_generated, b.last_token = 1, 7
    plan = sched.schedule(0.0)  # b decodes first; a's chunk fits the rest of the budget
    assert [(r.seq, len(r.tokens), r.pos) for r in plan.rows] == [(a, 63, 63), (b, 1, 2)]
    assert plan.rows[1].tokens.tolist() == [7] and not plan.single_thread
    sched.release(b)
    assert b.status == SequenceStatus.FINISHED
    plan = sched.schedule(0.0)
    assert [(r.seq, len(r.tokens), r.samples) for r in plan.rows] == [(a, 24, True)]
    assert a.status == SequenceStatus.DECODE


def test_fast_profile_prefills_whole_micro_batches():
    """The default CPU profile gives a prompt the step's whole budget (llama-server's n_ubatch)."""
    from engine.llama.backend import CPU

    sched = Scheduler(max_slots=2, policy="continuous", aging_s=1e9, n_batch=512, backend=CPU)
    a = Sequence(0, 1, EngineRequest(np.arange(1, 1201, dtype=np.int32), SamplingParams(max_new_tokens=4), NORMAL,
                                     0.0, 0), 0.0)
    b = make(tenant=1)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(0.0)
    assert [(r.seq, len(r.tokens)) for r in plan.rows] == [(a, 512)]  # b is admitted, waits for room
    assert [(r.seq, len(r.tokens)) for r in sched.schedule(0.0).rows] == [(a, 512)]
    assert [(r.seq, len(r.tokens)) for r in sched.schedule(0.0).rows] == [(a, 176), (b, 2)]


def test_schedule_closes_gaps_and_asks_one_thread_past_the_split_kv_limit():
    from engine.llama.backend import CPU, CPU_DETERMINISTIC, GPU

    for backend, expected in ((CPU_DETERMINISTIC, True), (CPU, False), (GPU, False)):
        sched = Scheduler(max_slots=2, policy="continuous", aging_s=1e9, n_batch=512, backend=backend)
        first, second = make(tenant=0), make(tenant=1)
        sched.add(first)
        sched.add(second)
        sched.schedule(0.0)
        sched.release(first)  # slot 0 frees: the sequence in slot 1 moves down
        second.n_generated = 299  # a long sequence decoding alone: past 256 tokens after this step
        plan = sched.schedule(0.0)
        assert plan.moves == [(second, 1, 0)] and second.slot == 0
        assert plan.single_thread is expected  # split-KV attention sums in another order on 2 threads


def test_tenant_with_least_weighted_service_goes_first():
    sched = Scheduler(max_slots=1, policy="continuous", aging_s=1e9)
    heavy = make(tenant=1)
    sched.add(heavy)
    sched.charge(heavy, 500)
    sched.add(make(tenant=2))  # lifted to the backlogged minimum (500): no banked credit
    sched.add(make(tenant=1))
    sched.charge(heavy, 100)  # tenant 1 keeps being served
    assert admitted_tenants(sched) == [2]


def test_weight_divides_the_service_charged():
    sched = Scheduler(max_slots=2, policy="continuous", aging_s=1e9)
    a, b = make(tenant=1, weight=1.0), make(tenant=2, weight=4.0)
    sched.add(a)
    sched.add(b)
    sched.charge(a, 100)
    sched.charge(b, 100)
    assert sched.counters[1] == 100 and sched.counters[2] == 25
    sched.add(make(tenant=1))
    sched.add(make(tenant=2))
    sched.drop_waiting(a)
    sched.drop_waiting(b)
    assert admitted_tenants(sched)[0] == 2


def test_an_idle_tenant_cannot_bank_credit():
    sched = Scheduler(max_slots=1, policy="continuous", aging_s=1e9)
    busy = make(tenant=1)
    sched.add(busy)
    sched.charge(busy, 10_000)
    sched.add(make(tenant=2))
    assert sched.counters[2] == sched.counters[1] == 10_000


def test_a_tenant_served_alone_is_not_starved_by_a_newcomer():
    """A tenant served while it was the only one, then idle for a moment (nothing queued or
    running), then back beside a newcomer that floods: the newcomer starts at the counter of the
    tenant served last, not at 0, so the two take turns at once (VTC's empty-queue case)."""
    sched = Scheduler(max_slots=1, policy="continuous", aging_s=1e9)
    alone = make(tenant=1)
    sched.add(alone)
    (seq,) = sched.admit(0.0)
    sched.charge(seq, 10_000)
    sched.release(seq)  # nothing backlogged now
    for i in range(3):
        sched.add(make(tenant=2, arrival=1.0 + i))
    assert sched.counters[2] == 10_000
    sched.add(make(tenant=1, arrival=5.0))
    (first,) = sched.admit(6.0)
    sched.charge(first, 100)
    sched.release(first)
    assert admitted_tenants(sched, now=7.0) == [1]  # its turn after one of the newcomer's, not after all


def test_priority_beats_fair_share_beats_deadline_beats_arrival():
    sched = Scheduler(max_slots=4, policy="continuous", aging_s=1e9)
    for s in (make(tenant=1, priority=LOW), make(tenant=2), make(tenant=3, deadline=50.0),
              make(tenant=4, priority=HIGH)):
        sched.add(s)
    assert admitted_tenants(sched) == [4, 3, 2, 1]  # equal counters: the deadline breaks the tie


def test_a_deadline_does_not_overtake_another_tenants_fair_share():
    """Deadlines came before fair share, so a flooding tenant that set
    ``deadline_ms: 1e9`` on every request (free, and any gRPC timeout sets one) was admitted
    ahead of a light tenant for as long as it flooded (the light one waited 120 s). A deadline
    now orders only its tenant's own requests."""
    sched = Scheduler(max_slots=1, policy="continuous", aging_s=1e9)
    for i in range(3):
        sched.add(make(tenant=1, deadline=1e9, arrival=float(i)))
    sched.add(make(tenant=2, arrival=9.0))  # no deadline; lifted to the flood's counter (VTC)
    (first,) = sched.admit(10.0)  # a tie on the counters: the deadline breaks it
    sched.charge(first, 60)  # the flooding tenant was served
    sched.release(first)
    assert admitted_tenants(sched, now=11.0) == [2]  # it was the flood again, and again
    own = Scheduler(max_slots=1, policy="continuous", aging_s=1e9)  # within a tenant: earliest deadline first
    for seq in (make(tenant=1, arrival=0.0), make(tenant=1, deadline=5.0, arrival=1.0)):
        own.add(seq)
    assert [s.request.deadline for s in own.admit(2.0)] == [5.0]


def test_waiting_ages_a_low_request_up_to_high():
    sched = Scheduler(max_slots=1, policy="continuous", aging_s=1.0)
    sched.add(make(tenant=1, priority=LOW, arrival=0.0))
    sched.add(make(tenant=2, priority=HIGH, arrival=9.5))
    assert admitted_tenants(sched, now=10.0) == [1]  # waited 10 s: two classes up, ties on arrival


def test_aging_raises_a_class_so_fair_share_holds_inside_it():
    """A flooding tenant's request that waited long is not ahead of a light tenant's fresh one
    of the same class: the class ages as a whole and fair share orders it."""
    sched = Scheduler(max_slots=1, policy="continuous", aging_s=1.0)
    old = make(tenant=1, arrival=0.0)
    sched.add(old)
    sched.add(make(tenant=2, arrival=9.9))
    sched.charge(old, 100)  # tenant 1's other requests were served meanwhile
    assert admitted_tenants(sched, now=10.0) == [2]


def test_static_and_fifo_admission():
    static = Scheduler(max_slots=2, policy="static", aging_s=1e9)
    for t in range(3):
        static.add(make(tenant=t))
    assert len(static.admit(0.0)) == 2
    static.release(next(iter(static.running.values())))
    assert static.admit(0.0) == []  # one still runs: no admission into a partial batch
    fifo = Scheduler(max_slots=4, policy="fifo", aging_s=1e9)
    for t in range(3):
        fifo.add(make(tenant=t))
    assert admitted_tenants(fifo) == [0] and fifo.admit(0.0) == []


def test_a_scoring_chunk_takes_the_logits_rows_the_others_leave():
    """Every row of a scoring chunk is a logits row, and a decode asks for at most
    ``logits_rows`` (llama.cpp keeps them twice: 1 MiB a row for a 262,144-token vocabulary):
    the chunk is cut to what the decodes and the prefills after it, which may sample, leave."""
    from engine.llama.backend import CPU
    from engine.request import RequestKind

    sched = Scheduler(max_slots=3, policy="continuous", aging_s=1e9, n_batch=512, backend=CPU, logits_rows=20)
    decoding = make(tenant=1)
    sched.add(decoding)
    sched.schedule(0.0)
    decoding.n_generated, decoding.last_token = 1, 7
    scoring = Sequence(0, 1, EngineRequest(np.arange(1, 301, dtype=np.int32), SamplingParams(max_new_tokens=0), NORMAL,
                                           0.0, 2, kind=RequestKind.SCORE), 0.0)
    after = make(tenant=3)
    sched.add(scoring)
    sched.add(after)
    plan = sched.schedule(0.0)
    assert [(r.seq, len(r.tokens)) for r in sorted(plan.rows, key=lambda r: r.seq.order)] == [
        (decoding, 1), (scoring, 18), (after, 2)]  # 20 rows: 1 decode + 18 scored + 1 sampled
    assert sum(len(r.tokens) if r.scores else int(r.samples) for r in plan.rows) == 20


def flooded(slots: int = 4, weight_a: float = 1.0) -> tuple[Scheduler, list[Sequence]]:
    """Tenant 0 (A) holds every slot and has more waiting."""
    sched = Scheduler(max_slots=slots, policy="continuous", aging_s=1e9)
    flood = [make(tenant=0, weight=weight_a) for _ in range(slots + 2)]
    for seq in flood:
        sched.add(seq)
    sched.schedule(0.0)
    return sched, flood


def decode_step(sched: Scheduler) -> None:
    """Charge each running sequence the token it decodes (as the core does on sampling): a
    tenant queued behind the flood starts at A's counter (VTC's lift) and is behind it a step on."""
    for seq in sched.running.values():
        sched.charge(seq, 1)


def test_a_tenant_below_its_share_of_the_slots_takes_the_youngest_slot_of_one_above_it():
    """Two tenants, four slots: a share of two each. B's first two requests each take the slot of
    A's youngest running sequence in the step they are queued; the third waits (B at its share)."""
    sched, flood = flooded()
    b1, b2, b3 = make(tenant=1), make(tenant=1), make(tenant=1)
    sched.add(b1)
    decode_step(sched)
    plan = sched.schedule(0.0)
    assert plan.preempted == [flood[3]] and plan.admitted == [b1]
    assert flood[3].status == SequenceStatus.WAITING and flood[3].preemptions == 1
    sched.add(b2)
    sched.add(b3)
    decode_step(sched)
    plan = sched.schedule(0.0)
    assert plan.preempted == [flood[2]] and plan.admitted == [b2]
    plan = sched.schedule(0.0)  # B holds its share, A no more than its own: nobody is preempted
    assert plan.preempted == [] and plan.admitted == [] and sorted(s.request.tenant for s in sched.running.values()) \
        == [0, 0, 1, 1]


def test_a_victim_waits_in_its_tenants_fair_share_turn_not_ahead():
    """Preempted for the KV budget, a sequence resumes before the fresh ones; preempted for the
    slots' fair share it does not: the next free slot goes to B, whose counter is lower."""
    sched, flood = flooded()
    sched.add(make(tenant=1))
    decode_step(sched)
    sched.schedule(0.0)
    victim = flood[3]
    assert not victim.resumes_first
    sched.release(flood[0])
    b2 = make(tenant=1)
    sched.add(b2)
    decode_step(sched)
    assert sched.schedule(0.0).admitted == [b2] and victim.status == SequenceStatus.WAITING


def test_weights_set_the_share_of_the_slots():
    """A weighs 3, B 1: of four slots B's share is one, so its second request waits."""
    sched, flood = flooded(weight_a=3.0)
    sched.add(make(tenant=1))
    decode_step(sched)
    sched.add(make(tenant=1))
    decode_step(sched)
    plan = sched.schedule(0.0)
    assert plan.preempted == [flood[3]] and [s.request.tenant for s in plan.admitted] == [1]
    assert sched.schedule(0.0).preempted == []


def test_fair_slots_never_churn():
    """One slot, two tenants (a share of half a slot each): taking the slot would put B over its
    share, so A's sequence runs on. And a sequence preempted once is never a victim again: B's
    next request takes the slot of A's older sequence once the youngest was preempted
    ``MAX_SHARE_PREEMPTIONS`` times."""
    sched, flood = flooded(slots=1)
    sched.add(make(tenant=1))
    decode_step(sched)
    assert sched.schedule(0.0).preempted == []
    sched, flood = flooded(slots=2)
    b1 = make(tenant=1)
    sched.add(b1)
    decode_step(sched)
    assert sched.schedule(0.0).preempted == [flood[1]]
    sched.release(b1)
    assert sched.schedule(0.0).admitted == [flood[1]]  # back in A's turn, now the youngest running
    flood[1].preemptions = MAX_SHARE_PREEMPTIONS  # as if it had been preempted that often
    sched.add(make(tenant=1))
    decode_step(sched)
    assert sched.schedule(0.0).preempted == [flood[0]]


def test_a_waiting_sequence_never_preempts_a_higher_class():
    """A's four running sequences are ``high``: B's ``normal`` request waits for a slot to end, C's
    ``high`` one takes the youngest (vLLM's priority preemption, within the slots' fair share)."""
    sched = Scheduler(max_slots=4, policy="continuous", aging_s=1e9)
    flood = [make(tenant=0, priority=HIGH) for _ in range(4)]
    for seq in flood:
        sched.add(seq)
    sched.schedule(0.0)
    sched.add(make(tenant=1))
    decode_step(sched)
    assert sched.schedule(0.0).preempted == []
    sched.add(make(tenant=2, priority=HIGH))
    decode_step(sched)
    plan = sched.schedule(0.0)
    assert plan.preempted == [flood[3]] and [s.request.tenant for s in plan.admitted] == [2]


def test_the_slot_freed_goes_to_the_tenant_below_its_share_even_at_the_floods_counter():
    """Queued in the step it arrives, B's counter is A's (VTC's lift): the tie would hand the
    slot freed back to A's victim, so a tenant below its share of the slots sorts first."""
    sched, flood = flooded()
    b = make(tenant=1)
    sched.add(b)
    assert sched.counters[1] == sched.counters[0]
    plan = sched.schedule(0.0)
    assert plan.preempted == [flood[3]] and plan.admitted == [b]
