"""`mimo-epd serve`: the product on one node, in three steps: start, front, shutdown.

- **start**: the node's shared-memory embedding cache (created before any encoder, so they all attach to it);
  `--metrics-port` first, so a port in use fails before any process starts; `--encoders` encoder processes;
  the encoder router (mimo_epd/router/encoder.py) and, with `--llm`, the LLM router (mimo_epd/router/llm.py)
  on one gRPC server at `--host:--port` (Encode and Generate); then `--llm-workers` LLM workers, which send
  their media back through that server.
- **front**: the OpenAI-compatible HTTP API on `--http-port` (mimo_epd/router/http_front.py), through the LLM
  router's policy; then `ready HOST:PORT` on stdout.
- **shutdown** (SIGTERM / SIGINT): the gRPC server and the HTTP front stop accepting and drain within
  `--grace-period-s`; then the routers stop watching (a child stopped on purpose is not a failure), every child
  gets SIGTERM and drains too, and the shared-memory segment is removed if this launcher created it.

While it runs, one `Supervisor` restarts an encoder (`--restart-encoders`) or an LLM worker
(`--restart-llm-workers`) that exits unexpectedly, on the same port; meanwhile the encoder router's health
checks route its items to the next live encoder, and the LLM router retries on the next worker.

`serve --join redis://...` (`join_node`) runs only the children, registered in the shared state for the
routers that share it, and on `--host:--port` only the gRPC health service: SERVING while every child runs (what a
container's readiness and liveness probes ask; `mimo-epd health --server HOST:PORT`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from encoder_server.config import EncoderServerConfig
from mimo_epd.common import flags
from mimo_epd.common.auth import use_internal_key
from mimo_epd.common.grpc_server import GrpcServer, shown_host, stop_on_signals
from mimo_epd.common.shutdown import STEP_S, bounded
from mimo_epd.router.encoder import EncoderRouter, NoVisionRouter, RouterConfig
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc, generator_pb2, generator_pb2_grpc

from .children import ChildProcess, Supervisor
from .config import NodeConfig
from .segments import remove_stale_segments, segment_name

log = logging.getLogger("mimo_epd.launcher")

ENCODER_SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name
GENERATOR_SERVICE = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name


def open_node_cache(enc: EncoderServerConfig):
    """Creates (or attaches to) the node's shm embedding cache before the encoders do."""
    from shm_cache import ShmCache

    for name in remove_stale_segments():
        log.info("removed /dev/shm/%s, the cache of a node that died without removing it", name)
    shm_name = enc.shm_cache_name or segment_name(os.getpid())
    shm = ShmCache.open(shm_name, enc.shm_cache_bytes)
    log.info(
        "node cache: /dev/shm/%s, %d MiB (%s)", shm_name, shm.data_size >> 20, "created" if shm.created else "attached"
    )
    return shm


def make_encoders(enc: EncoderServerConfig, node: NodeConfig, shm_name: str) -> list[ChildProcess]:
    """The encoder processes (not started): every encoder flag passed through, the node's cache by name, the
    router state as the encode lease of an --embedding-store fleet cache. With --metrics-port P, encoder i serves
    its own metrics on P+1+i (P is the node's one endpoint)."""
    from mimo_epd.common.flags import to_argv

    args = to_argv(enc, skip={"host", "port", "shm_cache_name", "metrics_port"}) + ["--shm-cache-name", shm_name]
    state = node.routing.router_state
    if enc.embedding_store and not enc.embedding_lease and state.startswith(("redis://", "rediss://")):
        args += ["--embedding-lease", state]  # the fleet's encode lease lives in the router state
    encoders = []
    for i in range(node.encoders):
        port = enc.metrics_port + 1 + i if enc.metrics_port else free_port(node.node_host)
        child = ChildProcess(i, [*args, "--metrics-port", str(port)], node.encoder_start_timeout_s, host=node.node_host)
        child.metrics_port = port
        encoders.append(child)
    return encoders


