"""`mimo-epd chaos`: a fault campaign against a fleet (or a single node) at saturation.

Topologies (`--topology`):
  fleet  (default when redis-server is installed) a redis-server, one node `serve --join redis://...` with
         `--encoders 2 --llm-workers 2`, and `--routers 2` `mimo-epd router --router-state redis://...`
         processes in front of it; the Locust users fail over between the routers (client side)
  node   one `serve --encoders 2` (the router is the node process)

Load: headless Locust (loadtest/chaos_users.py), closed loop, Encode of unique JPEGs and short Generate
streams through the router(s); every request is logged with its start/end on CLOCK_MONOTONIC, so each
failure can be compared with what was in flight at the kill.

Faults, SIGKILL on a schedule (`--fault-interval-s`, cycling through `--faults` until `--duration-s`):
  encoder        one encoder process (alternating); the node restarts it on the same port
  decode_worker  one decode process, a child of an encoder (found through /proc/<pid>/task/*/children)
  llm            an LLM worker (alternating); the node restarts it, the routers retry on the other worker
  router         fleet: one `mimo-epd router` (alternating), started again on its port by the campaign;
                 node: the `serve` process itself (its children exit with it), started again on its port
  redis          fleet: redis-server, started again (empty) after `--redis-down-s`; routing degrades to
                 load only meanwhile
Per fault: requests that failed after the kill, split into those that were in flight at the kill and those
that started later, compared with the requests in flight on the killed process; time to the first success
on the affected path; time until the replacement serves (health SERVING / a new process in place).
Then a soak (`--soak-s`): RSS of every process sampled every `--rss-interval-s` (split into anonymous and
shared-memory pages), reported before/after with the slope in MB/min after the first minute.

One JSON object on stdout, progress lines on stderr. Numbers are measurements, not grades.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.locust_cmd import locust_command
from mimo_epd.testing.redis_server import RedisServer, free_port

USERS_FILE = Path(__file__).with_name("chaos_users.py")
FAULTS = (
    "encoder",
    "decode_worker",
    "llm",
    "prefill_llm",
    "decode_llm",
    "tp_rank",
    "router",
    "redis",
    "mooncake_master",
)


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ /proc
def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return sorted(set(out))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def runs_mooncake(pid: int) -> bool:
    """Whether the process has Mooncake's library mapped (an encoder's embedding-store helper, not a decoder)."""
    try:
        return "mooncake" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """Resident MB of `pid`: VmRSS, or one of its parts RssAnon (heap), RssShmem (shared memory it touched: the
    node's embedding cache and decode arena count here in full for every process that mapped them), RssFile."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def listening_ports(pid: int) -> set[int]:
    """TCP ports `pid` listens on: its socket inodes (/proc/<pid>/fd) matched with /proc/net/tcp{,6}."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def pid_listening_on(port: int) -> int | None:
    for d in os.listdir("/proc"):
        if d.isdigit() and port in listening_ports(int(d)):
            return int(d)
    return None


@dataclass
class Node:
    """The processes under test, by role: the serve process (`router` on a single node, `node` in a fleet,
    where it routes nothing), encoders by port, their decode processes, the LLM workers, and in a fleet the
    `mimo-epd router` processes and redis-server."""

    router: int
    encoders: dict[str, int] = field(default_factory=dict)  # "127.0.0.1:PORT" -> pid
    decoders: dict[str, list[int]] = field(default_factory=dict)  # encoder endpoint -> decode pids
    llms: dict[str, int] = field(default_factory=dict)  # LLM worker endpoint -> pid (--llm-workers N)
    llm_roles: dict[str, str] = field(default_factory=dict)  # LLM worker endpoint -> both | prefill | decode
    ranks: dict[str, list[int]] = field(default_factory=dict)  # LLM worker endpoint -> its other TP ranks' pids
    redis: int | None = None
    routers: dict[str, int] = field(default_factory=dict)  # fleet: router address -> pid
    serve_role: str = "router"

    def roles(self) -> dict[str, int]:
        out = {self.serve_role: self.router}
        for i, ep in enumerate(sorted(self.routers)):
            out[f"router{i}"] = self.routers[ep]
        for i, ep in enumerate(sorted(self.encoders)):
            out[f"encoder{i}"] = self.encoders[ep]
            for j, d in enumerate(self.decoders.get(ep, [])):
                out[f"encoder{i}.decode{j}"] = d
        for i, ep in enumerate(sorted(self.llms)):
            out[f"llm{i}"] = self.llms[ep]
            for j, r in enumerate(self.ranks.get(ep, [])):
                out[f"llm{i}.rank{j + 1}"] = r
        if self.redis:
            out["redis"] = self.redis
        return out


_GRPC_PORT: dict[int, int] = {}


def grpc_port(pid: int, ports: list[int]) -> int | None:
    """The gRPC port among those `pid` listens on (a worker may also listen for metrics or KV events): the
    `--port N` of its command line when it is one of them, else the one that answers a health check."""
    if pid in _GRPC_PORT and _GRPC_PORT[pid] in ports:
        return _GRPC_PORT[pid]
    if len(ports) <= 1:
        return ports[0] if ports else None
    args = cmdline(pid).split()
    named = [int(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--port" and args[i + 1].isdigit()]
    found = next((p for p in named if p in ports), None)
    if found is None:
        found = next((p for p in ports if health_answers(f"127.0.0.1:{p}")), None)
    if found is not None:
        _GRPC_PORT[pid] = found
    return found


def health_answers(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return True
    except grpc.RpcError as e:
        return e.code() not in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNIMPLEMENTED,
        )


def discover(router_pid: int) -> Node:
    node = Node(router_pid)
    for c in children(router_pid):
        cl = cmdline(c)
        ports = sorted(listening_ports(c))
        port = grpc_port(c, ports) if ports else None
        if " mimo_epd encoder" in cl or cl.endswith("mimo_epd encoder"):
            if port:
                ep = f"127.0.0.1:{port}"
                node.encoders[ep] = c
                node.decoders[ep] = [
                    g for g in children(c) if alive(g) and "spawn_main" in cmdline(g) and not runs_mooncake(g)
                ]
        elif " mimo_epd llm" in cl and port:
            node.llms[f"127.0.0.1:{port}"] = c
            args = cl.split()
            role = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--role"), "both")
            node.llm_roles[f"127.0.0.1:{port}"] = role
            node.ranks[f"127.0.0.1:{port}"] = [g for g in children(c) if alive(g) and "spawn_main" in cmdline(g)]
        elif "redis-server" in cl:
            node.redis = c
    return node


def health_serving(address: str, timeout: float = 1.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


# ------------------------------------------------------------------------------------------ request log
class RequestLog:
    """The JSON lines Locust's users append; read incrementally (only complete lines)."""

    def __init__(self, path: Path):
        self.path, self._pos, self.records = path, 0, []

    def refresh(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return self.records
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].splitlines():
            try:
                self.records.append(json.loads(line))
            except ValueError:
                pass
        self._pos += end
        return self.records


# ------------------------------------------------------------------------------------------ RSS sampler
class RssSampler(threading.Thread):
    def __init__(self, get_node, interval_s: float):
        super().__init__(daemon=True)
        self.get_node, self.interval_s = get_node, interval_s
        self.samples: dict[str, list[tuple[float, int, float]]] = {}  # role -> [(t, pid, MB)]
        self.parts: dict[str, list[tuple[float, int, float, float]]] = {}  # role -> [(t, pid, anon MB, shmem MB)]
        self._stop = threading.Event()

    def sample(self) -> None:
        node = self.get_node()
        if node is None:
            return
        now = time.monotonic()
        for role, pid in node.roles().items():
            mb = rss_mb(pid)
            if mb is not None:
                self.samples.setdefault(role, []).append((now, pid, mb))
                anon, shmem = rss_mb(pid, "RssAnon"), rss_mb(pid, "RssShmem")
                if anon is not None and shmem is not None:
                    self.parts.setdefault(role, []).append((now, pid, anon, shmem))

    def run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a process vanishing mid-scan; keep sampling
                log(f"rss sample failed: {e}")

    def stop(self) -> None:
        self._stop.set()


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    import numpy as np

    t = np.array([p[0] for p in points]) / 60.0
    y = np.array([p[1] for p in points])
    if np.ptp(t) == 0:
        return None
    return round(float(np.polyfit(t, y, 1)[0]), 3)


def phase_stats(records: list[dict], t_a: float, t_b: float) -> dict:
    """Requests finished in [t_a, t_b): counts, failures, QPS and latency percentiles per request kind."""
    rs = [r for r in records if t_a <= r["t1"] < t_b]
    by = {}
    for kind in sorted({r["kind"] for r in rs}):
        k = [r for r in rs if r["kind"] == kind]
        lat = sorted(r["t1"] - r["t0"] for r in k if r["code"] == "OK")
        by[kind] = {
            "requests": len(k),
            "failures": sum(r["code"] != "OK" for r in k),
            "qps": round(len(k) / max(1e-9, t_b - t_a), 3),
            "p50_ms": round(lat[len(lat) // 2] * 1e3, 1) if lat else None,
            "p90_ms": round(lat[int(len(lat) * 0.9)] * 1e3, 1) if lat else None,
        }
    return {
        "seconds": round(t_b - t_a, 3),
        "requests": len(rs),
        "failures": sum(r["code"] != "OK" for r in rs),
        "by_kind": by,
    }


def soak_report(samples: dict, t_start: float, t_end: float, warmup_s: float, parts: dict | None = None) -> dict:
    out = {}
    for role, pts in sorted(samples.items()):
        window = [(t, pid, mb) for t, pid, mb in pts if t_start <= t <= t_end]
        if not window:
            continue
        pid = window[-1][1]
        same = [(t, mb) for t, p, mb in window if p == pid]  # the process alive at the end (restarts excluded)
        after = [(t, mb) for t, mb in same if t >= t_start + warmup_s]
        out[role] = {
            "pid": pid,
            "rss_before_mb": round(same[0][1], 1),
            "rss_after_mb": round(same[-1][1], 1),
            "rss_max_mb": round(max(mb for _, mb in same), 1),
            "samples": len(same),
            "slope_mb_per_min_after_warmup": slope_mb_per_min(after),
        }
        sp = [(t, a, sh) for t, p, a, sh in (parts or {}).get(role, []) if p == pid and t_start <= t <= t_end]
        if sp:
            late = [x for x in sp if x[0] >= t_start + warmup_s]
            out[role].update(
                {
                    "anon_before_mb": round(sp[0][1], 1),
                    "anon_after_mb": round(sp[-1][1], 1),
                    "anon_slope_mb_per_min_after_warmup": slope_mb_per_min([(t, a) for t, a, _ in late]),
                    "shmem_before_mb": round(sp[0][2], 1),
                    "shmem_after_mb": round(sp[-1][2], 1),
                }
            )
    return out


# ------------------------------------------------------------------------------------------ the campaign
class Redis(RedisServer):
    """The fleet's redis-server: no persistence, so a restart comes back empty (the worst case for the routers:
    every registration and index entry has to be written again). Stopped gracefully."""

    def stop(self, graceful: bool = True) -> None:
        super().stop(graceful)


class Campaign:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.server = None  # ServerProcess of the serve this campaign started (the node)
        self.address = args.server  # the first router's address
        self.fleet = args.topology == "fleet"
        self.routers: list = []  # fleet: ServerProcess of each `mimo-epd router`
        self.router_ports: list[int] = []
        self.redis: Redis | None = None
        self.master = None  # --mooncake: the MooncakeMaster of the KV tier and the fleet embedding cache
        self.node: Node | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="mimo-chaos-"))
        self.reqlog = RequestLog(self.workdir / "requests.jsonl")
        self.locust: subprocess.Popen | None = None
        self.faults: list[dict] = []
        self.skipped: list[dict] = []
        self.cycle: dict[str, int] = {}
        self.leftovers: list[str] = []
        self.old_logs: list[str] = []  # logs of routers / nodes that were killed and replaced

    def rel(self, t: float) -> float:
        return round(t - self.t0, 3)

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.routers] if self.fleet else [self.address]

    # -------------------------------------------------------------- node
    def llm_workers(self) -> int:
        return self.args.llm_workers if self.args.llm_workers else (2 if self.fleet else 1)

    def serve_args(self) -> list[str]:
        # --http-port -1: the OpenAI HTTP API would take the fixed port 8000, which a second node (or a
        # test running alongside) may hold.
        common = [
            "--encoders",
            str(self.args.encoders),
            "--health-interval-s",
            "0.5",
            "--decode-workers",
            "2",
            "--llm-workers",
            str(self.llm_workers()),
            "--shm-cache-bytes",
            str(256 << 20),
        ]
        if self.master is not None:  # the KV tier and the fleet's embedding cache on one Mooncake Store
            seg = str(64 << 20)
            common += ["--llm-kv-store", self.master.url, "--llm-kv-store-segment-bytes", seg]
            common += ["--embedding-store", self.master.url, "--embedding-store-segment-bytes", seg]
        if self.fleet:  # a node that registers in Redis and runs no router; its gRPC port is unused
            return [*common, "--join", self.redis.url, *shlex.split(self.args.serve_args)]
        return [*common, "--http-port", "-1", "--port", str(self.port), *shlex.split(self.args.serve_args)]

    def router_args(self, port: int) -> list[str]:
        return ["--port", str(port), "--router-state", self.redis.url, *shlex.split(self.args.router_args)]

    def start_node(self) -> None:
        from mimo_epd.testing.servers import start_server

        if self.fleet:
            self.redis = Redis(self.workdir)
            self.redis.start()
            log(f"redis-server on 127.0.0.1:{self.redis.port}")
        if self.args.mooncake:
            from mimo_epd.testing.mooncake_master import MooncakeMaster

            self.master = MooncakeMaster(self.workdir)
            self.master.start()
            log(f"mooncake_master on 127.0.0.1:{self.master.port}")
        self.server = start_server(self.serve_args(), subcommand="serve", timeout=self.args.start_timeout_s)
        if self.fleet:
            self.router_ports = [free_port() for _ in range(self.args.routers)]
            for port in self.router_ports:
                self.routers.append(
                    start_server(self.router_args(port), subcommand="router", timeout=self.args.start_timeout_s)
                )
            self.address = self.routers[0].address
        else:
            self.address = self.server.address
        self.refresh_node()

    def refresh_node(self) -> Node | None:
        pid = self.server.proc.pid if self.server else pid_listening_on(int(self.address.rsplit(":", 1)[1]))
        if pid is None or not alive(pid):
            return self.node
        node = discover(pid)
        if self.fleet:
            node.serve_role = "node"
            node.routers = {r.address: r.proc.pid for r in self.routers if r.proc.poll() is None}
            if self.redis and self.redis.proc and self.redis.proc.poll() is None:
                node.redis = self.redis.proc.pid
        self.node = node
        return self.node

    # -------------------------------------------------------------- load
    def start_load(self, images_dir: Path, with_llm: bool) -> None:
        classes = ["EncodeUser"] + (["GenerateUser"] if with_llm else []) + (["AudioUser"] if self.args.audio else [])
        classes += ["VideoUser"] if self.args.video else []
        env = {
            **os.environ,
            "MIMO_EPD_CHAOS_LOG": str(self.reqlog.path),
            "MIMO_EPD_IMAGES_DIR": str(images_dir),
            "MIMO_EPD_CALL_TIMEOUT": str(self.args.call_timeout_s),
            "MIMO_EPD_CHAOS_ROUTERS": ",".join(self.addresses),
        }
        cmd = locust_command(
            USERS_FILE,
            users=self.args.users,
            spawn_rate=self.args.users,
            host=self.address,
            csv_prefix=self.workdir / "locust",
            stop_timeout_s=int(self.args.call_timeout_s) + 5,
            extra=("--loglevel", "WARNING", *classes),
        )
        self.locust = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(self.workdir / "locust.log", "w")
        )

    def stop_load(self) -> None:
        if self.locust and self.locust.poll() is None:
            self.locust.send_signal(signal.SIGTERM)
            try:
                self.locust.wait(self.args.call_timeout_s + 15)
            except subprocess.TimeoutExpired:
                self.locust.kill()
                self.locust.wait()

    # -------------------------------------------------------------- faults
    def pick(self, fault: str) -> tuple[int, dict] | None:
        node = self.refresh_node()
        n = self.cycle.get(fault, 0)
        self.cycle[fault] = n + 1
        if fault == "encoder" and node.encoders:
            ep = sorted(node.encoders)[n % len(node.encoders)]
            return node.encoders[ep], {"endpoint": ep}
        if fault == "decode_worker":
            eps = [ep for ep in sorted(node.encoders) if node.decoders.get(ep)]
            if eps:
                ep = eps[n % len(eps)]
                return node.decoders[ep][0], {"endpoint": ep, "decode_pids_before": node.decoders[ep]}
        if fault == "llm" and node.llms:
            ep = sorted(node.llms)[n % len(node.llms)]
            return node.llms[ep], {"endpoint": ep}
        if fault in ("prefill_llm", "decode_llm"):  # P/D: a worker of that role (serve --pd-*-workers)
            role = fault.removesuffix("_llm")
            eps = sorted(ep for ep in node.llms if node.llm_roles.get(ep) == role)
            if eps:
                ep = eps[n % len(eps)]
                return node.llms[ep], {"endpoint": ep, "role": role}
        if fault == "tp_rank":  # a model-parallel worker's other rank (serve --llm-tensor-parallel-size N)
            eps = sorted(ep for ep in node.llms if node.ranks.get(ep))
            if eps:
                ep = eps[n % len(eps)]
                return node.ranks[ep][0], {"endpoint": ep, "worker_pid": node.llms[ep]}
        if fault == "router" and self.fleet and self.routers:
            i = n % len(self.routers)
            return self.routers[i].proc.pid, {"endpoint": self.routers[i].address, "router_index": i}
        if fault == "router" and self.server is not None and not self.fleet:
            return node.router, {"endpoint": self.address, "children_before": children(node.router)}
        if fault == "redis" and self.fleet and node.redis:
            return node.redis, {"endpoint": f"127.0.0.1:{self.redis.port}"}
        if fault == "mooncake_master" and self.master is not None and self.master.proc.poll() is None:
            return self.master.proc.pid, {"endpoint": f"127.0.0.1:{self.master.port}"}
        return None

    def skip_reason(self, fault: str) -> str:
        if fault == "router" and self.server is None:
            return "attached to --server: the campaign cannot start the node again"
        if fault == "redis":
            return "no Redis in this topology (--topology node: a single router with its state in memory)"
        if fault == "mooncake_master":
            return "no Mooncake Store in this campaign (--mooncake starts one for the KV tier and the embedding cache)"
        if fault == "llm":
            return "this node runs no LLM worker"
        if fault == "tp_rank":
            return "no LLM worker of this node runs several ranks (serve --llm-tensor-parallel-size N)"
        if fault in ("prefill_llm", "decode_llm"):
            role = fault.removesuffix("_llm")
            return f"this node runs no {role}-role LLM worker (serve --pd-{role}-workers N)"
        return f"no {fault} process found"

    def affected(self, fault: str, info: dict, ring_eps: list[str]):
        """Which logged requests are on the killed process's path: those that may fail if they were in flight
        at the kill."""
        if fault in ("encoder", "decode_worker"):
            from mimo_epd.router.hash_ring import HashRing

            ring = HashRing(ring_eps, vnodes=self.args.vnodes)
            ep = info["endpoint"]
            return lambda r: r["kind"] == "encode" and next(ring.owners(r["key"]), None) == ep
        if fault in ("llm", "prefill_llm", "decode_llm", "tp_rank"):
            return lambda r: r["kind"] == "generate"
        if fault == "router" and self.fleet:  # the requests the killed router held (their first router)
            return lambda r: r.get("router") == info["endpoint"]
        if fault in ("redis", "mooncake_master"):  # on no request's path: hits are lost, nothing may fail
            return lambda r: False
        return lambda r: True

    def recovery_path(self, fault: str, info: dict, ring_eps: list[str]):
        """The requests whose first success after the kill tells that clients are served again."""
        if fault in ("router", "redis") and self.fleet or fault == "mooncake_master":
            return lambda r: True  # every client, whichever router it reaches
        return self.affected(fault, info, ring_eps)

    def inject(self, fault: str, deadline: float) -> None:
        picked = self.pick(fault)
        if picked is None:
            if not any(s["fault"] == fault for s in self.skipped):
                self.skipped.append({"fault": fault, "reason": self.skip_reason(fault)})
            return
        pid, info = picked
        node = self.node
        ring_eps = sorted(node.encoders)
        rss_before = rss_mb(pid)
        mark = self.log_mark()
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        log(f"SIGKILL {fault} pid {pid} {info.get('endpoint', '')}")
        is_affected = self.recovery_path(fault, info, ring_eps)
        out = {
            "fault": fault,
            "pid": pid,
            **{k: v for k, v in info.items() if k != "children_before"},
            "t_kill_s": self.rel(t_kill),
            "rss_mb_at_kill": rss_before and round(rss_before, 1),
            "ring": ring_eps,
        }
        if fault == "router" and self.fleet:
            self.recover_fleet_router(t_kill, info, out)
            mark = self.log_mark()  # the new router's log starts empty
        elif fault == "router":
            self.recover_router(t_kill, info, out)
            mark = self.log_mark()  # a new node, a new log
        elif fault == "redis":
            self.recover_redis(t_kill, out)
        elif fault == "mooncake_master":
            self.recover_master(t_kill, out)
        out["_log_mark"] = mark
        waits = self.wait_recovered(fault, pid, info, t_kill, is_affected, deadline, out)
        out.update(waits)
        self.faults.append(out)
        log(f"{fault}: " + json.dumps({k: out[k] for k in out if k.endswith("_s")}))

    def recover_router(self, t_kill: float, info: dict, out: dict) -> None:
        """The single router is the node: see what its death left behind, then start the node again."""
        from mimo_epd.testing.servers import start_server

        try:
            self.server.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.old_logs.append("".join(self.server.stderr_lines))
        # Its children get SIGTERM the moment it dies (parent-death signal) and drain: give them the time.
        t = time.monotonic()
        family = info["children_before"] + [g for c in info["children_before"] for g in children(c)]
        while time.monotonic() - t < self.args.orphan_wait_s and any(alive(c) for c in family):
            time.sleep(0.1)
        out["children_exited_s"] = round(time.monotonic() - t_kill, 3) if not any(alive(c) for c in family) else None
        orphans = [c for c in family if alive(c)]
        out["orphans_after_wait"] = [{"pid": c, "cmd": cmdline(c)[:80]} for c in orphans]
        for c in orphans:  # this campaign started them: never leave them behind
            os.kill(c, signal.SIGKILL)
        seg = Path(f"/dev/shm/mimo-epd-{self.server.proc.pid}")  # the killed launcher's cache segment
        out["shm_segment_left"] = seg.exists()
        if seg.exists():
            seg.unlink()
        t = time.monotonic()
        self.server = start_server(self.serve_args(), subcommand="serve", timeout=self.args.start_timeout_s)
        out["restart_s"] = round(time.monotonic() - t, 3)
        self.refresh_node()

    def recover_fleet_router(self, t_kill: float, info: dict, out: dict) -> None:
        """One of the routers: the clients fail over to the others; start it again on its port."""
        from mimo_epd.testing.servers import start_server

        i = info["router_index"]
        old = self.routers[i]
        try:
            old.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.old_logs.append("".join(old.stderr_lines))
        time.sleep(self.args.router_down_s)  # clients run on the other router(s) meanwhile
        t = time.monotonic()
        self.routers[i] = start_server(
            self.router_args(self.router_ports[i]), subcommand="router", timeout=self.args.start_timeout_s
        )
        out["down_s"] = round(t - t_kill, 3)
        out["restart_s"] = round(time.monotonic() - t, 3)
        self.refresh_node()

    def recover_redis(self, t_kill: float, out: dict) -> None:
        """Redis is down for `--redis-down-s`, then comes back empty."""
        self.redis.proc.wait()
        # Meanwhile the routers must keep serving (health SERVING), routing by load only.
        checks, end = [], t_kill + self.args.redis_down_s
        while time.monotonic() < end:
            checks.append(all(health_serving(a, 0.5) for a in self.addresses))
            time.sleep(max(0.0, min(0.5, end - time.monotonic())))
        out["routers_serving_while_down"] = f"{sum(checks)}/{len(checks)} health checks"
        t = time.monotonic()
        self.redis.start()
        out["down_s"] = round(t - t_kill, 3)
        out["restart_s"] = round(time.monotonic() - t, 3)
        self.refresh_node()

    def recover_master(self, t_kill: float, out: dict) -> None:
        """The Mooncake master is down for `--mooncake-down-s`, then comes back empty on the same ports; the node
        keeps serving meanwhile (its KV tier and embedding cache miss and drop writes)."""
        self.master.proc.wait()
        checks, end = [], t_kill + self.args.mooncake_down_s
        while time.monotonic() < end:
            checks.append(all(health_serving(a, 0.5) for a in self.addresses))
            time.sleep(max(0.0, min(0.5, end - time.monotonic())))
        out["serving_while_down"] = f"{sum(checks)}/{len(checks)} health checks"
        t = time.monotonic()
        self.master.start()
        out["down_s"] = round(t - t_kill, 3)
        out["restart_s"] = round(time.monotonic() - t, 3)

    # -------------------------------------------------------------- logs
    def router_logs(self) -> list[list[str]]:
        """The logs that tell the routers' view (hash ring, state): the routers in a fleet, else the node."""
        if self.fleet:
            return [r.stderr_lines for r in self.routers]
        return [self.server.stderr_lines] if self.server else []

    def log_mark(self) -> dict:
        return {
            "node": len(self.server.stderr_lines) if self.server else 0,
            "routers": [len(x) for x in self.router_logs()],
        }

    def log_has(self, needle: str, mark: dict, where: str) -> bool:
        """`needle` in the node's log (where='node') or in every router's log (where='routers') since `mark`."""
        if where == "node":
            return bool(self.server) and any(needle in ln for ln in self.server.stderr_lines[mark["node"] :])
        logs = self.router_logs()
        marks = mark["routers"] + [0] * (len(logs) - len(mark["routers"]))
        return bool(logs) and all(any(needle in ln for ln in lines[m:]) for lines, m in zip(logs, marks))

    def wait_recovered(self, fault, pid, info, t_kill, is_affected, deadline, out) -> dict:
        """Polls until the affected path has served a request started after the kill, the killed process has
        a serving replacement, the router(s) report SERVING and (when this campaign runs the node and so reads
        the logs) the routers took the encoder back into their rings / the decode pool says it replaced its
        processes / the routers say KV-affinity routing resumed."""
        res: dict = {}
        want = {"first_success_s", "replaced_s", "health_serving_s"}
        log_key = None
        if self.server:
            log_key = {"encoder": "rejoined_ring_s", "decode_worker": "pool_replaced_s"}.get(fault)
            if fault == "redis":
                log_key = "affinity_resumed_s"
        if log_key:
            want.add(log_key)
        mark = out.pop("_log_mark", self.log_mark())
        end = min(deadline, t_kill + self.args.recover_timeout_s)
        while time.monotonic() < end:
            now = time.monotonic()
            recs = self.reqlog.refresh()
            if log_key and log_key not in res:
                if fault == "encoder":
                    ok = self.log_has(f"encoder {info['endpoint']} rejoined the ring", mark, "routers") or self.log_has(
                        f"encoder {info['endpoint']} joined the ring", mark, "routers"
                    )
                elif fault == "decode_worker":
                    ok = self.log_has("replaced the decode processes", mark, "node")
                else:
                    ok = self.log_has("KV-affinity routing resumed", mark, "routers")
                if ok:
                    res[log_key] = round(now - t_kill, 3)
            if "first_success_s" not in res:
                ok = [r["t1"] for r in recs if r["t0"] >= t_kill and r["code"] == "OK" and is_affected(r)]
                if ok:
                    res["first_success_s"] = round(min(ok) - t_kill, 3)
            if "replaced_s" not in res:
                node = self.refresh_node()
                if fault == "encoder":
                    new = node.encoders.get(info["endpoint"])
                    if new and new != pid and health_serving(info["endpoint"], 0.5):
                        res["replaced_s"], res["new_pid"] = round(time.monotonic() - t_kill, 3), new
                elif fault == "decode_worker":
                    now_pids = node.decoders.get(info["endpoint"], [])
                    if pid not in now_pids and len(now_pids) >= len(info["decode_pids_before"]):
                        res["replaced_s"], res["new_pids"] = round(time.monotonic() - t_kill, 3), now_pids
                elif fault in ("llm", "prefill_llm", "decode_llm", "tp_rank"):  # a rank's death ends its worker
                    new = node.llms.get(info["endpoint"])
                    if new and new != info.get("worker_pid", pid) and health_serving(info["endpoint"], 0.5):
                        res["replaced_s"], res["new_pid"] = round(time.monotonic() - t_kill, 3), new
                else:  # router, redis: started again by this campaign
                    res["replaced_s"] = round(out.get("down_s", 0.0) + out.get("restart_s", 0.0), 3)
            if "health_serving_s" not in res and all(health_serving(a, 0.5) for a in self.addresses):
                res["health_serving_s"] = round(time.monotonic() - t_kill, 3)
            if want <= set(res):
                break
            time.sleep(max(0.0, 0.1 - (time.monotonic() - now)))
        for k in want:
            res.setdefault(k, None)  # not recovered within --recover-timeout-s
        return res

    def wait_settled(self, expect: dict, deadline: float) -> float:
        """Before the next fault: every encoder serving with its decode processes, the LLM workers serving,
        every router serving, Redis answering, and (from the routers' logs) no encoder out of any ring, so one
        fault never lands on another's recovery."""
        t = time.monotonic()
        waiting = ""
        while time.monotonic() < deadline:
            node = self.refresh_node()
            checks = {
                "encoders": len(node.encoders) >= expect["encoders"],
                "decoders": all(len(node.decoders.get(ep, [])) >= expect["decoders"] for ep in node.encoders),
                "encoder_health": all(health_serving(ep, 0.5) for ep in node.encoders),
                "llm": len(node.llms) >= expect["llm"] and all(health_serving(ep, 0.5) for ep in node.llms),
                "routers": all(health_serving(a, 0.5) for a in self.addresses),
                "redis": self.redis is None or self.redis.answers(),
            }
            waiting = ",".join(k for k, v in checks.items() if not v)
            ok = not waiting
            if ok and self.server:
                for lines in self.router_logs():
                    state: dict[str, bool] = {}
                    for ln in lines:
                        for ep in node.encoders:
                            if f"encoder {ep} left the ring" in ln:
                                state[ep] = False
                            elif f"encoder {ep} rejoined the ring" in ln or f"encoder {ep} joined the ring" in ln:
                                state[ep] = True
                    ok = ok and all(state.values())
                    if self.fleet:  # a fresh router's ring: every encoder in it
                        ok = ok and set(node.encoders) <= set(state)
                waiting = "" if ok else "ring"
            if ok:
                break
            time.sleep(0.2)
        if waiting:
            log(f"not settled after {time.monotonic() - t:.0f}s: waiting for {waiting}")
        return round(time.monotonic() - t, 3)

    # -------------------------------------------------------------- accounting
    def account(self, records: list[dict], t_end_faults: float) -> None:
        """Attributes each failure to the fault whose window (its kill .. the next kill) it ended in."""
        kills = [self.t0 + f["t_kill_s"] for f in self.faults]
        for i, f in enumerate(self.faults):
            t_kill = kills[i]
            t_next = kills[i + 1] if i + 1 < len(kills) else t_end_faults
            is_aff = self.affected(f["fault"], f, f["ring"])
            inflight = [r for r in records if r["t0"] < t_kill < r["t1"]]
            failed = [r for r in records if t_kill <= r["t1"] < t_next and r["code"] != "OK"]
            codes: dict[str, int] = {}
            for r in failed:
                codes[r["code"]] = codes.get(r["code"], 0) + 1
            f.update(
                {
                    "inflight_at_kill": len(inflight),
                    "inflight_on_killed_path": sum(1 for r in inflight if is_aff(r)),
                    "failed": len(failed),
                    "failed_inflight_at_kill": sum(1 for r in failed if r["t0"] < t_kill),
                    "failed_started_after_kill": sum(1 for r in failed if r["t0"] >= t_kill),
                    "failed_codes": codes,
                    "failed_examples": sorted({f"{r['kind']} {r['code']}: {r['details'][:120]}" for r in failed})[:5],
                    "failed_over": sum(
                        1
                        for r in records
                        if t_kill <= r["t1"] < t_next and r.get("attempts", 1) > 1 and r["code"] == "OK"
                    ),
                    "window_s": round(t_next - t_kill, 3),
                }
            )
            f["failed_beyond_inflight_on_killed_path"] = max(0, f["failed"] - f["inflight_on_killed_path"])

    # -------------------------------------------------------------- run
    def run(self) -> dict:
        a = self.args
        images_dir = self._write_images()
        if not self.address:
            self.port = free_port()
            log(
                f"starting {'a fleet: redis-server, serve --join' if self.fleet else 'serve'} --encoders {a.encoders} "
                f"--llm-workers {self.llm_workers()}" + (f", {a.routers} routers" if self.fleet else "")
            )
            self.start_node()
        node = self.refresh_node()
        if node is None:
            raise RuntimeError(f"no process listens on {self.address}")
        self._ring_eps = sorted(node.encoders)
        expect = {
            "encoders": len(node.encoders),
            "llm": len(node.llms),
            "decoders": min((len(v) for v in node.decoders.values()), default=0),
        }
        log(f"node {self.address}: " + json.dumps(node.roles()))
        sampler = RssSampler(lambda: self.node, a.rss_interval_s)
        sampler.sample()
        sampler.start()
        self.start_load(images_dir, with_llm=bool(node.llms))
        t_load = time.monotonic()
        self._warm_up({"encode"} | ({"generate"} if node.llms else set()))
        faults, interval = self._inject_faults(expect)
        t_end_faults = time.monotonic()
        soak = self._soak(sampler, t_end_faults)
        t_end = time.monotonic()
        sampler.stop()
        self.stop_load()
        records = self.reqlog.refresh()
        self.account(records, t_end_faults)
        first_kill = self.t0 + self.faults[0]["t_kill_s"] if self.faults else t_end_faults
        return {
            "chaos": "serve",
            "topology": a.topology,
            "server": self.address,
            "routers": self.addresses,
            "started_node": self.server is not None,
            "encoders": len(self._ring_eps),
            "llm_workers": len(node.llms),
            "users": a.users,
            "duration_s": a.duration_s,
            "fault_interval_s": round(interval, 3),
            "requested_faults": faults,
            "load": {
                "before_faults": phase_stats(records, t_load, first_kill),
                "faults": phase_stats(records, first_kill, t_end_faults),
                "soak": phase_stats(records, t_end_faults, t_end),
            },
            "failures_outside_fault_windows": sum(
                1 for r in records if r["code"] != "OK" and not (first_kill <= r["t1"] < t_end_faults)
            ),
            "faults": self.faults,
            "skipped": self.skipped,
            "soak": soak,
            "rss_mb_now": {
                role: round(mb, 1)
                for role, pid in (self.refresh_node().roles().items() if self.node else [])
                if (mb := rss_mb(pid)) is not None
            },
            "request_log": str(self.reqlog.path),
        }

    def _write_images(self) -> Path:
        """The load's image pool, written under the work directory."""
        from mimo_epd.testing.media_server import generate_pool

        images_dir = self.workdir / "images"
        images_dir.mkdir()
        for name, data in generate_pool([(480, 640), (720, 1280)], per_size=2).items():
            (images_dir / name).write_bytes(data)
        if self.args.video:  # VideoUser's clips: 3-6 s of noise at 320x240, 30 fps
            from mimo_epd.testing.video_gen import make_test_video

            for i in range(4):
                make_test_video(str(images_dir / f"clip{i}.mp4"), 3 + i, 320, 240, preset="ultrafast", seed=i)
        return images_dir

    def _warm_up(self, kinds: set[str]) -> None:
        """Wait until every kind of request has succeeded at least once (or --warmup-s), then one more second."""
        t_warm = time.monotonic()
        while time.monotonic() - t_warm < self.args.warmup_s:
            if kinds <= {r["kind"] for r in self.reqlog.refresh() if r["code"] == "OK"}:
                break
            time.sleep(0.2)
        time.sleep(1.0)

    def _inject_faults(self, expect: dict) -> tuple[list[str], float]:
        """The fault schedule: one fault per slot over --duration-s, each followed by a wait until the node is whole
        again. Returns the requested faults and the slot length."""
        a = self.args
        t_faults = time.monotonic()
        log(f"load running ({a.users} users); faults {a.faults} for {a.duration_s:g}s")
        faults = [f.strip() for f in a.faults.split(",") if f.strip()]
        interval = min(a.fault_interval_s, a.duration_s / max(1, len(faults)))
        i = 0
        while faults:
            slot_start = t_faults + i * interval
            if slot_start >= t_faults + a.duration_s and i >= len(faults):
                break
            time.sleep(max(0.0, slot_start - time.monotonic()))
            fault = faults[i % len(faults)]
            next_slot = t_faults + (i + 1) * interval
            self.inject(fault, deadline=max(next_slot, time.monotonic() + a.recover_timeout_s))
            if self.faults:
                self.faults[-1]["settled_s"] = self.wait_settled(expect, time.monotonic() + a.recover_timeout_s)
            self._ring_eps = sorted(self.node.encoders) if self.node else self._ring_eps
            i += 1
        time.sleep(max(0.0, t_faults + a.duration_s - time.monotonic()))
        return faults, interval

    def _soak(self, sampler: RssSampler, t_end_faults: float) -> dict:
        """--soak-s of load without faults; the RSS report after its first minute (half of a shorter soak)."""
        soak: dict = {"seconds": self.args.soak_s}
        if self.args.soak_s > 0:
            log(f"soak {self.args.soak_s:g}s")
            warmup = min(60.0, self.args.soak_s / 2)
            time.sleep(self.args.soak_s)
            sampler.sample()
            soak.update(
                {
                    "warmup_s": round(warmup, 1),
                    "rss": soak_report(sampler.samples, t_end_faults, time.monotonic(), warmup, sampler.parts),
                }
            )
        return soak

    def close(self, result: dict | None) -> None:
        self.stop_load()
        if self.server is None:
            return
        node = self.node
        for r in self.routers:  # routers first (they drain), then the node, then Redis
            r.stop(timeout=30)
        rc = self.server.stop(timeout=60)
        if self.redis:
            self.redis.stop()
        if self.master is not None:
            self.master.stop(graceful=True)
        time.sleep(0.2)  # the log reader threads drain the last lines
        logs = self.old_logs + ["".join(r.stderr_lines) for r in self.routers] + ["".join(self.server.stderr_lines)]
        (self.workdir / "serve.log").write_text("\n".join(logs))
        if result is not None:
            result["serve_exit_code"] = rc
            result["router_exit_codes"] = [r.proc.returncode for r in self.routers]
        if node:  # nothing of the node may outlive it (a child finishing its own exit has 10 s to do so)
            roles = {role: p for role, p in node.roles().items() if p != self.server.proc.pid}
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and any(alive(p) for p in roles.values()):
                time.sleep(0.2)
            left = {role: p for role, p in roles.items() if alive(p)}
            for p in left.values():
                os.kill(p, signal.SIGKILL)
            if result is not None:
                result["processes_left_after_stop"] = len(left)
                result["processes_left_roles"] = sorted(left)


