"""How many compute threads the next ``llama_decode`` gets, and how they wait: all of this
process's CPUs while nothing else wants them, fewer while other processes keep some busy, all of
them again when others want every CPU (docs/performance.md "Threads").

Why adapt: llama.cpp's threads meet at a barrier after every operation of the graph. Threads
that spin at it are fastest on an idle machine; but when another process holds one of the
CPUs, a spinning thread waits for a partner that is not running, and throughput collapses (to
about half of one thread's here: docs/performance.md "Threads"). With one thread there is no
barrier at all.

How they wait: the engine process starts with ``GOMP_SPINCOUNT`` = :data:`SPIN_COUNT`
(:func:`wait_environment`; libgomp's own default, with no ``OMP_WAIT_POLICY``, is 300,000 spins
and then sleep), unless the operator set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``. Measured
here (``bench.threads``): as fast as the long spin on an idle machine, within noise, and two
threads that spin briefly then sleep are not pathological beside busy processes, where two
long-spinning threads fall to a tenth of one thread's speed. libgomp reads it once, at start.

The signal is the CPU time other processes spent on this process's CPUs (``/proc/stat``'s
per-CPU counters minus this process's own time from ``/proc/self/stat``), sampled every
:data:`SAMPLE_S` seconds: before decodes, and by the engine loop while it waits idle, so the
first decode after an idle spell already has the right count. Threads = CPUs minus the CPUs
others keep busy (rounded), at least 1, at most the configured maximum and at most the whole
CPUs of the cgroup's CPU quota (a container's ``cpu.max``: threads beyond it only get the
container throttled; re-read every sample, so a resized container is followed).

But when others want every CPU, one thread is not best either: it gets only its fair share of
a full machine (a third of the two CPUs beside two busy processes), and two threads that spin
briefly and then sleep get half. Others' use cannot tell that case apart (one busy process takes
a CPU either way), so the second signal is this process's own wait on the kernel's run queues
(``/proc/self/task/*/schedstat``, its second field: measured on one thread beside one busy
process, 0.01 thread-seconds a second; beside two, 0.33). On one thread, a wait above
:data:`STARVED` means others want every CPU: the count becomes one per CPU (when the threads wait
briefly, :func:`waits_briefly`; long spinners would collapse). With one thread per CPU both cases
look alike, so the engine stays there while others stay busy, and every :data:`RECHECK_S`
seconds lets the ordinary rule take it back to fewer threads, to look again.

Which samples decide: a change needs :data:`AGREE` samples in a row, so a short burst (a
request's tokenization, a client process starting) moves nothing, and a lasting one is followed
within about a second; the engine's idle loop samples too, so the count is current when the
first decode after an idle spell comes. A sample alone decides when it is as good as that: one
that spans at least ``AGREE * SAMPLE_S`` seconds, and the first one, which the engine process
starts before it loads the model, so it spans the load. Until that first sample the count is 1:
a decode on one thread is at worst about half as fast on an idle machine, while two spinning
threads beside a busy process are slower still, and the first decode after start is often the
largest (every queued prompt's prefill).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Mapping

log = logging.getLogger("engine.threads")

#: Seconds between samples of the CPUs' use.
SAMPLE_S = 0.5
#: Consecutive samples that must ask for the same new thread count before it is taken.
AGREE = 2
#: Others' use (CPUs) below which a CPU counts as free; above it, as taken.
TAKEN_ABOVE = 0.5
#: Thread-seconds a second that one engine thread waits on a run queue above which others want
#: every CPU (measured: 0.01 beside one busy process, 0.33 beside two).
STARVED = 0.2
#: Seconds the engine keeps one thread per CPU beside others that want every CPU before it looks
#: again on fewer threads (those looks cost about a tenth of the time at the slower count).
RECHECK_S = 10.0
#: libgomp's spin count at a barrier before its thread sleeps, for the engine (``GOMP_SPINCOUNT``).
SPIN_COUNT = 3000


def wait_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait setting the engine process gets on top of ``environ``: ``GOMP_SPINCOUNT``
    = :data:`SPIN_COUNT`, unless ``environ`` sets ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``
    (the operator's choice reaches the engine unchanged). libgomp's variables: GCC's libgomp
    manual, "GOMP_SPINCOUNT"."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def waits_briefly(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether libgomp's threads sleep soon at a barrier under ``environ``: a ``GOMP_SPINCOUNT``
    of at most :data:`SPIN_COUNT` spins, or ``OMP_WAIT_POLICY=PASSIVE`` without one. Only then
    may the engine run a thread per CPU while others want every CPU (the module doc)."""
    spins = environ.get("GOMP_SPINCOUNT")
    if spins is not None:
        return spins.strip().isdigit() and int(spins) <= SPIN_COUNT
    return environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def _cpu_jiffies(cpus: set[int], path: str = "/proc/stat") -> tuple[int, int]:
    """``(busy, total)`` clock ticks of ``cpus`` since boot (``/proc/stat``, proc(5)). Steal (a
    virtual CPU's time given to another guest by the hypervisor) is in the total, not busy: no
    process here takes it, and fewer threads would not get it back."""
    busy = total = 0
    with open(path) as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *values = line.split()
            if int(name[3:]) not in cpus:
                continue
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4] - ticks[7]
    return busy, total


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs per period this process's cgroup may use: cgroup v2 ``cpu.max``, or v1
    ``cpu.cfs_quota_us / cpu.cfs_period_us`` (kernel docs, "Control Group v2" and "CFS Bandwidth
    Control"). None when unlimited or unreadable."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        try:
            if controllers == "":  # v2: "max 100000" or "150000 100000"
                with open(os.path.join(root, path, "cpu.max")) as f:
                    quota, period = f.read().split()
                if quota != "max":
                    return int(quota) / int(period)
            elif "cpu" in controllers.split(","):
                for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                    base = os.path.join(root, mount, path)
                    if os.path.exists(os.path.join(base, "cpu.cfs_quota_us")):
                        with open(os.path.join(base, "cpu.cfs_quota_us")) as q, \
                                open(os.path.join(base, "cpu.cfs_period_us")) as p:
                            quota, period = int(q.read()), int(p.read())
                        if quota > 0:
                            return quota / period
                        break
        except (OSError, ValueError):
            continue
    return None


def _own_run_queue_wait(task_dir: str = "/proc/self/task") -> float:
    """Seconds this process's threads have waited on a run queue, all threads together
    (``/proc/<pid>/task/<tid>/schedstat``, second field, nanoseconds: kernel docs "sched-stats");
    threads that end between the listing and the read are skipped."""
    waited = 0
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "schedstat")) as f:
                waited += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return waited / 1e9


