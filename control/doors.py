"""The serve process's doors: one gRPC port (Generation, Admin, Health, reflection) behind the API key and
TLS, the Prometheus `/metrics` endpoint, and the OpenAI-compatible HTTP door.

Each helper builds or binds one door and refuses a port it cannot take with a `ServeError` that says what to
change; `control.server.Server` opens them in order and closes the ones already open when a later one fails.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control.config import ServeConfig
from control.console import ServeError
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.http_api import HttpDoor, HttpServer
from router.metrics import Metrics
from router.metrics_export import MetricsEndpoint
from router.security import ApiKeyInterceptor, TLSConfig
from router.servicer import GenerationServicer
from router.tenants import KeyTable
from router.wire import add_parsing_safely

SERVICE = "pdserve.v1.Generation"


class GrpcDoor(NamedTuple):
    server: grpc.aio.Server
    health: health.aio.HealthServicer


def grpc_door(keys: KeyTable | None, reuse_port: bool, generation: GenerationServicer,
              admin: admin_pb2_grpc.AdminServicer) -> GrpcDoor:
    """The gRPC server with every service on it, not yet bound."""
    # NOTE: gRPC sets SO_REUSEPORT by default, which would let a second deployment bind a taken port and
    # silently take half its connections: only router replicas share a port
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)] if keys is not None else None,
                             options=[("grpc.so_reuseport", 1 if reuse_port else 0)])
    add_parsing_safely(pb_grpc.add_GenerationServicer_to_server, generation, server)
    # NOTE: the operator API shares the port, so the API key and TLS guard it exactly as they guard
    # generation: there is no unprotected side door
    add_parsing_safely(admin_pb2_grpc.add_AdminServicer_to_server, admin, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["Generation"].full_name,
         admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name, health.SERVICE_NAME,
         reflection.SERVICE_NAME), server)
    return GrpcDoor(server, health_servicer)


def bind_grpc(server: grpc.aio.Server, config: ServeConfig, tls: TLSConfig | None) -> int:
    """Bind `config.host:config.port` (TLS when given); the bound port."""
    c = config
    try:
        if tls is not None:
            return server.add_secure_port(f"{c.host}:{c.port}", tls.server_credentials())
        return server.add_insecure_port(f"{c.host}:{c.port}")
    except RuntimeError as e:
        raise ServeError(f"cannot listen on {c.host}:{c.port} ({e}); is the port taken? "
                         "Pass another --port.") from e


async def set_health(health_servicer: health.aio.HealthServicer, status: int) -> None:
    """The same status for the server as a whole ("") and for the Generation service."""
    for name in ("", SERVICE):
        await health_servicer.set(name, status)


def metrics_endpoint(metrics: Metrics, config: ServeConfig, labels: dict[str, str]) -> MetricsEndpoint:
    """`/metrics` on `config.metrics_port` (0: any free port); `labels` are added to every sample."""
    c = config
    assert c.metrics_port is not None
    host = c.metrics_host or c.host
    try:
        return MetricsEndpoint(metrics.registry, host, c.metrics_port, labels)
    except OSError as e:
        raise ServeError(f"cannot serve metrics on {host}:{c.metrics_port} ({e}); is the "
                         "port taken? Pass another --metrics-port (0: any free port).") from e


def http_server(door: HttpDoor, config: ServeConfig, tls: TLSConfig | None) -> HttpServer:
    """The OpenAI-compatible HTTP server on `config.http_port`, bound, not yet started."""
    c = config
    assert c.http_port is not None
    try:
        return HttpServer(door, c.host, c.http_port, tls, reuse_port=c.routers > 1,
                          header_timeout_s=c.http_header_timeout,
                          max_connections_per_client=c.http_max_connections_per_client)
    except OSError as e:
        raise ServeError(f"cannot serve HTTP on {c.host}:{c.http_port} ({e}); is the port taken, or the "
                         "TLS certificate unreadable? Pass another --http-port (0: off).") from e
