"""Gunicorn configuration module with the server hooks.

``inference-server`` runs gunicorn with it; to run gunicorn yourself::

    MODEL_PATH=... PORT=8080 gunicorn -c python:server.gunicorn_conf server.wsgi:app

Settings come from the same environment variables as the CLI flags (``server.config``).
The master process owns the shared memory and the engine: ``on_starting`` validates the
configuration and the files (the model's metadata and chat template: docs/architecture.md
"Start-up"), ``when_ready`` (the port is bound) creates the transport, starts the engine
supervisor and the gRPC sidecar (``server.grpc.keeper``) and logs the model it serves, under
which names, with chat or not, before any worker forks; a worker that cannot build its app stops
the master through :func:`worker_cannot_start`; ``child_exit``
reclaims the
mailboxes a dead worker leased; ``on_exit`` stops the engine and unlinks the shared memory;
SIGTERM drains first (``_drain``);
``pre_request`` closes the connection of a request whose body is over the limit; ``when_ready``
and ``post_worker_init`` make SIGHUP reload the tenant file. With metrics on, ``when_ready``
prepares prometheus-client's multiprocess directory first and every child's exit retires its
files (``server.observability.metrics_dir``).
"""
from __future__ import annotations

import ctypes
import functools
import gc
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

from engine.config import ConfigError, one_line
from engine.supervisor import EngineSupervisor, SharedMemoryTooSmall
from server import private_dir
from server.config import ServerConfig
from server.grpc.keeper import Sidecar, check_port as check_grpc_port
from server.http.worker import discard_body
from server.observability import metrics_dir
from server.responses.store import RESPONSES_DB_ENV, create_database
from server.structured.schema import SEPARATORS
from server.control.state import ControlPlane
from server.tenancy.tenants import Tenants

#: The private directory of the Responses store's SQLite file without ``--redis-url``.
RESPONSES_DIR_PREFIX = "inference-responses-"

try:
    _config = ServerConfig.from_env()
    threads = _config.front_end_threads  # every model's slots and queue places: the models are read
except ConfigError as e:  # gunicorn would print a traceback; one line is enough
    raise SystemExit(f"inference-server: {e}") from None

bind = [_config.address(_config.port)] + ([_config.address(_config.metrics_port)] if _config.metrics_port else [])
workers = _config.workers
# gthread, where no thread waits for a slow client's request head, and a refused body is read
# before the close (server.http.worker).
worker_class = "server.http.worker.Worker"
# Seconds a worker gets to finish after the master's SIGTERM. The drain (see ``_drain``) has
# already ended every request by then, so only final writes remain; after a third SIGTERM (halt
# at once) what still runs is cut after this long.
graceful_timeout = 5
keepalive = 5
timeout = 120
proc_name = "inference-server"
# gunicorn's control socket lives at one fixed path per user: several servers on one machine
# (tests, replicas) would fight over it, and nothing here uses it.
control_socket_disable = True
# Workers' heartbeat files on tmpfs: no disk writes, and the container's root may be read-only.
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None

_state: dict = {}


