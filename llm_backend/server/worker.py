"""`mimo-epd llm`: one LLM worker process. The engine loop runs in its own thread; gRPC Generate and the
HTTP API (both on `GenerationCore`) run on the event loop. Prints `http HOST:PORT` (when the HTTP API is
on) and then `ready HOST:PORT` (gRPC) once both serve; SIGTERM drains both within the grace period."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from mimo_epd.common.auth import use_internal_key
from mimo_epd.common.grpc_server import GrpcServer, shown_host, stop_on_signals
from mimo_epd.common.omni_prompt import OmniTokens
from mimo_epd.v1 import generator_pb2_grpc, kv_events_pb2_grpc

from ..kv.events import DEFAULT_BLOCK, KVEventPublisher, KVEventsService, engine_load, event_block_size
from ..parallel.replica import ReplicaDown
from ..pd.decode import DecodeRole, DecodeSettings
from ..pd.prefill import PrefillRole
from .chat_template import load_chat_template
from .config import ServerConfig
from .core import GenerationCore
from .grpc_service import SERVICE_NAME, GeneratorService
from .kv_transfer import DecodeTicketing, PrefillClient, attach_decode, attach_prefill
from .media_memo import MediaMemo
from .media_transfer import EmbeddingReceiver
from .metrics import LLMMetrics
from .responses_protocol import ResponseStore

log = logging.getLogger(__name__)


async def serve_llm(
    engine,
    host: str,
    port: int,
    encoder_address: str | None,
    grace_s: float = 10.0,
    config: ServerConfig | None = None,
    model: str = "tiny",
    role=None,
) -> int:
    """Serves `engine` until SIGTERM. `role`: the engine's scheduler role (llm_backend.pd: PrefillRole, DecodeRole
    with its PrefillClient port), None for a `both` worker; its gRPC parts are attached here."""
    config = config or ServerConfig.from_engine(engine)
    use_internal_key(config.auth.internal_api_key)  # sent to the encoder (a node's gRPC port may want it)
    name = config.served_model_name or (
        model if model in ("tiny", "tiny-random") else os.path.basename(os.path.normpath(model))
    )
    template = load_chat_template(model, config.chat_template)
    stop_engine = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop_engine,), name="llm-engine", daemon=True)
    metrics = LLMMetrics()
    srv = GrpcServer(host, port, 256, auth=config.auth)
    events = attach_kv_events(engine, srv.server, model=name)  # KVEvents/Poll: the routers' index feed
    receiver = _media_receiver(engine.config, host) if encoder_address else None
    core = GenerationCore(
        engine,
        encoder_address,
        metrics,
        default_max_tokens=config.default_max_tokens,
        model_name=name,
        ticketing=DecodeTicketing(engine.config.pd_prefill) if isinstance(role, DecodeRole) else None,
        engine_alive=thread.is_alive,
        kv_events_position=events.answered,  # each final moves the log a step: its reply carries the load after it
        omni=OmniTokens.from_model(model),
        receiver=receiver,
        # a colocated worker only: a P/D role's prompt KV comes from elsewhere
        memo=MediaMemo(engine.config.media_memo_items) if role is None and engine.config.media_memo_items else None,
    )
    metrics.watch(core.stats)
    thread.start()
    srv.add(
        generator_pb2_grpc.add_GeneratorServicer_to_server,
        GeneratorService(core, config.max_samples_per_request),
        SERVICE_NAME,
    )
    xfer = _attach_role(engine, core, srv, host, role)
    await srv.start()
    runner = await _start_http_api(core, template, metrics, config, model, name, host)
    stop = asyncio.Event()
    stop_on_signals(stop)  # before the ready line: a SIGTERM right after it is a clean stop
    srv.announce()
    watch = asyncio.create_task(_stop_when_replica_down(engine, thread, stop))
    await stop.wait()
    watch.cancel()
    t0 = time.monotonic()
    if runner is not None:
        from .http import stop_http

        await asyncio.gather(srv.stop(grace_s), stop_http(runner))
    else:
        await srv.stop(grace_s)
    t1 = time.monotonic()
    stop_engine.set()
    thread.join(5)
    engine.close()  # the other ranks of a model-parallel replica
    if xfer is not None:
        xfer.close()
    if receiver is not None:
        await receiver.close()
    log.info("stopped (servers %.1fs, engine %.1fs)", t1 - t0, time.monotonic() - t1)
    return 1 if isinstance(engine.loop_error, ReplicaDown) else 0


def _media_receiver(cfg, host: str) -> EmbeddingReceiver | None:
    """The transfer engine's receive buffer for media rows (--encoder-transfer), or None (rows in the reply)."""
    if not getattr(cfg, "encoder_transfer", ""):
        return None
    return EmbeddingReceiver(cfg.encoder_transfer_buffer_bytes, host, cfg.encoder_transfer, cfg.encoder_transfer_device)


