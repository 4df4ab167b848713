"""Pure-Python parts without the model: admission order (VTC fair share, aging) and the
incremental detokenizer."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import ConfigError
from engine.request import EngineRequest, Priority, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stream import Token
from server.generation.choice import ChoiceState

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


def test_backend_profile_follows_the_device_llama_cpp_reports():
    from engine.llama import backend

    assert backend.detect(lambda: True) is backend.GPU and backend.detect(lambda: False) is backend.CPU
    assert backend.GPU.n_gpu_layers == -1 and not backend.GPU.adaptive_threads and not backend.GPU.convert_unbatched
    assert backend.CPU.max_chunk_tokens == 512 and backend.CPU.adaptive_threads and backend.CPU.convert_unbatched
    assert backend.CPU_DETERMINISTIC.max_chunk_tokens == 63 and backend.CPU_DETERMINISTIC.batch_invariant
    assert backend.detect() is backend.CPU  # this build has no GPU device
    assert backend.detect(lambda: False, deterministic=True) is backend.CPU_DETERMINISTIC
    with pytest.raises(ConfigError, match="--deterministic"):  # refused, never ignored
        backend.detect(lambda: True, deterministic=True)


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


def test_priority_beats_fair_share_beats_deadline_beats_arrival():
    sched = Scheduler(max_slots=4, policy="continuous", aging_s=1e9)
    for s in (make(tenant=1, priority=LOW), make(tenant=2), make(tenant=3, deadline=50.0),
              make(tenant=4, priority=HIGH)):
        sched.add(s)
    assert admitted_tenants(sched) == [4, 3, 2, 1]  # equal counters: the deadline breaks the tie


def test_a_deadline_does_not_overtake_another_tenants_fair_share():
    """Found by a hostile helper: deadlines came before fair share, so a flooding tenant that set
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


PIECES = [b"Hel", b"lo", b",", b" wor", b"ld", b"\xe4\xbd", b"\xa0", b"\xe5\xa5\xbd", b"!"]


def run(tokens: list[int], stops: list[str]) -> tuple[list[str], str, bool]:
    """Each token's text, the text at the end, and whether a stop string ended the choice, as a
    choice without tools reads them (detokenizer, then stop strings)."""
    choice = ChoiceState(0, PIECES, stops)
    deltas = ["".join(d.text for d in choice.push([Token(t)])) for t in tokens]
    tail = "" if choice.ended else choice.finish("length").text
    return deltas, tail, choice.finish_reason == "stop"


def test_split_code_point_is_never_emitted_in_halves():
    deltas, tail, _ = run([5, 6, 7], [])
    assert deltas == ["", "你", "好"] and tail == ""


def test_stop_inside_one_token_and_across_tokens():
    assert run([0, 1, 2, 3], ["ll"]) == (["He", "", "", ""], "", True)
    deltas, tail, stopped = run([0, 1, 2, 3, 4], ["o, wo"])
    assert "".join(deltas) == "Hell" and stopped and tail == ""
    assert all("o, wo"[:2] not in d for d in deltas)


def test_held_back_prefix_of_a_stop_is_flushed_at_the_end():
    deltas, tail, stopped = run([0, 1], ["lo!"])
    assert deltas == ["He", "l"] and tail == "lo" and not stopped  # "l", then "lo", could start "lo!"


def test_character_cut_short_at_the_end_is_dropped():
    deltas, tail, _ = run([0, 5], [])
    assert deltas == ["Hel", ""] and tail == ""


def _toks(*ids) -> np.ndarray:
    return np.array(ids, np.int32)


def test_prefix_cache_lookup_is_per_tenant_and_longest():
    from engine.prefix_cache import PrefixCache

    cache = PrefixCache(first_stream=4, n_streams=3, max_tokens=100)
    assert cache.insert(1, _toks(1, 2, 3, 4)) == (4, [])
    assert cache.insert(1, _toks(1, 2, 9)) == (5, [])
    assert cache.insert(2, _toks(1, 2, 3, 4, 5)) == (6, [])
    entry, n = cache.lookup(1, _toks(1, 2, 3, 4, 5, 6))
    assert (entry.stream, n) == (4, 4)  # tenant 2's longer entry is not a candidate
    assert cache.lookup(3, _toks(1, 2, 3)) == (None, 0)


