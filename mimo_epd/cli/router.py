"""`mimo-epd router`: an LLM router in front of LLM workers (the service is mimo_epd/router/llm.py, its settings
mimo_epd/router/config.py; docs/routing.md).

The process: the Generate API over the workers (given with --workers, or discovered in a shared
--router-state), with a shared state also the Encode API over every registered encoder (an EncoderRouter that
starts with none and follows the registry), optionally the HTTP API (--http-port) and Prometheus metrics
(--metrics-port). Prints `http HOST:PORT` (with --http-port) and `ready HOST:PORT`; SIGTERM drains.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimo_epd.common.auth import AuthConfig
from mimo_epd.common.flags import embedded, flag
from mimo_epd.common.http_server import EdgeConfig


@dataclass
class RouterProcessConfig:
    """The flags of the `mimo-epd router` process itself (the routing ones are LLMRouterConfig's)."""

    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(50051, "gRPC port, 0 = any")
    grace_period_s: float = flag(10.0, "drain time on SIGTERM")
    log_level: str = flag("info", "debug, info, warning or error")
    http_port: int = flag(
        -1,
        "serve the workers' HTTP API (OpenAI, /generate) through this router's policy on this port, "
        "0 = any free port (printed as `http HOST:PORT` before `ready`), -1 = off",
    )
    chat_template: str = flag(
        "",
        "the workers' --chat-template file, when they have one: the HTTP front renders chats with it to tokenize "
        "them like the workers (empty = the model's)",
    )
    metrics_port: int = flag(0, "serve the router's Prometheus metrics on this port's /metrics, 0 = off")
    edge: EdgeConfig = embedded(EdgeConfig)  # the HTTP front's limits
    auth: AuthConfig = embedded(AuthConfig)  # API keys (clients, and the internal one sent to the workers), TLS


def _setup(p) -> None:
    from mimo_epd.common.flags import add_arguments
    from mimo_epd.router.config import add_routing_arguments

    add_arguments(p, RouterProcessConfig)
    add_routing_arguments(p, skip=frozenset())


async def serve_router(proc: RouterProcessConfig, config) -> int:
    """Serves until SIGTERM / SIGINT, then drains; returns the exit status."""
    import asyncio

    from mimo_epd.common.auth import use_internal_key
    from mimo_epd.common.grpc_server import GrpcServer, stop_on_signals
    from mimo_epd.common.shutdown import STEP_S, bounded
    from mimo_epd.router.encoder import EncoderRouter, RouterConfig
    from mimo_epd.router.llm import LLMRouter
    from mimo_epd.router.state import MemoryState, open_state
    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc, generator_pb2, generator_pb2_grpc

    use_internal_key(proc.auth.internal_api_key)  # on every call to a worker (gRPC metadata, HTTP header)
    state = open_state(config.router_state)
    # With a shared state, the Encode API over every registered encoder: the ring starts empty, follows the registry.
    encoders = EncoderRouter([], RouterConfig()) if not isinstance(state, MemoryState) else None
    llm_router = LLMRouter(config, state, encoders=encoders)
    srv = GrpcServer(proc.host, proc.port, 256, auth=proc.auth)
    generator = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name
    srv.add(generator_pb2_grpc.add_GeneratorServicer_to_server, llm_router, generator)
    if encoders is not None:
        encoder = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name
        srv.add(encoder_pb2_grpc.add_EncoderServicer_to_server, encoders, encoder)
    front = None
    try:
        if proc.metrics_port:
            await llm_router.metrics.start(proc.host, proc.metrics_port)
        await llm_router.start()
        if encoders is not None:
            encoders.start()
        await srv.start()
        loop = asyncio.get_running_loop()
        llm_router.on_loop_death = lambda name: loop.create_task(srv.set_serving(False))  # a dead loop: NOT_SERVING
        if proc.http_port >= 0:
            from llm_backend.server.chat_template import load_chat_template
            from mimo_epd.common.grpc_server import shown_host
            from mimo_epd.router.http_front import HTTPFront

            template = load_chat_template(config.model, proc.chat_template)
            front = HTTPFront(router=llm_router, template=template, edge=proc.edge, auth=proc.auth)
            print(f"http {shown_host(proc.host)}:{await front.start(proc.host, proc.http_port)}", flush=True)
        import logging

        logging.getLogger("mimo_epd.router").info(
            "LLM router (%s, state %s) on %s", config.policy, config.router_state, srv.address
        )
        stop = asyncio.Event()
        stop_on_signals(stop)  # before the ready line: a SIGTERM right after it is a clean stop
        srv.announce()
        await stop.wait()
        await bounded(srv.stop(proc.grace_period_s), proc.grace_period_s + STEP_S, "stopping the gRPC server")
        return 0
    finally:  # every step bounded and named when it overruns: a router always exits
        if front is not None:
            await bounded(front.close(), proc.grace_period_s + STEP_S, "closing the HTTP front")
        await bounded(llm_router.close(), STEP_S, "closing the LLM router (its loops, feeds, channels, state)")
        await bounded(llm_router.metrics.close(), STEP_S, "closing the metrics server")
        if encoders is not None:
            await bounded(encoders.close(), STEP_S, "closing the encoder router")


def _run(args) -> int:
    import logging

    import uvloop

    from mimo_epd.common.flags import from_args
    from mimo_epd.router.config import routing_config

    from .common import error, setup_logging

    try:
        proc = from_args(RouterProcessConfig, args)
        proc.edge.validate()
        proc.auth = proc.auth.resolved()
        config = routing_config(args)
    except ValueError as e:
        return error(str(e))
    setup_logging(proc.log_level)
    try:
        return uvloop.run(serve_router(proc, config))
    except (OSError, ValueError) as e:
        logging.getLogger("mimo_epd").error("cannot start the router: %s", e)
        return 1


EPILOG = """\
examples:
  mimo-epd router --port 7000 --workers 127.0.0.1:50061,127.0.0.1:50062
  mimo-epd router --port 7000 --router-state redis://127.0.0.1:6379/0     workers and encoders from the registry

Prints `ready HOST:PORT` on stdout once serving; logs go to stderr."""


def register(commands) -> None:
    commands.command(
        "router",
        "an LLM router: KV-affinity routing over LLM workers, state in memory or Redis",
        setup=_setup,
        run=_run,
        epilog=EPILOG,
    )
