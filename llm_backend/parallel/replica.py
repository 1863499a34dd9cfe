"""The first rank's side of a model-parallel replica: it starts the other ranks, joins their process groups, sends
each step's inputs and notices when a rank is gone.

The process picture (docs/parallel.md): rank 0 is the worker process (scheduler, prefix cache, tokenizer, API);
ranks 1..N-1 are processes it spawns (`rank.py`), each holding its shard and KV pools for its heads. Two
torch.distributed groups join them:

- the *device* group (gloo on CPUs, NCCL on GPUs) carries the forward's collectives (`comm.Parallel`); its timeout
  is `--dist-timeout-s`, so a rank that died or hangs fails the next collective within that time;
- the *control* group (gloo) carries `ModelCall`s (mirror.py), pickled with `broadcast_object_list`, from rank 0 to the
  others: rank 0's sends time out like a collective, the other ranks wait for their next step without limit.

Each forward call rank 0 makes is broadcast first (`send`) and then made by every rank on its shard; only rank 0
samples. Start-up is ordered: every rank meets in the default group (its timeout is `--dist-load-timeout-s`: another
node's ranks may start later), joins the two groups, loads its shard (no collective meanwhile), then all meet in a
monitored barrier (`--dist-load-timeout-s`) that names a rank that never arrives.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from .comm import Parallel, ReplicaDown
from .data import DataParallel
from .shard import Shard

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)  # the control group's waits are for work, not for a peer's answer


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build itself (picklable: sent to the spawned ranks)."""

    model: str
    dtype: str  # torch dtype name
    device: str
    fp8_weights: str
    quantization: str
    size: int
    expert_parallel: bool
    full_slots: int
    swa_slots: int
    init_method: str
    timeout_s: float
    load_timeout_s: float
    threads: int = 0
    nnodes: int = 1
    mtp_layers: bool = False  # the MTP layers' KV in the pools too (speculative decoding)
    env: dict = field(default_factory=dict)
    dp_rank: int = 0  # data-parallel attention (data.py): this replica is DP rank dp_rank of dp_size
    dp_size: int = 1
    dp_dispatch: str = "all_to_all"

    def shard(self, rank: int) -> Shard:
        return Shard(rank, self.size, self.expert_parallel, self.dp_rank, self.dp_size)

    @property
    def leader(self) -> int:
        """This replica's rank 0 in the world of every DP rank's ranks (0 without data parallelism)."""
        return self.dp_rank * self.size

    def global_rank(self, rank: int) -> int:
        return self.leader + rank

    def node_ranks(self, node: int) -> range:
        """The ranks node `node` runs (node 0 runs rank 0, the worker, and the next ones)."""
        per = self.size // self.nnodes
        return range(node * per, (node + 1) * per)

    def device_of(self, rank: int) -> str:
        """A rank's device: on CUDA the node-local GPU after rank 0's (`--device cuda:K`: rank r on cuda:K+r, so
        two DP ranks' replicas on one node take disjoint GPUs), the CPU otherwise."""
        if not self.device.startswith("cuda"):
            return self.device
        base = int(self.device.split(":", 1)[1]) if ":" in self.device else 0
        return f"cuda:{base + rank % (self.size // self.nnodes)}"


