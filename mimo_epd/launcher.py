"""`mimo-epd serve`: the product on one node.

Starts N encoder processes (one per device; on the CPU, N processes) that share one node-local
shared-memory embedding cache, the front router (mimo_epd.router) on `--host:--port`, which speaks the
same Encode API, and an LLM worker (`--llm`) whose Generate API the router also serves (the worker sends
media back through the router). Prints `ready HOST:PORT` once everything serves.

Supervision: an encoder that exits unexpectedly is restarted on the same port after a short delay
(`--restart-encoders`); meanwhile the router's health checks route its items to the next live
encoder, and it rejoins the ring when healthy again. SIGTERM/SIGINT: the router stops accepting and
drains within the grace period, then the encoders get SIGTERM (and drain too), then the shared-memory
segment is removed if this launcher created it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass

from encoder_server.config import EncoderServerConfig
from mimo_epd.common import flags
from mimo_epd.common.flags import flag
from mimo_epd.common.grpc_server import add_health_and_reflection, new_server, set_serving, stop_on_signals
from mimo_epd.common.parent import child_env, pid_alive
from mimo_epd.router.encoder import EncoderRouter, RouterConfig
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc, generator_pb2, generator_pb2_grpc

log = logging.getLogger(__name__)

# glibc gives every thread that allocates its own malloc arena (up to 8 per core) and keeps what each frees:
# an encoder's fetch / decode / forward threads then hold ever more freed heap. Two arenas keep it flat: a
# 600 s chaos soak measured the encoders' anonymous memory at +0.2-0.3 MB/min (3.7-4.5 MB/min without), and
# `bench encoder` measured the same QPS within noise (tiny 33.2 vs 34.6, large 3.69 vs 3.41). A value the user
# set wins.
MALLOC_ARENAS = "2"


def worker_env() -> dict:
    """The environment of a process `serve` starts: exits with it, and at most MALLOC_ARENAS malloc arenas."""
    env = child_env()
    env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
    return env


def _llm_default(name: str):
    """The worker's own default for a node flag that sets an LLM-worker setting (declared once, in LLMConfig)."""
    from llm_backend.config import LLMConfig

    return LLMConfig.__dataclass_fields__[name].default


@dataclass
class NodeConfig:
    """The node's own flags (`serve`); the encoders' come from EncoderServerConfig, the LLM workers' from
    LLMConfig (passed through as --llm-*), the routing ones from LLMRouterConfig."""

    encoders: int = flag(1, "encoder processes on this node, sharing one shm cache")
    health_interval_s: float = flag(1.0, "seconds between the router's health checks of each encoder")
    vnodes: int = flag(160, "virtual nodes per encoder on the hash ring")
    restart_encoders: bool = flag(True, "restart an encoder process that exits unexpectedly")
    encoder_start_timeout_s: float = flag(180.0, "seconds to wait for an encoder's (or an LLM worker's) ready line")
    llm: bool = flag(True, "start LLM workers and serve Generate (and the HTTP API) through the router")
    llm_model: str = flag(_llm_default("model"), "the LLM workers' model")
    llm_kv_cache_tokens: int = flag(_llm_default("kv_cache_tokens"), "each LLM worker's full-attention KV pool, tokens")
    llm_swa_cache_tokens: int = flag(
        _llm_default("swa_cache_tokens"), "each LLM worker's sliding-window KV pool, tokens"
    )
    http_port: int = flag(8000, "the router's OpenAI-compatible HTTP API (needs --llm); 0 = any free port, -1 = off")
    llm_workers: int = flag(
        1,
        "LLM worker processes on this node, each its own engine; on the CPU each gets cores // N torch threads "
        "unless --llm-torch-threads is set",
    )
    join: str = flag(
        "",
        "redis://HOST:PORT/DB: register this node's encoders and LLM workers there (with heartbeats) for the "
        "routers that share it; no router of its own (empty = off)",
    )
    node_host: str = flag(
        "127.0.0.1",
        "address the node's encoders and workers listen on and register under; use a routable one when routers "
        "run on other machines",
    )

    @staticmethod
    def add_arguments(parser) -> None:
        flags.add_arguments(parser, NodeConfig)
        from mimo_epd.router.llm import add_policy_arguments

        add_policy_arguments(parser)
        add_llm_passthrough(parser)

    @classmethod
    def from_args(cls, args) -> "NodeConfig":
        cfg = flags.from_args(cls, args)
        if cfg.encoders < 1:
            raise ValueError(f"--encoders must be at least 1, got {cfg.encoders}")
        if cfg.llm_workers < 1:
            raise ValueError(f"--llm-workers must be at least 1, got {cfg.llm_workers}")
        if cfg.join and not cfg.join.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--join needs a redis:// URL, got {cfg.join!r}")
        from mimo_epd.router.llm import config_from_args

        cfg.routing = config_from_args(args)  # policy and state flags (LLMRouterConfig)
        cfg.routing.model = cfg.llm_model  # the router tokenizes like the workers
        cfg.chat_template = getattr(args, "llm_chat_template", "")  # and renders chats with their template
        cfg.routing.validate()
        cfg.llm_args = llm_passthrough_args(args)
        return cfg