def on_starting(server) -> None:
    """Check the files and the gRPC port before anything starts."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        _config.check_files()
        _config.check_memory()
        _state["tenants"] = Tenants.load(_config.tenants_file or None)
        # which projects and keys are in force, and from where (this also creates the node's
        # SQLite file before any worker opens it)
        control = ControlPlane.of(_config, _state["tenants"])
        server.log.info("tenants: %s", control.describe())
        for line in control.unserved_models(_config.model_ids):
            server.log.warning("tenants: %s", line)
        if _config.grpc_port:
            check_grpc_port(_config.host, _config.grpc_port)
    except ConfigError as e:
        raise SystemExit(f"inference-server: {e}") from None


def _start_engine(server) -> None:
    """The metrics directory, shared memory and the engine, once the port is bound (a failed
    bind leaves nothing)."""
    if _config.metrics:  # before any process that records metrics exists (server.observability.metrics_dir)
        try:
            _state["metrics_dir"] = metrics_dir.prepare()
        except OSError as e:
            raise SystemExit(f"inference-server: {metrics_dir.ENV}: {e}") from None
        server.log.info("metrics: prometheus-client multiprocess directory %s", _state["metrics_dir"][0])
        # Loaded now rather than at the first child's exit (metrics_dir.retire, ENGINE_RESTARTS),
        # so the master's memory does not grow later (bench.soak checks every process's RSS).
        import prometheus_client.multiprocess  # noqa: F401
        from server.observability import metrics as _metrics  # noqa: F401
    if not _config.redis_url:
        _state["responses_dir"] = private_dir.create(RESPONSES_DIR_PREFIX)
        path = os.path.join(_state["responses_dir"], "responses.db")
        create_database(path)  # before any worker opens it (server.responses.store)
        os.environ[RESPONSES_DB_ENV] = path
    # INFERENCE_SHM may name the first model's segment in advance (tests attach to it to inspect
    # the engine); the workers get every model's, in the models' order.
    named = (os.environ.get("INFERENCE_SHM") or "").split(",")
    supervisors = _state["supervisors"] = {}
    for i, spec in enumerate(_config.models):
        engine = _config.engine_config(spec)
        try:
            supervisor = EngineSupervisor.create(engine, name=(named[i] if i < len(named) else "") or None,
                                                 on_exit=functools.partial(_engine_exited, spec.id))
        except SharedMemoryTooSmall as e:
            on_exit(server)
            raise SystemExit(f"inference-server: {e}") from None
        supervisors[spec.id] = supervisor
        supervisor.start()
        server.log.info("engine of %s starting: %d slots x %d tokens, policy %s, %d threads; shared memory %s",
                        spec.id, engine.max_slots, engine.max_seq_len, engine.policy, engine.threads,
                        supervisor.transport_name)
        server.log.info("model %s, served as %s; %s", engine.model_path, ", ".join(spec.names), _serves(spec))
    os.environ["INFERENCE_SHM"] = ",".join(s.transport_name for s in supervisors.values())
    # What every worker imports to build its app, and every model's tokenizer, loaded once while
    # the engine loads: the workers and the gRPC sidecar fork with them (server/http/worker_app.py
    # says why). gunicorn calls no on_exit for an error in when_ready, so a broken install stops
    # everything started above here.
    try:
        # Not `import server.http.worker_app`: that binds the name `server` here to the package,
        # and the sidecar's callbacks below, which close over this `server`, then failed.
        from server.http import worker_app
    except Exception as e:
        on_exit(server)
        raise SystemExit(f"inference-server: cannot import the app: {type(e).__name__}: {e}") from None
    try:
        worker_app.preload(_config)
    except Exception as e:  # noqa: BLE001 - a start-up error is one line
        on_exit(server)
        raise SystemExit(f"inference-server: {one_line(e)}") from None
    # Out of the collector's walks from now on, which would write to each object's header and
    # so give the master its own copy of pages its children share (Python's gc.freeze advice).
    gc.freeze()
    if _config.grpc_port:  # forked now, to share what the workers will (server.grpc.keeper)
        sidecar = Sidecar(dict(os.environ), on_exit=lambda pid: _process_exited(server, pid, "gRPC sidecar"),
                          on_bind_failed=lambda: _grpc_port_lost(server))
        _state["sidecar"] = sidecar
        sidecar.start()
        server.log.info("gRPC sidecar starting on port %d (pid %d)", _config.grpc_port, sidecar.pid)


def _serves(spec) -> str:
    """What the start-up line says a model serves."""
    if spec.kind == "embed":
        return "embeddings (POST /v1/embeddings)"
    origin = spec.chat_template_origin()
    flag = "--chat-template FILE" if spec.where == "--model" else "chat_template in the models file"
    own = "" if spec.json_separators == SEPARATORS else f"; JSON separators {json.dumps(list(spec.json_separators))}"
    return (f"chat: yes (chat template: {origin})" if origin else
            f"chat: no, the model has no chat template (completions only; give one with {flag})") + own


def pre_request(worker, req) -> None:
    """Close the connection after a request whose body may be over the limit.

    The app answers 413 without reading such a body (``server.http.body.read_json``). To keep the
    connection alive gunicorn would then read and discard all of it, and it ignores the app's
    ``Connection: close`` (a hop-by-hop header); marking the request makes the 413 say
    ``Connection: close``, and :func:`post_request` reads what the client still sends before the
    close, so the client reads the answer rather than a reset. A chunked body's size is unknown
    in advance, so it is treated the same.
    """
    headers = dict(req.headers)
    length = headers.get("CONTENT-LENGTH")
    if (length is not None and length.isdigit() and int(length) > _config.max_body_bytes) \
            or "chunked" in headers.get("TRANSFER-ENCODING", "").lower():
        req.must_close = True
        req.discard_body = True


def post_request(worker, req, environ, resp) -> None:
    """After the answer to a request marked by :func:`pre_request`: discard the body the client
    may still be sending, up to ``--max-discard-bytes`` (``server.http.worker.discard_body``)."""
    sock = environ.get("gunicorn.socket") if environ else None
    if getattr(req, "discard_body", False) and sock is not None:
        discard_body(sock, _config.max_discard_bytes)


def when_ready(server) -> None:
    """The port is bound: start the engine (before any worker forks). Then: SIGHUP to the master
    reloads the tenant file in every worker, in place: gunicorn's own
    HUP would replace the workers and cut their streams after ``graceful_timeout``. The master
    reads the file first: a bad one is logged and nothing changes; a good one becomes the
    master's (the tenants a restarted worker boots with) and every worker reloads it."""
    _start_engine(server)
    # Before any worker forks, so every worker shares it (worker_cannot_start).
    _state["boot_failure"] = multiprocessing.Lock()

    def handle_hup():
        try:
            tenants = Tenants.load(_config.tenants_file or None)
            tenants.check_models(_config.model_ids)
        except Exception as e:  # noqa: BLE001 - never let a bad file stop the master
            server.log.error("SIGHUP: tenant file not reloaded, keeping the previous one: %s",
                             e if isinstance(e, ConfigError) else type(e).__name__)
            return
        _state["tenants"] = tenants
        server.log.info("SIGHUP: reloading the tenant file in every worker and the gRPC sidecar")
        for pid in list(server.WORKERS):
            os.kill(pid, signal.SIGHUP)
        if "sidecar" in _state:
            _state["sidecar"].signal(signal.SIGHUP)

    server.handle_hup = handle_hup  # the arbiter dispatches signals to handle_<name>
    server.handle_term = lambda: _drain(server)