def free_init_method(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class Replica:
    """Rank 0 of a replica. `start()` spawns ranks 1..N-1 and joins the groups; `ready()` waits for every rank's
    shard; `send(call)` starts a step on the others; `close()` stops them."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.procs: list[Any] = []
        self.control: Any = None
        self.down: str = ""  # why the replica is down ("" while it serves)
        self.par = Parallel(spec.shard(0))
        self.data: DataParallel | None = None  # with data-parallel attention: the DP group this replica is in

    def start(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("a model-parallel replica is already running in this process (one per process)")
        self.procs = start_ranks(self.spec, self.spec.node_ranks(0)[1:])
        log.info("model parallelism: %d ranks, this node runs %s", self.spec.size, list(self.spec.node_ranks(0)))
        try:
            self.control, device, self.data = join_groups(self.spec, 0)
            self.par = Parallel(self.spec.shard(0), device, data=self.data)
        except Exception as e:
            self.close()
            raise RuntimeError(f"the model-parallel ranks did not join ({e})") from None

    def ready(self) -> None:
        """After this rank's shard is loaded: waits for every rank's (a rank that fails or never arrives is named)."""
        import torch.distributed as dist

        try:
            dist.monitored_barrier(self.control, timeout=timedelta(seconds=self.spec.load_timeout_s))
        except Exception as e:
            dead = self.missing()
            self.close()
            raise RuntimeError(f"the model-parallel ranks did not load their shards ({dead or e})") from None
        log.info("model parallelism: %d ranks ready", self.spec.size)

    def missing(self) -> str:
        """The ranks whose processes are gone, in words ("" when all run)."""
        gone = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()]  # local
        return ", ".join(gone)

    def _who(self, wait_s: float = 1.0) -> str:
        """The ranks gone or stopped, waiting up to `wait_s` for a rank whose socket closed to be seen exiting (a
        collective can fail before the kernel has reaped the process)."""
        deadline = time.monotonic() + wait_s
        while True:
            who = self.missing() or self.stuck()
            if who or time.monotonic() >= deadline:
                return who
            time.sleep(0.05)

    def stuck(self) -> str:
        """The ranks whose processes are stopped (SIGSTOP, a debugger) or zombies, in words ("" when none)."""
        out = []
        for i, p in enumerate(self.procs):
            state = _proc_state(p.pid)
            if state in ("T", "t", "Z"):
                out.append(f"rank {i + 1} (pid {p.pid}, {'stopped' if state != 'Z' else 'a zombie'})")
        return ", ".join(out)

    def send(self, call) -> None:
        """Starts `call` (a `mirror.ModelCall`) on the other ranks."""
        import torch.distributed as dist

        if self.down:
            raise ReplicaDown(self.down)
        try:
            dist.broadcast_object_list([call], src=self.spec.leader, group=self.control)
        except Exception as e:
            self.fail(e)

    def gather(self, mine) -> list:
        """Every rank's answer to the last call sent (rank 0's is `mine`), in rank order: the other ranks answer
        calls that report back (mirror.py `MirroredTransfer`) with the same collective on the control group."""
        import torch.distributed as dist

        if self.down:
            raise ReplicaDown(self.down)
        out: list = [None] * self.spec.size
        try:
            dist.all_gather_object(out, mine, group=self.control)
        except Exception as e:
            self.fail(e)
        return out

    def fail(self, e: BaseException) -> None:
        """Marks the replica down after a failed broadcast or collective and raises `ReplicaDown`."""
        if not self.down:
            who = self._who() or "a rank failed or timed out"
            self.down = f"model-parallel replica down: {who} ({e})"
            log.error("%s", self.down)
        raise ReplicaDown(self.down) from e

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            if not self.down and self.control is not None and all(p.is_alive() for p in self.procs):
                try:
                    dist.broadcast_object_list([None], src=self.spec.leader, group=self.control)
                except Exception:  # noqa: BLE001 - stopping anyway
                    pass
            for p in self.procs:
                p.join(timeout=0 if self.down else 10)  # a down replica's ranks may hang: not waited for
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []


def spec_from_config(cfg, dtype: torch.dtype | None = None, full_slots: int | None = None) -> RankSpec:
    """The ranks' spec from an `LLMConfig` (every node derives the same one from the same flags)."""
    if full_slots is None:
        full_slots = cfg.kv_cache_tokens - cfg.kv_cache_tokens % cfg.page_size
    return RankSpec(
        model=cfg.model,
        dtype=str(dtype or cfg.torch_dtype()).removeprefix("torch."),
        device=cfg.device,
        fp8_weights=cfg.fp8_weights,
        quantization=cfg.quantization,
        size=cfg.tensor_parallel_size,
        expert_parallel=cfg.enable_expert_parallel,
        full_slots=full_slots,
        swa_slots=cfg.swa_cache_tokens,
        init_method=f"tcp://{cfg.dist_init_addr}" if cfg.dist_init_addr else free_init_method(),
        timeout_s=cfg.dist_timeout_s,
        load_timeout_s=cfg.dist_load_timeout_s,
        threads=cfg.torch_threads,
        nnodes=cfg.nnodes,
        mtp_layers=cfg.speculative_steps > 0,
        dp_rank=cfg.data_parallel_rank,
        dp_size=cfg.data_parallel_size,
        dp_dispatch=cfg.data_parallel_dispatch,
    )


def start_ranks(spec: RankSpec, ranks) -> list:
    """Spawns one process per rank in `ranks` (daemons: they end with this process)."""
    from .rank import rank_main

    ctx = mp.get_context("spawn")
    procs = []
    for r in ranks:
        p = ctx.Process(target=rank_main, args=(spec, r), name=f"tp-rank-{r}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def host_ranks(spec: RankSpec, node: int) -> int:
    """Node `node` > 0 of a replica: runs its ranks until they exit; returns the first non-zero exit code (0 when
    all stopped cleanly: rank 0 said stop)."""
    procs = start_ranks(spec, spec.node_ranks(node))
    log.info(
        "node %d of %d: ranks %s (pids %s)", node, spec.nnodes, list(spec.node_ranks(node)), [p.pid for p in procs]
    )
    codes = []
    for p in procs:
        p.join()
        codes.append(p.exitcode or 0)
    return next((c for c in codes if c), 0)


def _proc_state(pid: int | None) -> str:
    """A local process's state letter from /proc ("" where there is none to read)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def join_groups(spec: RankSpec, rank: int) -> tuple[Any, Any, DataParallel | None]:
    """Joins the replica: returns (control group, device group, the DP group or None). The default group only meets
    (its timeout is the load timeout: the ranks of other nodes may start minutes later); the device group's
    collectives time out after --dist-timeout-s. With data-parallel attention the default group is every DP rank's
    ranks (DP rank d's replica holds ranks d*N .. d*N+N-1): every process makes every replica's groups, in the same
    order, and keeps its own, then the DP group of all ranks (data.py)."""
    import torch.distributed as dist

    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    dist.init_process_group(
        "gloo",
        init_method=spec.init_method,
        rank=spec.global_rank(rank),
        world_size=spec.size * spec.dp_size,
        timeout=timedelta(seconds=spec.load_timeout_s),
    )
    # Rank 0's sends wait at most the collective timeout (a hung rank must not hang the engine); the other ranks
    # wait for their next step without limit (an idle engine sends nothing). The timeout is each process's own.
    wait = timedelta(seconds=spec.timeout_s) if rank == 0 else CONTROL_TIMEOUT
    mine: tuple[Any, Any] = (None, None)
    for d in range(spec.dp_size):
        ranks = list(range(d * spec.size, (d + 1) * spec.size)) if spec.dp_size > 1 else None
        device = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=spec.timeout_s))
        control = dist.new_group(ranks, backend="gloo", timeout=wait)
        if d == spec.dp_rank:
            mine = (control, device)
    data = None
    if spec.dp_size > 1:
        data = DataParallel.joined(
            spec.dp_rank, spec.dp_size, spec.size, rank, spec.timeout_s, spec.dp_dispatch, spec.device
        )
    return mine[0], mine[1], data


def set_threads(spec: RankSpec) -> None:
    if spec.threads > 0:
        torch.set_num_threads(spec.threads)
    for k, v in spec.env.items():
        os.environ.setdefault(k, v)
