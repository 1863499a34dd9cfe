"""What every mimo-epd gRPC server shares: message-size limits, standard health checking and reflection."""
from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def new_server(max_message_mb: int) -> grpc.aio.Server:
    limit = max_message_mb << 20
    return grpc.aio.server(options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
                                    ("grpc.so_reuseport", 0)])  # never share a port with another process


def add_health_and_reflection(server: grpc.aio.Server, services: list[str]) -> health_aio.HealthServicer:
    """Registers grpc.health.v1 and server reflection listing `services`; returns the health servicer."""
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    return health


async def set_serving(health: health_aio.HealthServicer, services: list[str], serving: bool = True) -> None:
    """Sets the status of the whole server ("") and of each service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *services):
        await health.set(name, status)


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set `stop` (graceful shutdown); silently skipped off the main thread."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
