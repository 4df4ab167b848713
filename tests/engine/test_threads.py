"""The engine's compute threads (engine/threads.py) on scripted /proc counters: the adaptive count
follows other processes with hysteresis, starts at one, takes every CPU when one thread waits on
the run queue, stays within the cgroup's CPU quota; the OpenMP wait environment; cgroup v1 and v2
CPU limits."""
from __future__ import annotations

import pytest


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


def test_steal_counts_in_the_total_and_not_as_other_processes_busy(tmp_path):
    """A virtual machine's steal (proc(5): the eighth counter of a ``cpuN`` line) is no process
    here: busy is user + nice + system + irq + softirq, the total every counter; the summary
    ``cpu`` line and CPUs not asked for are left out."""
    from engine.threads import _cpu_jiffies

    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 90 900 9 0 9 900 0 0\n"
                    "cpu0 100 1 10 500 5 2 3 300 0 0\n"
                    "cpu1 200 0 20 400 4 1 1 600 0 0\n"
                    "cpu2 7 7 7 7 7 7 7 7 0 0\n"
                    "intr 1 2 3\n")
    busy, total = _cpu_jiffies({0, 1}, str(stat))
    assert busy == (100 + 1 + 10 + 2 + 3) + (200 + 20 + 1 + 1)
    assert total == (100 + 1 + 10 + 500 + 5 + 2 + 3 + 300) + (200 + 20 + 400 + 4 + 1 + 1 + 600)