# Worker flags `serve` sets itself, or already has under its own name.
_LLM_OWN = {
    "host",
    "port",
    "encoder",
    "http_port",
    "log_level",
    "grace_period_s",
    "model",
    "kv_cache_tokens",
    "swa_cache_tokens",
}


def add_llm_passthrough(parser) -> None:
    """Every other `mimo-epd llm` flag as `--llm-<flag>`, generated from LLMConfig (one flag source)."""
    try:
        from llm_backend.config import LLMConfig
        from mimo_epd.common.flags import add_arguments
    except ImportError:  # pragma: no cover - an older tree without LLMConfig
        return
    add_arguments(parser, LLMConfig, prefix="llm_", skip=_LLM_OWN)


def llm_passthrough_args(args) -> list[str]:
    """The `--<flag>` arguments for each worker from the `--llm-<flag>` values that differ from the defaults."""
    try:
        from llm_backend.config import LLMConfig
        from mimo_epd.common.flags import from_args, to_argv
    except ImportError:  # pragma: no cover
        return []
    return to_argv(from_args(LLMConfig, args, prefix="llm_"), skip=_LLM_OWN)


def encoder_args(cfg: EncoderServerConfig, skip: set[str]) -> list[str]:
    """The command-line flags that reproduce `cfg` (non-default fields only)."""
    from mimo_epd.common.flags import to_argv

    return to_argv(cfg, skip=skip)


class ChildProcess:
    """A `mimo-epd <subcommand>` server process on 127.0.0.1 (an encoder, or the LLM worker)."""

    def __init__(
        self, index: int, args: list[str], timeout_s: float, subcommand: str = "encoder", host: str = "127.0.0.1"
    ):
        self.index, self.args, self.timeout_s, self.subcommand = index, args, timeout_s, subcommand
        self.host = host
        self.port = 0
        self.http_port: int | None = None  # set: pass --http-port (0 first, then the same port on restarts)
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_endpoint(self) -> str:
        return f"{self.host}:{self.http_port}" if self.http_port else ""

    async def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "mimo_epd",
            self.subcommand,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]
        if self.http_port is not None:
            cmd += ["--http-port", str(self.http_port)]
        # worker_env: the child exits (SIGTERM, its drain) when this launcher dies, even by SIGKILL; two arenas
        self.proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, env=worker_env())
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    line = await self.proc.stdout.readline()
                    if not line:
                        raise RuntimeError(
                            f"{self.subcommand} {self.index} exited with {await self.proc.wait()} before it was ready"
                        )
                    text = line.decode().strip()
                    if text.startswith("http ") and self.http_port is not None:
                        self.http_port = int(text.rsplit(":", 1)[1])
                    if text.startswith("ready "):
                        self.port = int(text.rsplit(":", 1)[1])
                        break
        except TimeoutError:
            self.proc.kill()
            raise RuntimeError(f"{self.subcommand} {self.index} was not ready within {self.timeout_s:g}s") from None
        asyncio.get_running_loop().create_task(self._drain())
        log.info("%s %d (pid %d) serving on %s", self.subcommand, self.index, self.proc.pid, self.endpoint)

    async def _drain(self) -> None:
        proc = self.proc
        while proc and await proc.stdout.readline():
            pass

    async def stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s + 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


SEGMENT_PREFIX = "mimo-epd-"


def segment_name(pid: int) -> str:
    """The node cache's name when `--shm-cache-name` is not given: the launcher's pid, so a stale one can be told."""
    return f"{SEGMENT_PREFIX}{pid}"


def remove_stale_segments(
    shm_dir: str = "/dev/shm", min_age_s: float = 60.0, names: list[str] | None = None
) -> list[str]:
    """Removes node caches (`mimo-epd-<pid>`, of `names` or all) whose launcher is dead: one killed by SIGKILL
    never unlinks its own. Its encoders remove it as they exit (see run_encoder); this covers nodes whose every
    process was killed. A segment younger than `min_age_s` is left alone (its launcher may live in another pid
    namespace sharing /dev/shm, just started). Returns the names removed."""
    import time

    removed = []
    try:
        candidates = os.listdir(shm_dir) if names is None else names
    except OSError:
        return removed
    for name in candidates:
        pid = name[len(SEGMENT_PREFIX) :] if name.startswith(SEGMENT_PREFIX) else ""
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if time.time() - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:  # gone already (another encoder was faster), or not ours
            pass
    return removed