def test_prefix_cache_keeps_the_latest_turn_and_evicts_least_recently_used():
    from engine.prefix_cache import PrefixCache

    cache = PrefixCache(first_stream=2, n_streams=2, max_tokens=8)
    assert cache.insert(1, _toks(1, 2, 3)) == (2, [])
    assert cache.insert(1, _toks(1, 2)) == (None, [])  # already covered
    assert cache.insert(1, _toks(1, 2, 3, 4)) == (2, [2])  # extends turn 1: replaces it
    assert cache.insert(1, _toks(7, 8)) == (3, [])
    cache.lookup(1, _toks(1, 2, 3, 4, 5))  # stream 2 is now the most recently used
    assert cache.insert(1, _toks(5, 6, 7)) == (3, [3])  # 4 + 2 + 3 > 8: the LRU entry goes
    assert cache.n_tokens == 7 and len(cache.entries) == 2
    assert cache.insert(1, _toks(*range(20, 29))) == (None, [])  # longer than the whole cache


def test_lone_tokens_mirrors_llama_cpp_micro_batch_split():
    from engine.llama.batch import lone_tokens

    assert lone_tokens({0: 1, 1: 1, 2: 1}, 512) == []  # one micro-batch of three sequences
    assert lone_tokens({0: 1}, 512) == [0]
    assert lone_tokens({0: 1, 2: 1}, 512) == [0, 2]  # a gap in the ids splits the batch
    assert lone_tokens({0: 1, 1: 2}, 512) == [1]  # one token each, then 1's second alone
    assert lone_tokens({0: 1, 1: 3, 2: 2}, 512) == [1]
    assert lone_tokens({0: 40}, 512) == []


def test_private_dir_orphans_are_removed_and_live_ones_kept(tmp_path):
    """A private directory whose master died (its .owner flock is free) goes at the next start;
    one whose owner holds the lock stays; so does an ownerless one a moment old, and another
    prefix's."""
    import fcntl

    from server import private_dir
    from server.gunicorn_conf import RESPONSES_DIR_PREFIX
    from server.observability import metrics_dir

    dead, live, young = (tmp_path / f"{metrics_dir.PREFIX}{n}" for n in ("dead", "live", "young"))
    other = tmp_path / f"{RESPONSES_DIR_PREFIX}dead"
    for d in (dead, live, young, other):
        d.mkdir()
        (d / "responses.db").touch()
    for d in (dead, other):
        (d / ".owner").touch()
    owner = open(live / ".owner", "w")
    fcntl.flock(owner, fcntl.LOCK_EX)
    try:
        assert private_dir.remove_orphans(metrics_dir.PREFIX, str(tmp_path)) == [str(dead)]
        assert live.exists() and young.exists() and other.exists() and not dead.exists()
    finally:
        owner.close()
    assert private_dir.remove_orphans(metrics_dir.PREFIX, str(tmp_path)) == [str(live)]
    created = private_dir.create(RESPONSES_DIR_PREFIX, str(tmp_path))  # removes the dead one first
    assert [p.name for p in (tmp_path / created).iterdir()] == [".owner"]  # renamed into place once locked
    assert not other.exists() and private_dir.remove_orphans(RESPONSES_DIR_PREFIX, str(tmp_path)) == []
    private_dir.remove(created)
    assert not (tmp_path / created).exists()


def test_retire_adds_a_dead_process_counts_into_the_retired_files(tmp_path):
    """Raw per-key sums: what a scrape would add up, before and after, is the same."""
    from prometheus_client.mmap_dict import MmapedDict
    from prometheus_client.multiprocess import MultiProcessCollector

    from server.observability import metrics_dir

    def write(name, values):
        d = MmapedDict(str(tmp_path / name))
        for key, v in values.items():
            d.write_value(key, v, 0.0)
        d.close()

    key = '["inference_requests", "inference_requests_total", {"route": "/x"}, "h"]'
    bucket = '["inference_latency_seconds", "inference_latency_seconds_bucket", {"le": "1.0"}, "h"]'
    write("counter_111.db", {key: 3.0})
    write("counter_222.db", {key: 4.0})
    write("histogram_111.db", {bucket: 2.0})
    write("counter_retired.db", {key: 10.0})
    (tmp_path / ".lock").touch()

    def totals():
        return {s.name: s.value for m in MultiProcessCollector(None, str(tmp_path)).collect() for s in m.samples}

    before = totals()
    metrics_dir.retire(111, str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.db")) == ["counter_222.db", "counter_retired.db",
                                                             "histogram_retired.db"]
    assert totals() == before and before["inference_requests_total"] == 17.0


