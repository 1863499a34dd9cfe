"""Data-parallel attention (`--data-parallel-size M`, SGLang's `--enable-dp-attention`): M worker processes, each
with the whole attention, its own scheduler, KV pools, prefix cache, requests and API, share one set of experts
split over all of them (expert parallelism over the M ranks). The router sees each DP rank as a worker of its own.

The MoE layers are where the ranks meet. A MoE layer is one *round* on the DP group (gloo; `DataParallel.moe`):

1. every rank sends (active, layer, its token count) — an all-gather of three integers;
2. every rank's tokens are gathered (an all-gather, padded to the largest count), so every rank holds all of them
   in rank order;
3. each rank routes every token (the router is replicated, fp32: every rank picks the same experts) and computes
   the share of its own experts;
4. the shares are summed (an all-reduce) and each rank keeps the rows of its own tokens.

Gloo has neither all-to-all nor reduce-scatter, so the dispatch is an all-gather and the combine an all-reduce; on
NCCL these are where an all-to-all dispatch and combine go (docs/parallel.md).

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
from typing import Any, Protocol

import torch

from .comm import ReplicaDown

log = logging.getLogger(__name__)


class ExpertShare(Protocol):
    """A MoE layer as a DP round needs it: this rank's experts' partial sum over any tokens [T, hidden]."""

    def share(self, x: torch.Tensor) -> torch.Tensor: ...


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
    gathered_tokens: int = 0
    steps: int = 0
    idle_polls: int = 0


class DataParallel:
    """One DP rank's membership of the DP group (with attention tensor-parallel inside a DP rank, each of its `tp`
    ranks is a member: DP rank d's ranks are d*tp .. d*tp+tp-1 of the group, and they hold the same tokens).
    `start()` joins it (a DP rank of one process; the ranks of a split replica join through replica.py and
    `joined`); `sync` (DP ranks' first ranks only) / `moe` / `finish` are the lockstep's collectives."""

    def __init__(self, rank: int, size: int, init_method: str, timeout_s: float, load_timeout_s: float, tp: int = 1):
        self.rank, self.size, self.tp = rank, size, tp
        self.init_method = init_method
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self.group: Any = None  # every rank of every DP rank: the MoE rounds
        self.leaders: Any = None  # each DP rank's first rank: `sync`
        self.down = ""  # why the DP group is down ("" while it serves)
        self.stats = DPStats()

    @classmethod
    def joined(cls, rank: int, size: int, tp: int, timeout_s: float) -> "DataParallel":
        """After init_process_group over all size x tp ranks (replica.py `join_groups`): makes the DP groups (every
        process of the world calls this, in the same order)."""
        data = cls(rank, size, "", timeout_s, timeout_s, tp)
        data._make_groups()
        return data

    def _make_groups(self) -> None:
        import torch.distributed as dist

        wait = timedelta(seconds=self.timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=wait)
        self.leaders = (
            self.group
            if self.tp == 1
            else dist.new_group([d * self.tp for d in range(self.size)], timeout=wait, backend="gloo")
        )

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
        self._collective(lambda dist: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.leaders), "sync")
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

    def _round(self, layer: int, experts, x: torch.Tensor, layers: dict | None = None) -> torch.Tensor | None:
        meta = torch.tensor([int(layer >= 0), layer, x.shape[0]], dtype=torch.int64)
        metas = [torch.empty_like(meta) for _ in range(self.size * self.tp)]
        self._collective(lambda d: d.all_gather(metas, meta, group=self.group), "a MoE round's token counts")
        active = [(int(m[1]), int(m[2])) for m in metas if m[0]]
        if not active:
            return None
        at = {lay for lay, _ in active}
        if len(at) != 1 or (layer >= 0 and layer not in at):
            self._down(RuntimeError(f"the DP ranks are out of step: MoE layers {sorted(at)} in one round"))
        if experts is None:
            assert layers is not None
            experts = layers[at.pop()]
        counts = [int(metas[d * self.tp][2]) for d in range(self.size)]  # a DP rank's ranks hold the same tokens
        if max(counts) == 0:
            return x
        return self._exchange(experts, x, counts)

    def _exchange(self, experts: ExpertShare, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Gathers every DP rank's tokens, computes this rank's experts' share of all of them, sums the shares and
        returns this DP rank's rows."""
        most = max(counts)
        padded = x.new_zeros((most, x.shape[-1]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size * self.tp)]
        self._collective(lambda d: d.all_gather(parts, padded, group=self.group), "a MoE round's tokens")
        everyone = torch.cat([parts[d * self.tp][:n] for d, n in enumerate(counts)])
        self.stats.gathered_tokens += everyone.shape[0]
        try:
            out = experts.share(everyone).contiguous()
        except Exception as e:  # the others' sums would lack this rank's experts: nothing can be trusted now
            self._down(e)
        self._collective(lambda d: d.all_reduce(out, group=self.group), "a MoE round's expert sums")
        first = sum(counts[: self.rank])
        return out[first : first + x.shape[0]]

    def _collective(self, call, what: str) -> None:
        import torch.distributed as dist

        if self.down:
            raise ReplicaDown(self.down)
        t0 = time.perf_counter()
        try:
            call(dist)
        except Exception as e:
            self._down(RuntimeError(f"{what}: {e}"))
        self.stats.seconds += time.perf_counter() - t0

    def peer_stopped(self) -> ReplicaDown:
        """Another DP rank said it stops: the group cannot serve any more (marked down; the error to raise)."""
        self.down = self.down or f"data-parallel group down at rank {self.rank} of {self.size}: another DP rank stopped"
        return ReplicaDown(self.down)

    def _down(self, e: BaseException):
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
