"""The gRPC sidecar process: ``python -m server.grpc.server``, spawned by the gunicorn master
(``server.grpc.keeper``) with the same environment a worker gets (the configuration variables and
``INFERENCE_SHM``).

It serves :class:`server.grpc.service.InferenceService` on ``--grpc-port`` with
``--grpc-threads`` handler threads, standard health checking (``grpc.health.v1``: ``NOT_SERVING``
until the engine is ready, and again while it restarts or after SIGTERM) and server reflection.
SIGTERM drains (health goes ``NOT_SERVING``, calls get ``GRACE_S`` seconds); SIGHUP reloads the
tenant file; Ctrl-C's SIGINT is left to the master. The process dies with its parent.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.client import EngineClient
from proto import inference_pb2_grpc
from engine.config import one_line
from server.config import ServerConfig
from server.model_router import ModelRouter
from server.grpc.keeper import BIND_FAILED, PR_SET_PDEATHSIG, report_bind_failed
from server.grpc.service import SERVICE_NAME, InferenceService
from server.control.state import ControlPlane
from server.tenancy.tenants import TenantRegistry, Tenants

log = logging.getLogger("grpc")
GRACE_S = 5.0
#: Seconds between looks at the engine's state for the health service.
HEALTH_POLL_S = 0.2


class PortInUse(RuntimeError):
    """gRPC could not bind ``--grpc-port``."""


def options(config: ServerConfig) -> list[tuple[str, int]]:
    """gRPC core's channel arguments for the sidecar's server.

    ``grpc.so_reuseport`` is off: gRPC sets ``SO_REUSEPORT`` by default on Linux, so a second
    server on the same ``--grpc-port`` bound it too and the kernel spread the calls over both,
    silently (a newcomer's two servers answered each other's calls)."""
    return [("grpc.max_receive_message_length", config.max_body_bytes), ("grpc.so_reuseport", 0)]


def build(config: ServerConfig, models: ModelRouter,
          tenants: TenantRegistry) -> tuple[grpc.Server, health.HealthServicer]:
    """The server with its three services over ``models`` (``ModelRouter.attach``), health
    ``NOT_SERVING`` (set before it starts, so no probe passes during model load), not started.

    Raises:
        PortInUse: ``--grpc-port`` is in use (gRPC's own error)."""
    # No cap on concurrent calls: gRPC would refuse the excess with RESOURCE_EXHAUSTED (which
    # means "over quota" here) and count health probes against it. Calls beyond the threads
    # wait for one; the default has a thread for every mailbox and spare ones, so a saturated
    # server still answers UNAVAILABLE at once and probes at once.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_handler_threads), options=options(config))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceService(config, models, tenants), server)
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    try:
        server.add_insecure_port(config.address(config.grpc_port))
    except RuntimeError as e:
        raise PortInUse(str(e)) from None
    return server, health_servicer


def follow_engine(engines: list[EngineClient], health_servicer: health.HealthServicer,
                  stop: threading.Event) -> None:
    """Keep health in step with the engines (every one ready, none restarting, the server not
    draining: as ``/health/ready``) until ``stop``; then ``NOT_SERVING`` for good."""
    serving = None
    while not stop.is_set():
        ready = all(engine.accepting() for engine in engines)
        if ready != serving:
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                health_servicer.set(name, status)
            serving = ready
        stop.wait(HEALTH_POLL_S)
    health_servicer.enter_graceful_shutdown()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = ServerConfig.from_env()
    file = Tenants.load(config.tenants_file or None)
    tenants = TenantRegistry(file, ControlPlane.of(config, file).start())
    try:
        models = ModelRouter.attach(config, os.environ["INFERENCE_SHM"].split(","), tenants.control)
        server, health_servicer = build(config, models, tenants)
    except PortInUse as e:  # the port was taken after the master's check (keeper.check_port)
        log.error("cannot serve gRPC on %s: %s", config.address(config.grpc_port), e)
        report_bind_failed()
        models.close()
        return BIND_FAILED
    except Exception as e:  # noqa: BLE001 - a start-up error is one line; the workers meet the same and stop the server
        log.error("inference-server: the gRPC sidecar cannot start: %s", one_line(e))
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: tenants.reload())
    # a reload asked while it started (the keeper blocks SIGHUP from the fork on) is done now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    server.start()
    log.info("gRPC sidecar serving on %s (pid %d)", config.address(config.grpc_port), os.getpid())
    follow_engine(list(models.engines().values()), health_servicer, stop)
    server.stop(GRACE_S).wait()
    models.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