class _FakeCpus:
    """Scripted /proc counters: each step, ``others`` CPUs' worth of ticks by other processes and
    ``own`` by the engine, over 2 CPUs and 0.5 s (100 ticks/s per CPU)."""

    def __init__(self):
        self.t, self.busy, self.total, self.own_ticks = 0.0, 0, 0, 0

    def advance(self, others: float, own: float, seconds: float = 0.5):
        self.t += seconds
        ticks = int(100 * seconds)
        self.total += 2 * ticks
        self.busy += int((others + own) * ticks)
        self.own_ticks += int(own * ticks)

    def clock(self):
        return self.t

    def cpus(self, _):
        return self.busy, self.total

    def own(self):
        return self.own_ticks


def test_adaptive_threads_follow_other_processes_with_hysteresis():
    from engine.threads import AdaptiveThreads

    fake = _FakeCpus()
    adaptive = AdaptiveThreads(2, cpus={0, 1}, clock=fake.clock, read_cpus=fake.cpus, read_own=fake.own)
    seen = []
    for others in [0.1, 0.1, 1.0, 0.1, 1.0, 1.0, 1.0, 0.2, 0.2, 0.2]:
        fake.advance(others, own=2.0 - min(others, 1.0))
        seen.append(adaptive.threads())
    # One busy sample (a burst) changes nothing; two in a row drop to 1; two free ones restore 2.
    assert seen == [2, 2, 2, 2, 2, 1, 1, 2, 2, 2][:1] + seen[1:] and seen[5] == 1 and seen[-1] == 2
    assert seen[:5] == [2, 2, 2, 2, 2] and seen[5:7] == [1, 1] and seen[7] == 1 and seen[8] == 2
    fake.t += 0.1  # within a sample period: no new reading
    assert adaptive.threads() == 2


def test_adaptive_threads_start_at_one_and_let_a_sample_they_can_trust_decide_alone():
    """The first decode after start or idle is often the largest (a prefill of every queued
    prompt): it must not run on a count the current contention makes pathological."""
    from engine.threads import AdaptiveThreads

    fake = _FakeCpus()
    adaptive = AdaptiveThreads(2, cpus={0, 1}, clock=fake.clock, read_cpus=fake.cpus, read_own=fake.own)
    assert adaptive.threads() == 1  # nothing sampled yet: one thread is safe under any contention
    fake.advance(1.0, own=0.0)  # a busy neighbour while the model loads
    assert adaptive.threads() == 1  # the first sample (it spans the load) decides alone
    fake.advance(0.0, own=0.0)  # the neighbour left while the engine idled: idle samples vote
    assert adaptive.threads() == 1
    fake.advance(0.0, own=0.0)
    assert adaptive.threads() == 2  # two in a row, before any decode
    fake.advance(1.0, own=0.0)  # a burst while idle (a client process starting) moves nothing
    assert adaptive.threads() == 2
    fake.advance(0.0, own=0.0)
    assert adaptive.threads() == 2
    fake.advance(1.0, own=1.0, seconds=1.0)  # one sample over a long interval decides alone
    assert adaptive.threads() == 1
    fake.advance(0.0, own=2.0)  # a short sample while decoding needs a second one
    assert adaptive.threads() == 1
    fake.advance(0.0, own=2.0)
    assert adaptive.threads() == 2


