"""Data-parallel attention (`--data-parallel-size M`, SGLang's `--enable-dp-attention`): M worker processes, each
with the whole attention, its own scheduler, KV pools, prefix cache, requests and API, share one set of experts
split over all of them (expert parallelism over the M ranks). The router sees each DP rank as a worker of its own.

The MoE layers are where the ranks meet. A MoE layer is one *round* on the DP group (gloo or NCCL alike: only
torch.distributed collectives; `DataParallel.moe`):

1. each rank routes its own tokens (the router is replicated, fp32) and counts them as its load;
2. every rank sends (active, layer, how many rows it sends to each rank): an all-gather of 2 + world integers;
3. dispatch (`--data-parallel-dispatch all_to_all`): each token goes, with its routing, to every rank holding one
   of its experts (an all-to-all of the rows and one of their routing); each rank runs its experts over what it
   received and sends the sums back (combine: an all-to-all), added per token;
   or (`all_gather`): every rank's tokens are gathered to every rank, each computes its experts' share of all of
   them, the shares are all-reduced and each rank keeps its own rows.

With attention tensor-parallel inside a DP rank, its `tp` ranks hold the same tokens: with all-to-all each sends
every tp-th of them and returns its part (the layer's tensor-parallel all-reduce joins the parts, as after any MoE
layer); with all-gather the DP rank's first rank returns the rows and the others zeros.

**Lockstep.** A collective needs every rank, but the ranks' steps differ (one prefills a long prompt, one decodes,
one is idle; with MTP speculation one forward or three). The rule that keeps them together, the join of
`torch.distributed.algorithms.Join` applied per round:

- the engine loop starts a step only when the ranks agree that one of them has work (`sync`: an all-reduce of
  (has work, stopping), polled every `--data-parallel-poll-ms` while idle); every rank then runs its own step,
  possibly empty;
- a rank whose step is over (or had nothing to run) *shadows* (`finish`): it answers every round with zero tokens,
  computing its experts' share of the others' tokens for the round's layer, until a round in which no rank is
  active. Every forward passes the sparse layers in the same order, so the active ranks of a round are always at
  the same layer (checked: ranks out of step fail loudly).

A round that fails on any rank (a collective timed out or a peer closed its socket, or this rank's expert compute
raised after the tokens were exchanged: the others' sums would be wrong) takes the DP group down (`ReplicaDown`):
this worker's requests fail with `unavailable` naming the reason and the worker exits, as at TP > 1.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn, Protocol

import torch

from .comm import ReplicaDown

log = logging.getLogger(__name__)


DISPATCHES = ("all_to_all", "all_gather")


class ExpertShare(Protocol):
    """A MoE layer as a DP round needs it (models/mimo_v2_flash.py `MoE`): `route` this rank's own tokens (counted
    as its load), and `share`: this rank's experts' partial sum over any tokens, routed as given or by itself."""

    n_experts: int
    top_k: int

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def share(
        self, x: torch.Tensor, weights: torch.Tensor | None = None, ids: torch.Tensor | None = None
    ) -> torch.Tensor: ...


def moe_layers(model) -> dict[int, ExpertShare]:
    """A model's MoE layers by decoder layer index: what a shadowing rank answers the rounds with."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "share")}


@dataclass
class DPStats:
    """This rank's rounds: active (its forward's tokens in it) and shadow (answering the others'), the seconds
    spent in the round's collectives (waiting for the slowest rank included), the tokens it gathered, its steps."""

    rounds: int = 0
    shadow_rounds: int = 0
    seconds: float = 0.0
    expert_rows: int = 0  # token rows this rank's experts ran over (its own and the others')
    sent_rows: int = 0  # token rows this rank sent to other ranks' experts (or contributed to the gather)
    steps: int = 0
    idle_polls: int = 0