async def _start_http_api(core, template, metrics, config: ServerConfig, model: str, name: str, host: str):
    """The OpenAI-compatible HTTP API on `core` (prints `http HOST:PORT`); None when --http-port is -1."""
    if config.http_port < 0:
        return None
    from .http import LLMHTTPServer, start_http

    runner, http_port = await start_http(
        LLMHTTPServer(
            core,
            template,
            metrics,
            config.media_timeout_s,
            model,
            config.edge,
            config.auth,
            max_prompts=config.max_prompts_per_request,
            max_samples=config.max_samples_per_request,
            responses=ResponseStore(config.responses_store_size, config.responses_store_ttl_s),
        ),
        host,
        config.http_port,
    )
    shown = shown_host(host)
    log.info("HTTP API on http://%s:%d (model %r, chat template: %s)", shown, http_port, name, template.origin)
    print(f"http {shown}:{http_port}", flush=True)
    return runner


async def _stop_when_replica_down(engine, thread: threading.Thread, stop: asyncio.Event) -> None:
    """A model-parallel replica with a rank gone cannot serve again: the worker exits (status 1) once its
    requests have their errors, so the supervisor restarts the whole group (docs/parallel.md)."""
    while thread.is_alive() or not isinstance(engine.loop_error, ReplicaDown):
        await asyncio.sleep(0.5)
    log.error("exiting: %s", engine.loop_error)
    stop.set()


def _attach_role(engine, core, srv: GrpcServer, host: str, role):
    """The prefill and decode roles' parts: the transfer engine, and the KVTransfer service (prefill) or the
    decode port's streams (decode); None for a `both` worker."""
    cfg = engine.config
    if isinstance(role, PrefillRole):
        return attach_prefill(engine, core, srv, host, role.counters, cfg.pd_protocol, cfg.pd_device)
    if isinstance(role, DecodeRole) and isinstance(role.port, PrefillClient):
        return attach_decode(engine, role.port, host, cfg)
    return None


def build_role(cfg) -> PrefillRole | DecodeRole | None:
    """The engine's scheduler role for `--role` (composed here, where the worker is built: the engine never
    imports a role)."""
    if cfg.role == "prefill":
        return PrefillRole()
    if cfg.role == "decode":
        settings = DecodeSettings.from_config(cfg)
        return DecodeRole(settings, PrefillClient(settings.fence_timeout_s))
    return None


def attach_kv_events(engine, server, block: int = DEFAULT_BLOCK, model: str = "") -> KVEventPublisher:
    """Publishes `engine`'s cache changes and load through `server` (a grpc.aio server not started yet): the
    KVEvents service (kv/events.py's publisher and messages) on the worker's gRPC port."""
    pub = KVEventPublisher(engine.cache, event_block_size(engine.cache.page_size, block))
    pub.load_fn = lambda: engine_load(engine)
    kv_events_pb2_grpc.add_KVEventsServicer_to_server(
        type("KVEventsServicer", (KVEventsService, kv_events_pb2_grpc.KVEventsServicer), {})(
            pub,
            model=model or str(getattr(engine, "model_name", "")),
            role=str(getattr(getattr(engine, "config", None), "role", "both")),
        ),
        server,
    )
    return pub