def _own_jiffies(path: str = "/proc/self/stat") -> int:
    """This process's user + system clock ticks, all threads (proc(5), fields 14 and 15)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class AdaptiveThreads:
    """The thread count for the next decode.

    Args:
        max_threads: the most threads (the configured or default count).
        cpus: the CPUs this process may run on (default: its affinity).
        clock: monotonic seconds. read_cpus, read_own: ``(busy, total)`` ticks of ``cpus`` and
            this process's ticks; read_wait: seconds its threads waited on a run queue;
            read_limit: the cgroup's CPU quota in CPUs (tests give their own).
    """

    def __init__(self, max_threads: int, cpus: set[int] | None = None, clock: Callable[[], float] = time.monotonic,
                 read_cpus: Callable[[set[int]], tuple[int, int]] = _cpu_jiffies,
                 read_own: Callable[[], int] = _own_jiffies, read_wait: Callable[[], float] = _own_run_queue_wait,
                 read_limit: Callable[[], float | None] = cgroup_cpu_limit, brief_wait: bool | None = None):
        self.cpus = cpus or set(os.sched_getaffinity(0))
        self.max_threads = max(1, max_threads)
        self.clock, self.read_cpus, self.read_own, self.read_limit = clock, read_cpus, read_own, read_limit
        self.read_wait = read_wait
        self.brief_wait = waits_briefly() if brief_wait is None else brief_wait
        self.current = 1  # until the first sample: the safe count under any contention (module doc)
        self.others = 0.0  # CPUs others kept busy in the last sample
        self.waited = 0.0  # thread-seconds a second this process waited on run queues, last sample
        self._sharing_since: float | None = None  # one thread per CPU beside others wanting all, since
        self._last = self._read()
        self._sampled = False
        self._wanted, self._votes = self.current, 0

    def _cap(self) -> int:
        """The most threads now: the configured maximum within the cgroup's whole CPUs."""
        limit = self.read_limit()
        return self.max_threads if limit is None else max(1, min(self.max_threads, int(limit + 0.01)))

    def _read(self) -> tuple[float, int, int, int]:
        busy, total = self.read_cpus(self.cpus)
        return self.clock(), busy, total, self.read_own(), self.read_wait()

    def _wanted_count(self, now: float) -> int:
        """The count the last sample asks for (the module doc): CPUs minus those others keep busy,
        or one per CPU while others want every CPU."""
        n, cap = len(self.cpus), self._cap()
        taken = int(self.others + (1 - TAKEN_ABOVE))  # rounds at TAKEN_ABOVE
        wanted = max(1, min(cap, n - taken))
        if not (self.brief_wait and taken and wanted < cap):
            self._sharing_since = None
            return wanted
        if self.current == 1 and self.waited > STARVED:
            self._sharing_since = now
        sharing = self._sharing_since is not None and now - self._sharing_since < RECHECK_S
        return cap if sharing else wanted

    def threads(self) -> int:
        """The thread count to decode with now (samples when :data:`SAMPLE_S` has passed; the
        engine calls it before every decode and at every idle wait that times out)."""
        now = self.clock()
        if now - self._last[0] < SAMPLE_S:
            return self.current
        sample = self._read()
        t0, busy0, total0, own0, wait0 = self._last
        t1, busy1, total1, own1, wait1 = sample
        self._last = sample
        if total1 <= total0:
            return self.current
        # Ticks of all listed CPUs over the interval: the share others kept busy, in CPUs.
        others = max(0, (busy1 - busy0) - (own1 - own0))
        self.others = others / (total1 - total0) * len(self.cpus)
        self.waited = max(0.0, wait1 - wait0) / max(t1 - t0, 1e-9)
        wanted = self._wanted_count(t1)
        decides_alone = not self._sampled or t1 - t0 >= AGREE * SAMPLE_S
        self._sampled = True
        if wanted == self.current:
            self._votes = 0
            return self.current
        self._votes = self._votes + 1 if wanted == self._wanted else 1
        self._wanted = wanted
        if self._votes >= AGREE or decides_alone:
            log.debug("compute threads %d -> %d (other processes kept %.2f of %d CPUs busy; waited %.2f)",
                      self.current, wanted, self.others, len(self.cpus), self.waited)
            self.current, self._votes = wanted, 0
        return self.current