def test_adaptive_threads_take_every_cpu_when_one_thread_waits_on_the_run_queue():
    """Two busy processes on two CPUs: one engine thread gets a third of the machine and waits a
    third of the time on the run queue; two threads that sleep at the barrier get half. One busy
    process leaves one thread a whole CPU: it waits about nothing, and one thread stays
    (engine/threads.py; the waits are the ones measured there)."""
    from engine.threads import RECHECK_S, AdaptiveThreads

    for brief, expected in ((False, 1), (True, 2)):  # long spinners stay on one thread
        fake, waited = _FakeCpus(), [0.0]
        adaptive = AdaptiveThreads(2, cpus={0, 1}, clock=fake.clock, read_cpus=fake.cpus, read_own=fake.own,
                                   read_wait=lambda: waited[0], brief_wait=brief)
        fake.advance(4 / 3, own=2 / 3)  # the model loads on one thread beside two busy processes
        waited[0] += 0.5 / 3
        assert adaptive.threads() == expected, brief  # the first sample decides alone
        for _ in range(int(RECHECK_S / 0.5) - 2):  # two threads get half the CPUs and wait as much
            fake.advance(1.0, own=1.0) if adaptive.current == 2 else fake.advance(4 / 3, own=2 / 3)
            waited[0] += 0.35
            assert adaptive.threads() == expected
    # Past RECHECK_S the ordinary rule takes it to one thread (two samples), which looks again:
    # still starved, so back to two after two more.
    seen = []
    for _ in range(8):
        if adaptive.current == 2:
            fake.advance(1.0, own=1.0)
            waited[0] += 0.35
        else:
            fake.advance(4 / 3, own=2 / 3)
            waited[0] += 0.5 / 3
        seen.append(adaptive.threads())
    assert 1 in seen and seen[-1] == 2, seen

    fake, waited = _FakeCpus(), [0.0]
    adaptive = AdaptiveThreads(2, cpus={0, 1}, clock=fake.clock, read_cpus=fake.cpus, read_own=fake.own,
                               read_wait=lambda: waited[0], brief_wait=True)
    for _ in range(4):  # one busy process beside one thread and the front ends' bursts
        fake.advance(1.2, own=0.8)
        waited[0] += 0.005
        assert adaptive.threads() == 1


@pytest.mark.parametrize("environ, extra, brief", [
    ({}, {"GOMP_SPINCOUNT": "3000"}, True),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {}, False),
    ({"OMP_WAIT_POLICY": "passive"}, {}, True),
    ({"GOMP_SPINCOUNT": "300000"}, {}, False),
    ({"GOMP_SPINCOUNT": "1k"}, {}, False),  # libgomp's suffixes are not read here: the safe answer
    ({"GOMP_SPINCOUNT": "100", "OMP_WAIT_POLICY": "ACTIVE"}, {}, True),  # the count wins in libgomp
])
def test_the_engine_spins_briefly_unless_the_operator_chose(environ, extra, brief):
    from engine.threads import wait_environment, waits_briefly

    assert wait_environment(environ) == extra
    assert waits_briefly({**environ, **extra}) is brief


@pytest.mark.parametrize("files,expected", [
    ({"cgroup": "0::/pod/c1\n", "pod/c1/cpu.max": "150000 100000\n"}, 1.5),
    ({"cgroup": "0::/\n", "cpu.max": "max 100000\n"}, None),
    ({"cgroup": "4:cpu,cpuacct:/inftest\n", "cpu,cpuacct/inftest/cpu.cfs_quota_us": "100000\n",
      "cpu,cpuacct/inftest/cpu.cfs_period_us": "100000\n"}, 1.0),
    ({"cgroup": "4:cpu,cpuacct:/x\n", "cpu/x/cpu.cfs_quota_us": "-1\n", "cpu/x/cpu.cfs_period_us": "100000\n"}, None),
    ({"cgroup": "4:memory:/x\n"}, None),
])
def test_cgroup_cpu_limit_reads_v1_and_v2(tmp_path, files, expected):
    from engine.threads import cgroup_cpu_limit

    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert cgroup_cpu_limit(str(tmp_path / "cgroup"), str(tmp_path)) == expected


def test_adaptive_threads_stay_within_the_cpu_quota():
    from engine.threads import AdaptiveThreads

    fake, limit = _FakeCpus(), [1.0]
    adaptive = AdaptiveThreads(2, cpus={0, 1}, clock=fake.clock, read_cpus=fake.cpus, read_own=fake.own,
                               read_limit=lambda: limit[0])
    assert adaptive.threads() == 1  # a 1-CPU container: no second thread to be throttled for
    limit[0] = 2.0  # resized
    for _ in range(2):
        fake.advance(0.0, own=1.0)
        adaptive.threads()
    assert adaptive.threads() == 2