#: Seconds the front ends get, after the drain ended what still ran, to write those endings.
END_WRITES_S = 5.0


def _drain(server) -> None:
    """SIGTERM to the master. The first: readiness turns 503 and new requests get 503
    (``ShuttingDown``; gRPC health ``NOT_SERVING``, calls ``UNAVAILABLE``) at once, while
    what runs or waits keeps going for up to ``--drain-timeout`` seconds (:func:`_finish_drain`).
    A second SIGTERM ends the drain now, as its timeout would: what still runs is ended with
    ``server_shutting_down``, written within :data:`END_WRITES_S`. A third, or the drain's own
    at its end, halts: gunicorn's shutdown (SIGINT and SIGQUIT stay gunicorn's quick stop, which
    cuts what still streams)."""
    if _state.get("drained") or _state.get("ending"):
        raise StopIteration  # what the arbiter's own handle_term does: halt
    if _state.get("draining"):
        _state["ending"] = True
        server.log.warning("second SIGTERM: ending the requests still in flight now (a third SIGTERM stops at once)")
        _state["end_now"].set()
        return
    _state["draining"] = True
    _state["end_now"] = threading.Event()
    for supervisor in _state["supervisors"].values():
        supervisor.start_draining()
    if "sidecar" in _state:
        _state["sidecar"].drain()
    server.log.info("SIGTERM: draining; running requests get up to %.0f s (a second SIGTERM ends them now)",
                    _config.drain_timeout)
    threading.Thread(target=_finish_drain, args=(server,), name="drain", daemon=True).start()