class DataParallel:
    """One DP rank's membership of the DP group (with attention tensor-parallel inside a DP rank, each of its `tp`
    ranks is a member: DP rank d's ranks are d*tp .. d*tp+tp-1 of the group, and they hold the same tokens).
    `start()` joins it (a DP rank of one process; the ranks of a split replica join through replica.py and
    `joined`); `sync` (DP ranks' first ranks only) / `moe` / `finish` are the lockstep's collectives."""

    def __init__(
        self,
        rank: int,
        size: int,
        init_method: str,
        timeout_s: float,
        load_timeout_s: float,
        dispatch: str = "all_to_all",
        tp: int = 1,
        tp_rank: int = 0,
        device: str = "cpu",
    ):
        if dispatch not in DISPATCHES:
            raise ValueError(f"--data-parallel-dispatch must be one of {', '.join(DISPATCHES)}, got {dispatch!r}")
        self.rank, self.size, self.tp, self.tp_rank, self.dispatch = rank, size, tp, tp_rank, dispatch
        self.init_method = init_method
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self.backend = "nccl" if device.startswith("cuda") else "gloo"  # the rounds' tensors live on the device
        self.group: Any = None  # every rank of every DP rank: the MoE rounds (NCCL on GPUs, gloo on CPUs)
        self.leaders: Any = None  # each DP rank's first rank: `sync` (gloo: two integers on the CPU)
        self.down = ""  # why the DP group is down ("" while it serves)
        self.stats = DPStats()

    @classmethod
    def joined(
        cls, rank: int, size: int, tp: int, tp_rank: int, timeout_s: float, dispatch: str, device: str
    ) -> "DataParallel":
        """After init_process_group over all size x tp ranks (replica.py `join_groups`): makes the DP groups (every
        process of the world calls this, in the same order)."""
        data = cls(rank, size, "", timeout_s, timeout_s, dispatch, tp, tp_rank, device)
        data._make_groups()
        return data

    def _make_groups(self) -> None:
        import torch.distributed as dist

        wait = timedelta(seconds=self.timeout_s)
        self.group = dist.new_group(backend=self.backend, timeout=wait)
        if self.tp == 1 and self.backend == "gloo":
            self.leaders = self.group
        else:
            self.leaders = dist.new_group([d * self.tp for d in range(self.size)], timeout=wait, backend="gloo")

    def start(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("a process group already runs in this process (one DP rank per process)")
        log.info("data parallelism: rank %d of %d joining at %s", self.rank, self.size, self.init_method)
        try:
            dist.init_process_group(
                "gloo",
                init_method=self.init_method,
                rank=self.rank,
                world_size=self.size,
                timeout=timedelta(seconds=self.load_timeout_s),
            )
            self._make_groups()
        except Exception as e:
            raise RuntimeError(f"data-parallel rank {self.rank} could not join the other DP ranks ({e})") from None
        log.info("data parallelism: rank %d of %d joined", self.rank, self.size)

    def ready(self) -> None:
        """After this DP rank's model is loaded (all its ranks': replica.py waited for them): waits (the load
        timeout) for every DP rank's, naming one that never arrives."""
        import torch.distributed as dist

        try:
            dist.monitored_barrier(self.leaders, timeout=timedelta(seconds=self.load_timeout_s), wait_all_ranks=True)
        except Exception as e:
            raise RuntimeError(f"the data-parallel ranks did not all load their models ({e})") from None

    # ------------------------------------------------------------------------------------- the three collectives
    def sync(self, busy: bool, stopping: bool = False) -> tuple[bool, bool]:
        """(does any rank have work, is any rank stopping): every rank calls it at the top of each loop turn."""
        flags = torch.tensor([int(busy), int(stopping)], dtype=torch.int64)
        from torch.distributed import ReduceOp

        self._collective("sync", "all_reduce", flags, op=ReduceOp.MAX, group=self.leaders)
        if not flags[0]:
            self.stats.idle_polls += 1
        else:
            self.stats.steps += 1
        return bool(flags[0]), bool(flags[1])

    def moe(self, layer: int, experts: ExpertShare, x: torch.Tensor) -> torch.Tensor:
        """An active round: this rank's tokens x [T, hidden] through MoE layer `layer`, every rank's experts summed."""
        self.stats.rounds += 1
        out = self._round(layer, experts, x)
        assert out is not None
        return out

    def finish(self, layers: dict[int, ExpertShare], like: torch.Tensor) -> None:
        """After this rank's step: shadows the others' rounds until no rank is active (`layers`: the model's MoE
        layers by index; `like`: a tensor of the hidden dtype and device, for the empty token rows)."""
        empty = like.new_zeros((0, like.shape[-1]))
        while self._round(-1, None, empty, layers) is not None:
            self.stats.shadow_rounds += 1

    @property
    def world(self) -> int:
        return self.size * self.tp

    def _round(self, layer: int, experts, x: torch.Tensor, layers: dict | None = None) -> torch.Tensor | None:
        """One round on every rank: the metas (active, layer, rows for each rank), then the exchange. None when no
        rank is active (the shadow loop's end)."""
        plan = _Plan.make(self, experts, x) if layer >= 0 else _Plan.empty(self.world, x.device)
        meta = torch.tensor([int(layer >= 0), layer, *plan.counts], dtype=torch.int64, device=x.device)
        metas = [torch.empty_like(meta) for _ in range(self.world)]
        self._collective("a MoE round's token counts", "all_gather", metas, meta, group=self.group)
        at = {int(m[1]) for m in metas if m[0]}
        if not at:
            return None
        if len(at) != 1 or (layer >= 0 and layer not in at):
            self._down(RuntimeError(f"the DP ranks are out of step: MoE layers {sorted(at)} in one round"))
        if experts is None:
            assert layers is not None
            experts = layers[at.pop()]
        table = torch.stack(metas)[:, 2:].cpu()  # [from rank, to rank] rows
        if not table.any():
            return torch.zeros_like(x)
        if self.dispatch == "all_gather":
            return self._gather_round(experts, x, table)
        return self._all_to_all_round(experts, x, plan, table)

    def _all_to_all_round(self, experts: ExpertShare, x: torch.Tensor, plan: "_Plan", table) -> torch.Tensor:
        """Dispatch: each of this rank's token rows (its tensor-parallel part of its DP rank's tokens) goes, with its
        routing, to every rank holding one of its experts; those ranks run their experts on what they received and
        send the sums back (combine), added per token. The result is this rank's part: the tensor-parallel reduce
        after the layer joins the parts of a DP rank's ranks."""
        me = self.rank * self.tp + self.tp_rank
        recv = table[:, me].tolist()
        k = experts.top_k
        routing = plan.routing if plan.routing.shape[1] == 2 * k else x.new_zeros((0, 2 * k), dtype=torch.float32)
        rows = self._a2a(x[plan.order], plan.counts, recv, "a MoE round's tokens")
        meta = self._a2a(routing, plan.counts, recv, "a MoE round's routing")  # (a shadow sends none)
        self.stats.expert_rows += rows.shape[0]
        self.stats.sent_rows += plan.order.numel()
        try:
            out = experts.share(rows, meta[:, :k], meta[:, k:].long()).to(x.dtype)
        except Exception as e:  # the senders would miss this rank's experts: nothing can be trusted now
            self._down(e)
        back = self._a2a(out, recv, plan.counts, "a MoE round's expert sums")
        result = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        result.index_add_(0, plan.order, back.float())
        return result.to(x.dtype)

    def _a2a(self, t: torch.Tensor, send: list[int], recv: list[int], what: str) -> torch.Tensor:
        out = t.new_empty((sum(recv), *t.shape[1:]))
        self._collective(what, "all_to_all_single", out, t.contiguous(), recv, send, group=self.group)
        return out

    def _gather_round(self, experts: ExpertShare, x: torch.Tensor, table) -> torch.Tensor:
        """Every DP rank's tokens gathered to every rank, each rank's experts' share of all of them, the shares
        summed (all-reduce) and this DP rank's rows kept: on its first rank (the tensor-parallel reduce after the
        layer adds the others' zeros)."""
        counts = [int(table[d * self.tp, 0]) for d in range(self.size)]  # a DP rank's ranks hold the same tokens
        padded = x.new_zeros((max(counts), x.shape[-1]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self._collective("a MoE round's tokens", "all_gather", parts, padded, group=self.group)
        everyone = torch.cat([parts[d * self.tp][:n] for d, n in enumerate(counts)])
        self.stats.expert_rows += everyone.shape[0]
        self.stats.sent_rows += x.shape[0]
        try:
            out = experts.share(everyone).to(x.dtype).contiguous()
        except Exception as e:  # the others' sums would lack this rank's experts: nothing can be trusted now
            self._down(e)
        self._collective("a MoE round's expert sums", "all_reduce", out, group=self.group)
        first = sum(counts[: self.rank])
        mine = out[first : first + x.shape[0]]
        return mine if self.tp_rank == 0 else torch.zeros_like(mine)

    def _collective(self, what: str, call: str, *args, **kwargs) -> None:
        """`torch.distributed.<call>(*args, **kwargs)`, timed; a failure takes the group down, naming `what`."""
        import torch.distributed as dist

        if self.down:
            raise ReplicaDown(self.down)
        t0 = time.perf_counter()
        try:
            getattr(dist, call)(*args, **kwargs)
        except Exception as e:
            self._down(RuntimeError(f"{what}: {e}"))
        self.stats.seconds += time.perf_counter() - t0

    def peer_stopped(self) -> ReplicaDown:
        """Another DP rank said it stops: the group cannot serve any more (marked down; the error to raise)."""
        self.down = self.down or f"data-parallel group down at rank {self.rank} of {self.size}: another DP rank stopped"
        return ReplicaDown(self.down)

    def _down(self, e: BaseException) -> NoReturn:
        if not self.down:
            self.down = (
                f"data-parallel group down at rank {self.rank} of {self.size}: a DP rank failed, hung or left ({e})"
            )
            log.error("%s", self.down)
        raise ReplicaDown(self.down) from e

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass


class _Plan(NamedTuple):
    """An active rank's dispatch: its rows in the order they are sent (`order`, indexes into its tokens), how many
    go to each rank (`counts`; all-gather: its token count for every rank), and their routing [rows, 2k] (weights,
    then expert ids, as fp32: exact below 2^24 experts)."""

    order: torch.Tensor
    counts: list[int]
    routing: torch.Tensor

    @staticmethod
    def empty(world: int, device) -> "_Plan":
        return _Plan(torch.zeros(0, dtype=torch.long, device=device), [0] * world, torch.zeros(0, 0, device=device))

    @staticmethod
    def make(dp: DataParallel, experts: ExpertShare, x: torch.Tensor) -> "_Plan":
        weights, ids = experts.route(x)  # every rank of a DP rank routes (and counts) all of its tokens
        if dp.dispatch == "all_gather":
            return _Plan(torch.zeros(0, dtype=torch.long), [x.shape[0]] * dp.world, torch.zeros(0, 0))  # unused
        mine = torch.arange(dp.tp_rank, x.shape[0], dp.tp, device=ids.device)  # this rank's part of the tokens
        owner = ids[mine] // (experts.n_experts // dp.world)
        parts = [mine[(owner == j).any(dim=1)] for j in range(dp.world)]
        order = torch.cat(parts).to(x.device)
        routing = torch.cat([weights[order].float(), ids[order].float()], dim=1)
        return _Plan(order, [int(p.numel()) for p in parts], routing)