def test_request_record_carries_kind_and_a_bounded_variable_section():
    """logit_bias travels in the record's variable section; the kind in the fixed part; a
    request needing more room than the server's bound is refused naming the field."""
    from engine.errors import InvalidRequest
    from engine.request import RequestKind, extras_room, record_bytes

    params = SamplingParams(max_new_tokens=4, logit_bias=((5, -100), (7, 2.5)), stop_ids=(9,))
    request = EngineRequest(np.array([1, 2, 3], np.int32), params, HIGH, 0.0, 3, 2.0, RequestKind.SCORE)
    payload = np.zeros(record_bytes(16, 64), np.uint8)
    assert extras_room(len(payload), 16) == 64
    request.resolved(16, 64).encode(payload, 16)
    back = EngineRequest.decode(payload, 16)
    assert back.kind == RequestKind.SCORE and back.tenant == 3 and back.prompt.tolist() == [1, 2, 3]
    assert back.sampling == params and back.sampling.logit_bias == ((5, -100.0), (7, 2.5))
    plain = EngineRequest(np.array([1], np.int32), SamplingParams(max_new_tokens=1))
    assert plain.extras() == b"" and plain.resolved(16, 0) is plain  # no blob: no room needed
    with pytest.raises(InvalidRequest) as e:
        request.resolved(16, 8)
    assert e.value.param == "logit_bias" and "--max-request-extras-bytes" in str(e.value)
    for bad in (((1, 101),), ((-1, 0),), ((1.5, 0),)):
        with pytest.raises(InvalidRequest):
            SamplingParams(logit_bias=bad)


def test_logprobs_of_many_rows_match_float64():
    """engine.llama.logprobs: every row's log-softmax at the chosen token and its top k, in both
    of its branches (logits within the unshifted bounds, and not), on one thread and two."""
    from engine.llama.logprobs import LogProbs

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((37, 5000)) * 4).astype(np.float32)
    logits[3] += 200  # past UNSHIFTED: this row is shifted by its maximum
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie: the lower id first
    tokens = rng.integers(0, 5000, 37)
    x = logits.astype(np.float64)
    ref = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    for threads in (1, 2):
        lp = LogProbs(5000, threads)
        got, ids, top = lp.rows(logits, tokens, 3)
        assert np.abs(got - ref[np.arange(37), tokens]).max() < 1e-5
        assert ids[5, :2].tolist() == [7, 9]
        assert (ids == np.argsort(-x, axis=1, kind="stable")[:, :3]).all()
        assert np.abs(top - np.take_along_axis(ref, ids.astype(np.int64), 1)).max() < 1e-5
        for row in (3, 4):  # a row alone gets what it got in a block (the shifted row too)
            one = lp.one(logits[row], int(tokens[row]), 1)
            assert one[0] == got[row] and one[1].tolist() == [ids[row, 0]]
        assert lp.rows(logits, tokens, 0)[1].shape == (37, 0)
        lp.close()


@pytest.mark.parametrize("end, outcome", [
    ("SIGILL", "faults"),  # tilezero an invalid opcode (one kind of VM)
    ("SIGSEGV", "faults"),  # ldtilecfg a general protection fault (another): "runs" was said there
    ("SIGBUS", "faults"),
    ("SIGTERM", "runs"), ("raise", "runs"), ("return", "runs"),
    ("hang", "hangs"),  # a forked probe once deadlocked under pytest-xdist: the start waited forever
])
def test_the_amx_probe_counts_every_fault_signal_and_nothing_else(end, outcome):
    import sys

    from engine.llama.library import run_outcome

    body = {"raise": "raise RuntimeError('llama.cpp refused the model')", "return": "pass",
            "hang": "import time; time.sleep(60)"}.get(
        end, f"import os, signal; os.kill(os.getpid(), signal.{end})")
    assert run_outcome([sys.executable, "-c", body], timeout_s=2.0) == outcome


def test_every_engine_option_reaches_the_engine():
    """Each ``--flag`` declared with ``engine=`` arrives in EngineConfig under that name (the
    request-extras bound once never did), and the KV budget refuses what cannot hold one sequence."""
    from dataclasses import fields

    from server.config import ServerConfig, from_args

    engine_fields = [f for f in fields(ServerConfig) if f.metadata.get("engine")]
    assert {f.metadata["engine"] for f in engine_fields} >= {"kv_cache_tokens", "max_request_extras_bytes"}
    defaults = from_args([], environ={})
    for f in engine_fields:
        if isinstance(getattr(defaults, f.name), bool):
            continue  # switches: checked through their own tests
        value = getattr(defaults, f.name)
        changed = {"policy": "fifo", "weights": "file"}.get(f.metadata["engine"], value + 1 if isinstance(value, int)
                                                            else value * 2)
        config = ServerConfig(**{**{g.name: getattr(defaults, g.name) for g in fields(ServerConfig)},
                                 f.name: changed})
        assert getattr(config.engine_config(), f.metadata["engine"]) == changed, f.name
    with pytest.raises(ConfigError, match="kv_cache_tokens must be >= max_seq_len"):
        from_args(["--kv-cache-tokens", "4096"], environ={}).engine_config()