def _finish_drain(server) -> None:
    """Wait until no request is in flight, the drain timeout passed, or a second SIGTERM came;
    then stop the engine, which ends what still runs with ``server_shutting_down`` (an SSE
    error event and ``[DONE]``, a 503, gRPC ``UNAVAILABLE``); give the front ends time to write
    that; then SIGTERM the master again, which halts gunicorn (``on_exit`` cleans up)."""
    supervisors = list(_state["supervisors"].values())
    in_flight = lambda: sum(s.in_flight() for s in supervisors)  # noqa: E731
    deadline, end_now = time.monotonic() + _config.drain_timeout, _state["end_now"]
    while in_flight() and time.monotonic() < deadline and not end_now.wait(0.05):
        pass
    if in_flight():
        server.log.warning("%s: ending %d requests still in flight",
                           "second SIGTERM" if end_now.is_set() else "drain timeout", in_flight())
        for supervisor in supervisors:
            supervisor.stop_engine()
        deadline = time.monotonic() + END_WRITES_S
        while in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
    server.log.info("drained; stopping")
    _state["drained"] = True
    os.kill(os.getpid(), signal.SIGTERM)


def accepted_tenants() -> Tenants:
    """The tenants the master accepted last. A worker forked after a bad file was written boots
    with these (inherited with the master's memory), never with the bad file; outside a gunicorn
    master, the file's."""
    return _state.get("tenants") or Tenants.load(_config.tenants_file or None)


#: gunicorn's ``Arbiter.APP_LOAD_ERROR``: a worker that exits with it halts the master.
APP_LOAD_ERROR = 4


def worker_cannot_start(message: str) -> None:
    """In a worker that cannot build its app (``server.wsgi``): exit so that the master stops
    and cleans up (``on_exit``), with ``message`` said once.

    The first such worker prints ``message`` (one line) and exits with ``APP_LOAD_ERROR``, on which
    the master halts. Every other one (the workers meet the same fault together) exits quietly
    with status 0: a second ``APP_LOAD_ERROR``, reaped while the master halts, raised gunicorn's
    ``HaltServer`` again from inside its halt, which then printed a traceback and never ran
    ``on_exit`` (the shared memory stayed behind). Outside a gunicorn master, always the first.
    """
    lock = _state.get("boot_failure")
    if lock is None or lock.acquire(block=False):  # never released: one worker says it
        print(message, file=sys.stderr, flush=True)
        os._exit(APP_LOAD_ERROR)
    os._exit(0)


def post_fork(server, worker) -> None:
    """SIGHUP (from the master, see :func:`when_ready`) reloads this worker's tenants. It is
    handled from the fork on: gunicorn would reset it to the default action (death) while the
    worker boots, and a HUP that arrives before the app is loaded is carried out once it is."""
    worker.SIGNALS = [s for s in worker.SIGNALS if s != signal.SIGHUP]  # init_signals keeps ours
    signal.signal(signal.SIGHUP, _reload_tenants)
    signal.siginterrupt(signal.SIGHUP, False)
    _limit_malloc_arenas()


#: glibc's ``mallopt`` parameter ``M_ARENA_MAX`` (malloc.h).
M_ARENA_MAX = -8


