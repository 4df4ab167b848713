"""Shared-memory hygiene on ``/dev/shm`` (``shm.segment``): a segment that cannot fit refuses
to start, with the numbers and the fix, instead of a SIGBUS under load; a crashed server's
leftovers are removed by the next start.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from engine.config import EngineConfig
from server import private_dir
from server.gunicorn_conf import RESPONSES_DIR_PREFIX
from server.observability import metrics_dir
from shm import segment
from shm.transport import Transport
from tests.support.servers import free_port, running_server


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def test_every_page_is_reserved_at_creation():
    """tmpfs allocates lazily; the segment's pages are all allocated before anyone uses it."""
    with Transport.create(EngineConfig(max_slots=2, max_seq_len=4096, max_queued=2).layout()) as t:
        st = os.stat(f"/dev/shm/{t.name}")
        assert st.st_blocks * 512 >= st.st_size > 4096 * 4 * 168


def test_a_segment_larger_than_dev_shm_is_refused_with_the_numbers():
    free = segment.available_bytes()
    # more tokens per mailbox than the whole file system holds: refused before any page is used
    config = EngineConfig(max_slots=1, max_queued=0, max_seq_len=8)
    layout = config.layout().__class__(1, 1, free // 160 + 1, 64)
    with pytest.raises(segment.SharedMemoryTooSmall) as e:
        Transport.create(layout, name="infer-test-toolarge")
    assert e.value.needed > free >= e.value.available - (1 << 20)
    assert "MiB free" in str(e.value) and "--shm-size" in str(e.value)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("infer-test-toolarge")]


@pytest.mark.skipif(not _unshare_works(), reason="needs a private mount namespace (unshare -m, as root)")
def test_server_refuses_to_start_when_dev_shm_is_too_small():
    """Docker's default: a 64 MB ``/dev/shm``; ``--max-seq-len 8192`` needs about 110 MiB. The
    server exits at once with one line, instead of starting "healthy" and dying with SIGBUS."""
    script = ("mount -t tmpfs -o size=64m tmpfs /dev/shm && "
              f"exec {sys.executable} -m server.cli --port {free_port()} --grpc-port 0 --workers 1 --max-seq-len 8192")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if "needs" in line]
    assert len(lines) == 1, r.stdout + r.stderr
    assert "/dev/shm has 64.0 MiB free" in lines[0] and "shared memory segment needs 110" in lines[0]
    assert "--max-seq-len" in lines[0] and "shm_size" in lines[0] and "medium: Memory" in lines[0]


def test_an_owner_file_appears_only_locked(tmp_path):
    """``OwnerLock`` renames its file into place once locked: a sweep between a folder's creation
    and its lock sees a young ownerless folder, never a free lock it would take for a dead
    owner's (a starting server lost its folder so to another's sweep). A crash before the rename
    leaves a folder that is swept once old."""
    folder = tmp_path / f"{segment.PREFIX}young.d"
    folder.mkdir()
    assert not segment.owner_gone(str(folder))
    (folder / f"{segment.OWNER_FILE}.new").touch()  # the crash between creating and renaming
    assert not segment.owner_gone(str(folder))
    old = time.time() - segment.OWNERLESS_S - 1
    os.utime(folder, (old, old))
    assert segment.owner_gone(str(folder))
    (folder / f"{segment.OWNER_FILE}.new").unlink()
    lock = segment.OwnerLock(str(folder))
    assert os.listdir(folder) == [segment.OWNER_FILE] and not segment.owner_gone(str(folder))
    lock.release()
    assert segment.owner_gone(str(folder))


def _private_dirs(pid: int) -> list[str]:
    """The private directories (metrics, the Responses store: server.private_dir) whose owner
    lock process ``pid`` holds open."""
    dirs = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if os.path.basename(target) == private_dir.OWNER:
            dirs.append(os.path.dirname(target))
    return sorted(dirs)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


SYS_PIDFD_GETFD = 438  # asm-generic/unistd.h: the same number on every architecture


@contextlib.contextmanager
def _hold_lock_of(pid: int, path: str):
    """Keep the ``flock`` process ``pid`` holds on ``path`` held after ``pid`` and every process
    sharing it die, until the block ends: the lock belongs to the open file, and this process
    gets a descriptor of that very file (``pidfd_getfd``, Linux 5.6; ``pid`` must be a child).

    Any server another test starts sweeps /dev/shm, and takes a folder whose owner lock is free
    for a dead server's; with the lock held here, what a killed server left stays until the
    test has looked. (Queuing for the lock as the holders die left a moment in which a sweep
    could take it first.)
    """
    fd = next(int(n) for n in os.listdir(f"/proc/{pid}/fd") if _link(f"/proc/{pid}/fd/{n}") == path)
    pidfd = os.pidfd_open(pid)
    try:
        held = ctypes.CDLL(None, use_errno=True).syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
    finally:
        os.close(pidfd)
    assert held >= 0, f"pidfd_getfd: {os.strerror(ctypes.get_errno())}"
    try:
        yield
    finally:
        os.close(held)


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


@pytest.mark.parametrize("kill", ["group", "master"])
def test_a_killed_servers_segment_is_removed_by_the_next_start(kill):
    """SIGKILL of the whole server (master, workers, engine, Python's resource tracker: a
    container's end) leaves its segment and FIFO folder; SIGKILL of the master alone leaves at
    least the folder (the resource tracker may unlink the segment). The next start removes
    them and its private directories (metrics, the Responses store), while a live server's stay."""
    # Short sequences: the KV cache llama.cpp writes zeros over at start is small, and so is the start.
    flags = ("--workers", "1", "--max-slots", "2", "--max-queued", "2", "--max-seq-len", "256")
    with running_server(*flags) as live:
        with running_server(*flags, new_session=True) as dead:
            owned = _private_dirs(dead.proc.pid)
            prefixes = (metrics_dir.PREFIX, RESPONSES_DIR_PREFIX)
            assert sorted(p for d in owned for p in prefixes if os.path.basename(d).startswith(p)) == \
                sorted(prefixes), owned
            children = dead.children()
            # Held here, the owner lock keeps every other test's sweep off the leftovers until
            # the start below.
            with _hold_lock_of(dead.proc.pid, f"/dev/shm/{dead.shm}.d/{segment.OWNER_FILE}"):
                if kill == "group":
                    os.killpg(dead.proc.pid, signal.SIGKILL)
                else:
                    os.kill(dead.proc.pid, signal.SIGKILL)
                dead.proc.wait()
                end = time.monotonic() + 60
                while any(_alive(p) for p in children):  # workers notice their parent's death
                    assert time.monotonic() < end, [p for p in children if _alive(p)]
                    time.sleep(0.1)
                left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(dead.shm))
                if kill == "group":
                    assert left == [dead.shm, dead.shm + ".d"]
                else:
                    assert dead.shm + ".d" in left
            with running_server(*flags):
                assert not [n for n in os.listdir("/dev/shm") if n.startswith(dead.shm)]
                assert not [d for d in owned if os.path.exists(d)]
                live_dirs = _private_dirs(live.proc.pid)
                assert len(live_dirs) == 2 and all(os.path.exists(d) for d in live_dirs)
                assert os.path.exists(f"/dev/shm/{live.shm}") and os.path.isdir(f"/dev/shm/{live.shm}.d")