def run(args) -> int:
    import importlib.util

    if importlib.util.find_spec("locust") is None:  # not imported here: it monkey-patches the process
        print("error: locust is not installed: pip install 'mimo-epd[loadtest]'", file=sys.stderr)
        return 2
    unknown = [f for f in args.faults.split(",") if f.strip() and f.strip() not in FAULTS]
    if unknown:
        print(f"error: unknown faults {unknown}; choose from {','.join(FAULTS)}", file=sys.stderr)
        return 2
    if args.topology == "auto":
        args.topology = "node" if args.server or shutil.which("redis-server") is None else "fleet"
    if args.topology == "fleet" and args.server:
        print("error: --server attaches to one node: use --topology node", file=sys.stderr)
        return 2
    if args.topology == "fleet" and shutil.which("redis-server") is None:
        print("error: --topology fleet needs redis-server (the Debian package redis-server)", file=sys.stderr)
        return 2
    c = Campaign(args)
    result = None
    try:
        result = c.run()
    finally:
        c.close(result)
    print(json.dumps(result))
    return 0


def add_arguments(p) -> None:
    p.add_argument(
        "--topology",
        choices=["auto", "fleet", "node"],
        default="auto",
        help="fleet: redis-server + `serve --join` + --routers `mimo-epd router`, clients failing over "
        "between them; node: one `serve`; auto: fleet when redis-server is installed (default: auto)",
    )
    p.add_argument("--routers", type=int, default=2, help="fleet: `mimo-epd router` processes (default: 2)")
    p.add_argument(
        "--llm-workers",
        type=int,
        default=0,
        help="LLM workers of the node (0 = 2 in a fleet, 1 on a single node) (default: 0)",
    )
    p.add_argument("--router-args", default="", help="extra flags for each `mimo-epd router` (default: '')")
    p.add_argument(
        "--redis-down-s",
        type=float,
        default=5.0,
        help="redis fault: seconds Redis stays down before the campaign starts it again (default: 5)",
    )
    p.add_argument(
        "--router-down-s",
        type=float,
        default=0.0,
        help="fleet router fault: seconds before the campaign starts the killed router again (default: 0)",
    )
    p.add_argument(
        "--orphan-wait-s",
        type=float,
        default=10.0,
        help="node router fault: how long the killed serve's children get to exit (default: 10)",
    )
    p.add_argument("--duration-s", type=float, default=120.0, help="seconds of the fault phase (default: 120)")
    p.add_argument(
        "--soak-s", type=float, default=600.0, help="seconds of load after the faults, RSS sampled (default: 600)"
    )
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma list, killed in turn every --fault-interval-s (default: {','.join(FAULTS)})",
    )
    p.add_argument(
        "--fault-interval-s",
        type=float,
        default=20.0,
        help="seconds between kills (shortened so every fault fits in --duration-s) (default: 20)",
    )
    p.add_argument(
        "--users",
        type=int,
        default=8,
        help="concurrent Locust users, 3 Encode : 1 Generate (a third of them grammar-constrained) (default: 8)",
    )
    _add_media_and_store_arguments(p)
    p.add_argument(
        "--server", default="", help="attach to this running `serve` (host:port) instead of starting one (default: '')"
    )
    p.add_argument("--encoders", type=int, default=2, help="encoders of the node this campaign starts (default: 2)")
    p.add_argument(
        "--serve-args",
        default="",
        help="extra flags for the `serve` this campaign starts, e.g. '--no-llm' (default: '')",
    )
    p.add_argument(
        "--vnodes",
        type=int,
        default=160,
        help="the router's --vnodes, to tell which encoder owned an item (default: 160)",
    )
    _add_timing_arguments(p)