async def serve_node(enc: EncoderServerConfig, node: NodeConfig) -> int:
    from shm_cache import ShmCache

    for name in remove_stale_segments():
        log.info("removed /dev/shm/%s, the cache of a node that died without removing it", name)
    shm_name = enc.shm_cache_name or segment_name(os.getpid())
    shm = ShmCache.open(shm_name, enc.shm_cache_bytes)  # create (or attach) before the encoders do
    log.info(
        "node cache: /dev/shm/%s, %d MiB (%s)", shm_name, shm.data_size >> 20, "created" if shm.created else "attached"
    )
    child_cfg_args = encoder_args(enc, skip={"host", "port", "shm_cache_name", "metrics_port"}) + [
        "--shm-cache-name",
        shm_name,
    ]
    # --metrics-port is the node's one endpoint (mimo_epd/node_metrics.py); encoder i serves its own on PORT+1+i.
    metrics_args = lambda i: ["--metrics-port", str(enc.metrics_port + 1 + i)] if enc.metrics_port else []  # noqa: E731
    encoders = [
        ChildProcess(i, child_cfg_args + metrics_args(i), node.encoder_start_timeout_s, host=node.node_host)
        for i in range(node.encoders)
    ]
    if node.join:
        return await join_node(enc, node, encoders, shm)
    metrics = None
    metric_targets: dict[str, int] = {}  # the LLM router's own metrics (a loopback port), merged by NodeMetrics
    llms: list[ChildProcess] = []
    heartbeats = []
    proxy = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    stop_on_signals(stop)
    router = None
    front = None
    try:
        if enc.metrics_port:  # first, so that a port in use fails before any encoder starts
            from mimo_epd.node_metrics import NodeMetrics

            metrics = NodeMetrics(
                lambda: {**{f"encoder-{e.index}": enc.metrics_port + 1 + e.index for e in encoders}, **metric_targets}
            )
            await metrics.start(enc.host, enc.metrics_port)
        await asyncio.gather(*(e.start() for e in encoders))
        router = EncoderRouter(
            [e.endpoint for e in encoders],
            RouterConfig(
                max_items_per_request=enc.max_items_per_request,
                health_interval_s=node.health_interval_s,
                vnodes=node.vnodes,
                max_message_mb=enc.max_message_mb,
            ),
        )
        server, drain = new_server(enc.max_message_mb)
        encoder_pb2_grpc.add_EncoderServicer_to_server(router, server)
        shared = node.llm and node.routing.router_state not in ("", "memory")
        if node.llm:  # the LLM router over this node's workers (and, with a shared state, every node's)
            from mimo_epd.router.llm import LLMRouter

            proxy = LLMRouter(node.routing, encoders=router if shared else None)
        else:
            proxy = None
        if proxy is not None:
            generator_pb2_grpc.add_GeneratorServicer_to_server(proxy, server)
        service = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name
        names = [service]
        if proxy is not None:
            names.append(generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name)
        health = add_health_and_reflection(server, names)
        port = server.add_insecure_port(f"{enc.host}:{enc.port}")
        if port == 0:
            raise OSError(f"cannot listen on {enc.host}:{enc.port}")

        async def on_change(alive: set[str]) -> None:
            await set_serving(health, names, serving=bool(alive))

        router.on_change = lambda alive: loop.create_task(on_change(alive))
        router.start()
        await server.start()
        await on_change(router.alive)
        host = f"[{enc.host}]" if ":" in enc.host else enc.host
        if proxy is not None:  # the LLM workers send media through this router
            llms = await start_llm_workers(node, f"127.0.0.1:{port}")
            for w in llms:
                proxy.add_worker(w.endpoint, w.http_endpoint)
            await proxy.start()
            if metrics is not None:
                metric_targets["router"] = await proxy.metrics.start("127.0.0.1", 0)
            if shared:
                heartbeats = register_encoders(proxy.state, encoders, node)
            if node.http_port >= 0:  # the workers' HTTP API on the node's address
                from llm_backend.server.chat_template import load_chat_template
                from mimo_epd.router.http_front import HTTPFront

                # generation goes through the routing policy (tokenized like the workers), the rest by load
                front = HTTPFront(router=proxy, template=load_chat_template(node.llm_model, node.chat_template))
                http_port = await front.start(enc.host, node.http_port)
                print(f"http {host}:{http_port}", flush=True)
        log.info(
            "router serving on %s:%d over %d encoders %s", host, port, len(encoders), [e.endpoint for e in encoders]
        )
        print(f"ready {host}:{port}", flush=True)

        async def supervise(e: ChildProcess) -> None:
            while not stop.is_set():
                rc = await e.proc.wait()
                if stop.is_set() or not node.restart_encoders:
                    return
                log.warning("encoder %d (%s) exited with %s; restarting it", e.index, e.endpoint, rc)
                await asyncio.sleep(1.0)
                try:
                    await e.start()
                except (RuntimeError, OSError) as err:
                    log.error("restarting encoder %d failed: %s", e.index, err)
                    return

        supervisors = [loop.create_task(supervise(e)) for e in [*encoders, *llms]]
        await stop.wait()
        log.info("shutting down: router first (%gs grace), then %d encoders", enc.grace_period_s, len(encoders))
        await drain.stop(server, health, enc.grace_period_s)
        if front is not None:
            await front.close()
        for t in supervisors:
            t.cancel()
        return 0
    finally:
        if router is not None:
            router.begin_shutdown()  # the encoders stop on purpose now: not "unhealthy"
        await asyncio.gather(*(h.stop() for h in heartbeats), return_exceptions=True)
        if proxy is not None:  # its feeds first: the workers stop on purpose now
            await proxy.close()
            await proxy.metrics.close()
        await asyncio.gather(*(e.stop(enc.grace_period_s) for e in [*encoders, *llms]), return_exceptions=True)
        if metrics is not None:
            await metrics.close()
        if router is not None:
            await router.close()
        if front is not None:
            await front.close()
        if shm.created:
            shm.unlink()
        shm.close()


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
    ]
    if "--torch-threads" not in args and node.llm_workers > 1:
        args += ["--torch-threads", str(max(1, (os.cpu_count() or 1) // node.llm_workers))]
    workers = [
        ChildProcess(i, args, node.encoder_start_timeout_s, subcommand="llm", host=node.node_host)
        for i in range(node.llm_workers)
    ]
    for w in workers:
        w.http_port = 0 if node.http_port >= 0 or node.join else None
    await asyncio.gather(*(w.start() for w in workers))
    return workers


def register_encoders(state, encoders: list[ChildProcess], node: NodeConfig) -> list:
    """Heartbeats that keep this node's live encoders in the shared registry (every router's hash ring)."""
    from mimo_epd.router.discovery import Heartbeat, member_id, node_name

    return [
        Heartbeat(
            state,
            member_id("encoder", e.endpoint),
            {"kind": "encoder", "address": e.endpoint, "node": node_name()},
            node.routing.member_ttl_s,
            alive=lambda e=e: e.proc is not None and e.proc.returncode is None,
        ).start()
        for e in encoders
    ]


async def join_node(enc: EncoderServerConfig, node: NodeConfig, encoders: list[ChildProcess], shm) -> int:
    """`serve --join redis://...`: this node's encoders and LLM workers, registered in the shared state with
    heartbeats (the workers' KV events relayed into it), and no router of its own."""
    from mimo_epd.router.discovery import WorkerFeed, node_name
    from mimo_epd.router.state import open_state

    state = open_state(node.join)
    stop = asyncio.Event()
    stop_on_signals(stop)
    loop = asyncio.get_running_loop()
    llms: list[ChildProcess] = []
    feeds, heartbeats = [], []
    try:
        await asyncio.gather(*(e.start() for e in encoders))
        if node.llm:
            llms = await start_llm_workers(node, encoders[0].endpoint)
            feeds = [
                WorkerFeed(
                    state,
                    w.endpoint,
                    {"node": node_name(), "http_address": w.http_endpoint},
                    node.routing.member_ttl_s,
                    node.routing.poll_wait_ms,
                ).start()
                for w in llms
            ]
        heartbeats = register_encoders(state, encoders, node)
        log.info("node %s joined %s: %d encoders, %d LLM workers", node_name(), node.join, len(encoders), len(llms))
        print(f"ready joined {node.join}", flush=True)

        async def supervise(e: ChildProcess) -> None:
            while not stop.is_set():
                rc = await e.proc.wait()
                if stop.is_set() or not node.restart_encoders:
                    return
                log.warning("%s %d (%s) exited with %s; restarting it", e.subcommand, e.index, e.endpoint, rc)
                await asyncio.sleep(1.0)
                try:
                    await e.start()
                except (RuntimeError, OSError) as err:
                    log.error("restarting %s %d failed: %s", e.subcommand, e.index, err)
                    return

        supervisors = [loop.create_task(supervise(e)) for e in [*encoders, *llms]]
        await stop.wait()
        for t in supervisors:
            t.cancel()
        return 0
    finally:
        await asyncio.gather(*(f.stop() for f in feeds), *(h.stop() for h in heartbeats), return_exceptions=True)
        for f in feeds:  # leave the registry now rather than one TTL later
            try:
                await state.unregister(f.id)
            except Exception:  # noqa: BLE001 - the state may be down; the entries then expire
                pass
        await asyncio.gather(*(e.stop(enc.grace_period_s) for e in [*encoders, *llms]), return_exceptions=True)
        await state.close()
        if shm.created:
            shm.unlink()
        shm.close()