def free_port(host: str) -> int:
    """A port free on `host` now (an encoder's metrics port without --metrics-port: it keeps it on restarts)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def restart_policy(node: NodeConfig):
    return lambda child: node.restart_llm_workers if child.subcommand == "llm" else node.restart_encoders


class Node:
    """One node's processes and servers; `run()` is `serve` without `--join`."""

    def __init__(self, enc: EncoderServerConfig, node: NodeConfig, shm, encoders: list[ChildProcess]):
        self.enc, self.cfg, self.shm = enc, node, shm
        self.encoders = encoders
        self.llm_workers: list[ChildProcess] = []
        self.supervisor = Supervisor(restart_policy(node))
        from mimo_epd.node_metrics import NodeMetrics

        # every process's metrics merged, on --metrics-port and on the HTTP API's /metrics
        self.metrics = NodeMetrics(self._metric_targets)
        self.router_metrics = ""  # the LLM router's own metrics endpoint (a loopback port)
        self.encoder_router: EncoderRouter | None = None
        self.llm_router = None  # LLMRouter (--llm)
        self.grpc: GrpcServer | None = None
        self.front = None  # HTTPFront (--http-port)
        self.heartbeats: list = []
        # with a shared state the LLM router routes over every node, and registers this node's encoders
        self.shared = node.llm and node.routing.router_state not in ("", "memory")

    async def run(self) -> int:
        stop = asyncio.Event()
        stop_on_signals(stop)
        stopping_since = None
        try:
            await self.start()
            await self.start_front()
            log.info(
                "router serving on %s over %d encoders %s",
                self.grpc.address,
                len(self.encoders),
                [e.endpoint for e in self.encoders],
            )
            self.grpc.announce()
            self.supervisor.watch([*self.encoders, *self.llm_workers])
            await stop.wait()
            stopping_since = time.monotonic()
            await self.drain()
            return 0
        finally:
            await self.shutdown()
            if stopping_since is not None:
                log.info("node stopped (%.1fs)", time.monotonic() - stopping_since)

    # ------------------------------------------------------------------------------------------------ start
    async def start(self) -> None:
        enc, node = self.enc, self.cfg
        if enc.metrics_port:  # first, so that a port in use fails before any encoder starts
            await self.metrics.start(enc.host, enc.metrics_port)
        await asyncio.gather(*(e.start() for e in self.encoders))
        router_config = RouterConfig(
            max_items_per_request=enc.max_items_per_request,
            health_interval_s=node.health_interval_s,
            vnodes=node.vnodes,
            max_message_mb=enc.max_message_mb,
            load_factor=node.encoder_load_factor,
        )
        if node.media_refusal:  # a text-only model: no encoders, Encode refused with the reason
            self.encoder_router = NoVisionRouter(node.media_refusal, router_config)
        else:
            self.encoder_router = EncoderRouter([e.endpoint for e in self.encoders], router_config)
        # keys on the gRPC port too; TLS only on the HTTP front (the workers send media through this port)
        plain = dataclasses.replace(node.auth, tls_cert="", tls_key="")
        self.grpc = GrpcServer(enc.host, enc.port, enc.max_message_mb, auth=plain)
        self.grpc.add(encoder_pb2_grpc.add_EncoderServicer_to_server, self.encoder_router, ENCODER_SERVICE)
        if node.llm:  # the LLM router over this node's workers (and, with a shared state, every node's)
            from mimo_epd.router.llm import LLMRouter

            self.llm_router = LLMRouter(node.routing, encoders=self.encoder_router if self.shared else None)
            self.grpc.add(generator_pb2_grpc.add_GeneratorServicer_to_server, self.llm_router, GENERATOR_SERVICE)
        loop = asyncio.get_running_loop()
        grpc = self.grpc
        self.encoder_router.on_change = lambda alive: loop.create_task(grpc.set_serving(bool(alive)))
        self.encoder_router.start()
        await grpc.start(serving=bool(self.encoder_router.alive) or not self.encoders)
        if self.llm_router is not None:  # a dead registry loop is never silent: the node stops serving
            self.llm_router.on_loop_death = lambda name: loop.create_task(grpc.set_serving(False))
        if self.llm_router is not None:
            await self.start_llm(f"127.0.0.1:{grpc.port}")  # the LLM workers send media through this server

    async def start_llm(self, encoder_address: str) -> None:
        c = self.cfg
        log.info(
            "LLM workers: %d colocated, %d prefill, %d decode%s",
            c.llm_workers,
            c.pd_prefill_workers,
            c.pd_decode_workers,
            " (--llm-workers defaults to 0 beside --pd-decode-workers)"
            if c.pd_decode_workers and not c.llm_workers
            else "",
        )
        self.llm_workers = await start_llm_workers(self.cfg, encoder_address)
        for w in self.llm_workers:
            self.llm_router.add_worker(w.endpoint, w.http_endpoint)
        await self.llm_router.start()
        self.router_metrics = f"127.0.0.1:{await self.llm_router.metrics.start('127.0.0.1', 0)}"
        if self.shared:
            self.heartbeats = register_encoders(self.llm_router.state, self.encoders, self.cfg)

    def _metric_targets(self) -> dict[str, str]:
        """{process label: its /metrics address} for every scrape of the node's metrics."""
        out = {f"encoder-{e.index}": f"{e.host}:{e.metrics_port}" for e in self.encoders}
        out.update({f"llm-{w.index}": w.http_endpoint for w in self.llm_workers if w.http_endpoint})
        if self.router_metrics:
            out["router"] = self.router_metrics
        return out

    # ------------------------------------------------------------------------------------------------ front
    async def start_front(self) -> None:
        """The workers' HTTP API on the node's address: generation through the routing policy (tokenized like
        the workers), the rest to the least loaded worker."""
        if self.llm_router is None or self.cfg.http_port < 0:
            return
        from llm_backend.server.chat_template import load_chat_template
        from mimo_epd.router.http_front import HTTPFront

        template = load_chat_template(self.cfg.llm_model, self.cfg.chat_template)
        self.front = HTTPFront(
            router=self.llm_router, template=template, edge=self.cfg.edge, metrics=self.metrics.body, auth=self.cfg.auth
        )
        http_port = await self.front.start(self.enc.host, self.cfg.http_port)
        print(f"http {shown_host(self.enc.host)}:{http_port}", flush=True)

    # --------------------------------------------------------------------------------------------- shutdown
    async def drain(self) -> None:
        """Stops accepting, lets the requests in flight finish (gRPC within --grace-period-s, HTTP within
        --drain-timeout-s, concurrently), then ends the HTTP streams still open with the error event and [DONE]."""
        log.info(
            "shutting down: routers first (%gs grace, HTTP %gs), then %d encoders and %d LLM workers",
            self.enc.grace_period_s,
            self.cfg.drain_timeout_s,
            len(self.encoders),
            len(self.llm_workers),
        )
        front = self.front.drain(self.cfg.drain_timeout_s) if self.front is not None else asyncio.sleep(0)
        await asyncio.gather(self.grpc.stop(self.enc.grace_period_s), front)

    async def shutdown(self) -> None:
        """Whatever started, stopped, in order: the routers stop watching, the children stop, the cache goes."""
        self.supervisor.stop()
        if self.grpc is not None and not self.grpc.drain.draining:  # a start that failed: stop it now, not in
            await self.grpc.stop(0)  # its __del__ after the event loop has closed (a second traceback)
        if self.encoder_router is not None:
            self.encoder_router.begin_shutdown()  # the encoders stop on purpose now: not "unhealthy"
        if self.front is not None:
            await self.front.close()
        await asyncio.gather(*(h.stop() for h in self.heartbeats), return_exceptions=True)
        if self.llm_router is not None:  # its feeds first: the workers stop on purpose now
            await self.llm_router.close()
            await self.llm_router.metrics.close()
        grace = self.enc.grace_period_s
        await asyncio.gather(*(c.stop(grace) for c in [*self.encoders, *self.llm_workers]), return_exceptions=True)
        await self.metrics.close()
        if self.encoder_router is not None:
            await self.encoder_router.close()
        if self.shm.created:
            self.shm.unlink()
        self.shm.close()