def _limit_malloc_arenas() -> None:
    """Two malloc arenas per worker, as ``MALLOC_ARENA_MAX=2`` would give (unless the operator set
    that). glibc gives threads that allocate at the same time arenas of their own, up to eight
    per CPU, and an arena keeps what was freed in it: with dozens of request threads a worker's
    RSS climbed for many minutes (``bench.soak``, 5 minutes: +12 % with glibc's default, +4 %
    with two arenas). Nothing happens on a C library without ``mallopt``."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 2)
    except (OSError, AttributeError):
        pass


def _reload_tenants(*_) -> None:
    wsgi = sys.modules.get("server.wsgi")
    if wsgi is None or not hasattr(wsgi, "app"):
        _state["hup_pending"] = True  # the app is still loading
    else:
        wsgi.tenants.reload()


def post_worker_init(worker) -> None:
    """Workers ignore SIGINT: Ctrl-C reaches the whole process group, and a gthread worker that
    gets both that SIGINT and the master's SIGQUIT re-enters its quit handler and deadlocks in
    ``ThreadPoolExecutor.shutdown`` until the master SIGKILLs it. The master's signal suffices.

    The loaded app (tokenizer tables, template) is moved out of the garbage collector's reach
    (``gc.freeze``): a request that allocates many objects (a 1 MB body of nested arrays)
    otherwise triggers full collections that walk all of it, tripling the cost of refusing it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()
    if _state.pop("hup_pending", False):
        _reload_tenants()


def _reclaim(server, who: str) -> None:
    for supervisor in list(_state.get("supervisors", {}).values()):
        freed = supervisor.reclaim()
        if freed:  # every dead holder's, found when this one exited
            server.log.warning("reclaimed %d mailboxes of dead processes (%s exited)", len(freed), who)


def _process_exited(server, pid: int, who: str) -> None:
    """A child (worker, sidecar) exited: reclaim its mailboxes, retire its metric files."""
    _reclaim(server, f"{who} {pid}")
    if _config.metrics:
        metrics_dir.retire(pid)


def _grpc_port_lost(server) -> None:
    """The gRPC sidecar could not bind ``--grpc-port`` (another process took it after the check
    at start): stop now (gunicorn's quick stop, SIGINT), and exit with status 1 (:func:`on_exit`)."""
    server.log.error("inference-server: --grpc-port %d was taken by another process before the gRPC sidecar "
                     "bound it (another server's sidecar? give each server its own --grpc-port); stopping",
                     _config.grpc_port)
    _state["exit_status"] = 1
    os.kill(os.getpid(), signal.SIGINT)


def _engine_exited(model: str, pid: int, crashed: bool) -> None:
    if _config.metrics:
        metrics_dir.retire(pid)
        if crashed:
            from server.observability.metrics import ENGINE_RESTARTS  # after on_starting prepared the directory
            ENGINE_RESTARTS.labels(model).inc()
    supervisor = _state.get("supervisors", {}).get(model)  # None once on_exit took them
    if supervisor is not None and supervisor.failed:
        # The engine logged why; the same model will not load on a restart. Stop as on a lost
        # gRPC port: gunicorn's quick stop, exit status 1 (on_exit).
        logging.getLogger("gunicorn.error").error("inference-server: the engine of %s cannot load its model (its "
                                                  "line above says why); stopping", model)
        _state["exit_status"] = 1
        os.kill(os.getpid(), signal.SIGINT)


def child_exit(server, worker) -> None:
    _process_exited(server, worker.pid, "worker")
    if _state.get("draining"):
        # No replacement during the drain (the worker got the SIGTERM itself: a signal to the
        # whole process group): a new worker would refuse every request, and its boot delayed
        # the stop by seconds. gunicorn keeps ``num_workers`` running.
        server.num_workers = len(server.WORKERS)


def on_exit(server) -> None:
    sidecar = _state.pop("sidecar", None)
    if sidecar is not None:
        sidecar.stop()
    for supervisor in _state.pop("supervisors", {}).values():
        supervisor.stop()  # also unlinks the shared memory it created
    responses_dir = _state.pop("responses_dir", None)
    if responses_dir is not None:
        private_dir.remove(responses_dir)
    path, owned = _state.pop("metrics_dir", (None, False))
    if owned:
        private_dir.remove(path)
    status = _state.pop("exit_status", 0)
    if status:  # gunicorn's halt, next, would exit 0 after the quick stop; this stop is a failure
        raise SystemExit(status)