def _add_media_and_store_arguments(p) -> None:
    """The Mooncake Store campaign and the audio and video load."""
    p.add_argument(
        "--mooncake",
        action="store_true",
        help="start a mooncake_master and give the node --llm-kv-store and --embedding-store on it (the "
        "mooncake_master fault kills it)",
    )
    p.add_argument(
        "--mooncake-down-s", type=float, default=5.0, help="how long the Mooncake master stays down (default: 5)"
    )
    p.add_argument(
        "--audio",
        action="store_true",
        help="add audio clips to the load (1 Audio user in 5 with 3 Encode : 1 Generate)",
    )
    p.add_argument(
        "--video",
        action="store_true",
        help="add short videos to the load (3-6 s clips at a random sampling rate: decoding in flight)",
    )


def _add_timing_arguments(p) -> None:
    """How long the campaign waits for things."""
    p.add_argument(
        "--recover-timeout-s", type=float, default=90.0, help="longest wait for a fault to recover (default: 90)"
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=60.0,
        help="longest wait for the first successes before the first fault (default: 60)",
    )
    p.add_argument("--rss-interval-s", type=float, default=5.0, help="seconds between RSS samples (default: 5)")
    p.add_argument("--call-timeout-s", type=float, default=60.0, help="deadline of each load request (default: 60)")
    p.add_argument(
        "--start-timeout-s", type=float, default=240.0, help="longest wait for the node to be ready (default: 240)"
    )
