"""What every mimo-epd gRPC server shares: message-size limits, standard health checking and reflection, a bind
that names the address and the reason when it fails, the `ready HOST:PORT` line, and a graceful shutdown that
never cuts a response short. `GrpcServer` is the one sequence every server runs (encoder, LLM worker, the
node's router, `mimo-epd router`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Health checks and reflection are answered to the end and are not waited for (a health Watch never ends).
_NOT_DRAINED = (f"/{HEALTH_SERVICE}/", f"/{reflection.SERVICE_NAME}/")
# After the last response's status is written, the connections stay open this long before the server stops.
_LINGER_S = 0.2


class Drain(grpc.aio.ServerInterceptor):
    """Counts the RPCs in flight and refuses new ones once shutdown begins.

    Why not just `server.stop(grace)`: it sends GOAWAY and closes each connection as soon as its last stream
    ends. If the client's flow-control frames are still unread in the socket at that moment, the kernel
    answers the close with a reset and drops what it had not yet sent: the tail of the last response.
    The client then sees UNAVAILABLE "Stream removed" for a request the server finished. So `stop` first
    refuses new RPCs (UNAVAILABLE, which clients and the router retry elsewhere) and waits until every RPC in
    flight has had its status written, then waits `_LINGER_S` more, and only then stops the server.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self.not_drained: tuple[str, ...] = _NOT_DRAINED  # method prefixes answered to the end, not waited for
        self._idle = asyncio.Event()
        self._idle.set()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.not_drained):
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                await self._enter(context)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def stream(request, context):
                await self._enter(context)
                async for message in inner_stream(request, context):
                    yield message

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        raise TypeError(f"{details.method}: only unary and async-generator server-streaming RPCs can be drained")

    async def _enter(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another one")
        self.in_flight += 1
        self._idle.clear()
        context.add_done_callback(self._leave)  # runs once the status has been sent (or the call was cancelled)

    def _leave(self, _context) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def stop(self, server: grpc.aio.Server, health: health_aio.HealthServicer, grace_s: float) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new RPCs, let those in flight finish within `grace_s`, stop."""
        deadline = time.monotonic() + grace_s
        await health.enter_graceful_shutdown()
        self.draining = True
        if self.in_flight:
            log.info("draining %d RPCs in flight (%gs grace)", self.in_flight, grace_s)
        try:
            if self.in_flight:  # (a zero grace with nothing in flight is not a timeout)
                await asyncio.wait_for(self._idle.wait(), grace_s)
            await asyncio.sleep(min(_LINGER_S, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            log.warning("grace period over with %d RPCs still in flight; cancelling them", self.in_flight)
        await server.stop(max(0.0, deadline - time.monotonic()))


def new_server(max_message_mb: int, interceptors: list | tuple = ()) -> tuple[grpc.aio.Server, Drain]:
    """A server with our message limits, and the `Drain` that stops it gracefully."""
    limit = max_message_mb << 20
    drain = Drain()
    server = grpc.aio.server(
        interceptors=[drain, *interceptors],
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
    )  # never share a port with another process
    return server, drain


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
    """SIGTERM / SIGINT set `stop` (graceful shutdown); SIGUSR1 writes every asyncio task's stack to stderr (what
    a server that does not stop is waiting for: `kill -USR1 PID`). Silently skipped off the main thread."""
    from mimo_epd.common.shutdown import dump_tasks

    loop = asyncio.get_running_loop()
    for sig, handler in ((signal.SIGTERM, stop.set), (signal.SIGINT, stop.set), (signal.SIGUSR1, dump_tasks)):
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError):
            pass


def shown_host(host: str) -> str:
    """`host` as written before `:PORT`: an IPv6 literal in brackets (`[::1]:50051`)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_bindable(host: str, port: int, flag: str = "--host/--port") -> None:
    """Raises OSError `cannot listen on HOST:PORT (FLAG): REASON` when the address cannot be bound. gRPC itself
    says only "Failed to bind to address" (and logs a C-core line), so the operating system is asked first with
    a plain socket that binds as gRPC does (SO_REUSEADDR); port 0 always binds."""
    import socket

    address = f"{shown_host(host)}:{port}"
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {address} ({flag}): {e.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except OSError as e:
        raise OSError(f"cannot listen on {address} ({flag}): {e.strerror or e}") from None


class GrpcServer:
    """The one way a mimo-epd process serves gRPC (the encoder, the LLM worker, the node's router and
    `mimo-epd router`): our message limits and `Drain`, the services, standard health and reflection, a bind
    whose failure names the address and the reason, the `ready HOST:PORT` line, and the graceful drain.

        srv = GrpcServer(host, port, max_message_mb)
        srv.add(add_EncoderServicer_to_server, servicer, "mimo_epd.v1.Encoder")
        await srv.start()                 # bound, started, health SERVING; srv.port is the bound port
        srv.announce()                    # prints `ready HOST:PORT` (IPv6 hosts in brackets)
        await wait_for_signal()           # SIGTERM / SIGINT
        await srv.stop(grace_s)           # NOT_SERVING, refuse new RPCs, finish those in flight, stop
    """

    def __init__(self, host: str, port: int, max_message_mb: int, auth=None) -> None:
        """`auth`: an AuthConfig (common/auth.py): its keys are required on every RPC but health and
        reflection, and with a TLS pair the port speaks TLS."""
        from .auth import server_credentials, server_interceptors

        self.host, self.requested_port = host, port
        self.server, self.drain = new_server(max_message_mb, server_interceptors(auth))
        self.credentials = server_credentials(auth)
        self.services: list[str] = []
        self.health: health_aio.HealthServicer | None = None
        self.port = 0

    def add(self, add_to_server, servicer, service: str = "", always_answered: tuple[str, ...] = ()) -> None:
        """Registers `servicer` with its generated `add_*Servicer_to_server`; `service` (its full name) is
        listed in health and reflection. `always_answered`: method names of it that are answered while the
        server drains too (a peer's clean-up call, never refused with the drain's UNAVAILABLE)."""
        add_to_server(servicer, self.server)
        if service:
            self.services.append(service)
        self.drain.not_drained += tuple(f"/{service}/{m}" for m in always_answered)

    @property
    def address(self) -> str:
        return f"{shown_host(self.host)}:{self.port}"

    async def start(self, serving: bool = True) -> int:
        """Binds (an OSError naming the address and the reason if it cannot), starts, sets health; returns the
        bound port."""
        self.health = add_health_and_reflection(self.server, self.services)
        if self.requested_port:
            check_bindable(self.host, self.requested_port)
        try:
            target = f"{shown_host(self.host)}:{self.requested_port}"
            if self.credentials is not None:
                self.port = self.server.add_secure_port(target, self.credentials)
            else:
                self.port = self.server.add_insecure_port(target)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {shown_host(self.host)}:{self.requested_port} (--host/--port)")
        await self.server.start()
        await self.set_serving(serving)
        return self.port

    async def set_serving(self, serving: bool = True) -> None:
        assert self.health is not None, "start() first"
        await set_serving(self.health, self.services, serving)

    def announce(self) -> None:
        """The ready line on stdout, what `serve` and the tests wait for."""
        print(f"ready {self.address}", flush=True)

    async def stop(self, grace_s: float) -> None:
        if self.health is None:  # never started
            await self.server.stop(0)
            return
        await self.drain.stop(self.server, self.health, grace_s)


async def wait_for_signal(stop: asyncio.Event | None = None) -> None:
    """Returns on SIGTERM / SIGINT (or once `stop` is set by someone else)."""
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    await stop.wait()
