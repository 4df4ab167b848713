"""A gRPC client's channel to the sidecar of a server the tests started, and its health checks
(grpc.health.v1). A support module, not a test module."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "inference.v1.InferenceService"


def open_channel(port: int, host: str = "127.0.0.1") -> grpc.Channel:
    """An insecure channel to ``host:port``, once connected (at most 60 s)."""
    channel = grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    return channel


def health_status(channel, service: str = SERVICE) -> int:
    """The ``HealthCheckResponse.ServingStatus`` of ``service``."""
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_serving(channel, timeout: float = 120.0) -> None:
    """Until the service's health is SERVING (asserted within ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while health_status(channel) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < end, "gRPC health never became SERVING"
        time.sleep(0.05)