async def serve_node(enc: EncoderServerConfig, node: NodeConfig) -> int:
    use_internal_key(node.auth.internal_api_key)  # what this node sends its workers, and they accept
    shm = open_node_cache(enc)
    encoders = make_encoders(enc, node, shm.name)
    if node.join:
        return await join_node(enc, node, encoders, shm)
    return await Node(enc, node, shm, encoders).run()


# ---------------------------------------------------------------------------------------------- LLM-worker fleet
async def start_llm_workers(node: NodeConfig, encoder_address: str) -> list[ChildProcess]:
    """`--llm-workers` worker processes (each its own engine), with every `--llm-*` flag passed through. On the CPU,
    each gets cores // N torch threads unless `--llm-torch-threads` says otherwise: N engines each using every
    core would fight over them."""
    args = [
        "--model",
        node.llm_model,
        "--encoder",
        encoder_address,
        "--kv-cache-tokens",
        str(node.llm_kv_cache_tokens),
        "--swa-cache-tokens",
        str(node.llm_swa_cache_tokens),
        *node.llm_args,
        *flags.to_argv(node.edge, skip={"allowed_origins"}),  # the front's limits hold on the workers too
    ]
    for name, value in (
        ("--tokenizer", node.tokenizer),
        ("--max-model-len", node.max_model_len),
        ("--served-model-name", node.served_model_name),
    ):
        if value:
            args += [name, str(value)]
    total = node.llm_workers + node.pd_prefill_workers + node.pd_decode_workers
    if "--torch-threads" not in args and total > 1:
        args += ["--torch-threads", str(max(1, (os.cpu_count() or 1) // total))]

    def group(first: int, n: int, extra: list[str]) -> list[ChildProcess]:
        out = [
            ChildProcess(first + i, args + extra, node.encoder_start_timeout_s, subcommand="llm", host=node.node_host)
            for i in range(n)
        ]
        for w in out:
            w.http_port = 0  # its HTTP API (behind the node's front) and its /metrics (in the node's)
        return out

    # Prefill workers first: each decode worker is told their addresses (--pd-prefill), for requests that reach it
    # without a router's choice (its own HTTP API).
    prefill = group(node.llm_workers, node.pd_prefill_workers, ["--role", "prefill"])
    await asyncio.gather(*(w.start() for w in prefill))
    pd = (
        ["--role", "decode", "--pd-prefill", ",".join(w.endpoint for w in prefill)] if prefill else ["--role", "decode"]
    )
    if node.llm_data_parallel > 1:  # the colocated workers are one DP group: each its own rank
        workers = [w for i, own in enumerate(data_parallel_args(node)) for w in group(i, 1, own)]
    else:
        workers = group(0, node.llm_workers, [])
    workers += group(node.llm_workers + len(prefill), node.pd_decode_workers, pd)
    await asyncio.gather(*(w.start() for w in workers))
    return workers + prefill


def data_parallel_args(node: NodeConfig) -> list[list[str]]:
    """Each DP rank's own flags: its rank, and the group's meeting address (`--llm-dist-init-addr`, or a free port on
    this node, chosen once for the node's life: restarted ranks meet at the same one)."""
    addr = []
    if "--dist-init-addr" not in node.llm_args:
        from llm_backend.parallel.replica import free_init_method

        addr = ["--dist-init-addr", free_init_method(node.node_host).removeprefix("tcp://")]
    out = [["--data-parallel-rank", str(r), *addr] for r in range(node.llm_workers)]
    device, tp = _arg(node.llm_args, "--device", "cpu"), int(_arg(node.llm_args, "--tensor-parallel-size", "1"))
    if device == "cuda":  # disjoint GPUs: DP rank r's replica on cuda:r*tp .. r*tp+tp-1
        for r, own in enumerate(out):
            own += ["--device", f"cuda:{r * tp}"]
    return out


def _arg(argv: list[str], name: str, default: str) -> str:
    """The value of `name` in a passed-through argument list (the last one given), or `default`."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else default


def register_encoders(state, encoders: list[ChildProcess], node: NodeConfig) -> list:
    """Heartbeats that keep this node's live encoders in the shared registry (every router's hash ring)."""
    from mimo_epd.router.discovery import Heartbeat, member_id, node_name

    return [
        Heartbeat(
            state,
            member_id("encoder", e.endpoint),
            {"kind": "encoder", "address": e.endpoint, "node": node_name()},
            node.routing.member_ttl_s,
            alive=lambda e=e: e.running,
        ).start()
        for e in encoders
    ]


async def report_children(health: GrpcServer, children: list[ChildProcess], interval_s: float = 1.0) -> None:
    """A joined node's health: SERVING while every child runs, NOT_SERVING while one is down (restarting)."""
    while True:
        await health.set_serving(all(c.running for c in children))
        await asyncio.sleep(interval_s)


async def join_node(enc: EncoderServerConfig, node: NodeConfig, encoders: list[ChildProcess], shm) -> int:
    """`serve --join redis://...`: this node's encoders and LLM workers, registered in the shared state with
    heartbeats (the workers' KV events relayed into it), and no router of its own."""
    from mimo_epd.router.discovery import WorkerFeed, node_name
    from mimo_epd.router.state import open_state

    state = open_state(node.join)
    stop = asyncio.Event()
    stop_on_signals(stop)
    supervisor = Supervisor(restart_policy(node))
    llms: list[ChildProcess] = []
    feeds, heartbeats = [], []
    health: GrpcServer | None = None
    health_task: asyncio.Task | None = None
    try:
        await asyncio.gather(*(e.start() for e in encoders))
        if node.llm:
            llms = await start_llm_workers(node, encoders[0].endpoint if encoders else "")
            info = lambda w: {"node": node_name(), "http_address": w.http_endpoint}  # noqa: E731
            ttl, wait = node.routing.member_ttl_s, node.routing.poll_wait_ms
            feeds = [WorkerFeed(state, w.endpoint, info(w), ttl, wait).start() for w in llms]
        heartbeats = register_encoders(state, encoders, node)
        health = GrpcServer(enc.host, enc.port, enc.max_message_mb)
        await health.start()
        health_task = asyncio.create_task(report_children(health, [*encoders, *llms]))
        log.info(
            "node %s joined %s: %d encoders, %d LLM workers; health on %s",
            node_name(),
            node.join,
            len(encoders),
            len(llms),
            health.address,
        )
        print(f"ready joined {node.join}", flush=True)
        supervisor.watch([*encoders, *llms])
        await stop.wait()
        return 0
    finally:
        await leave_join(health, health_task, supervisor, feeds, heartbeats, state)
        await bounded(
            asyncio.gather(*(e.stop(enc.grace_period_s) for e in [*encoders, *llms]), return_exceptions=True),
            enc.grace_period_s + 10,
            "stopping the children",
        )
        await bounded(state.close(), STEP_S, "closing the shared state")
        if shm.created:
            shm.unlink()
        shm.close()


async def leave_join(health, health_task, supervisor, feeds, heartbeats, state) -> None:
    """A joined node leaves: its health NOT_SERVING and stopped, the relays and heartbeats stopped, its
    registrations deleted now rather than one TTL later (the state may be down: then they expire)."""
    if health_task is not None:
        health_task.cancel()
    if health is not None:
        await bounded(health.stop(0), STEP_S, "stopping the health server")
    supervisor.stop()
    stops = asyncio.gather(*(f.stop() for f in feeds), *(h.stop() for h in heartbeats), return_exceptions=True)
    await bounded(stops, STEP_S, "stopping the KV-event relays and heartbeats")
    for f in feeds:
        await bounded(state.unregister(f.id), STEP_S, f"unregistering {f.address}")
