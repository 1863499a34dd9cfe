"""The collectives a model-parallel forward makes, on a torch.distributed process group (gloo on CPUs, NCCL on
GPUs). One `Parallel` per model: its `shard` (what this rank holds, shard.py) and the group its ranks share.

Per decoder layer a tensor-parallel forward makes two all-reduces (after attention's o_proj and after the MLP or
the experts: both row-parallel, each rank holding a partial sum); the vocabulary-parallel embedding one more
(each rank fills the rows of the ids it holds) and the LM head one all-gather (each rank has its vocabulary
part of the logits). With expert parallelism every rank routes every token (the router is replicated, fp32, on
the same inputs) and computes its own experts' share: the combine is the same all-reduce (the gloo backend has
no all-to-all; on NCCL this is where a dispatch / combine all-to-all goes, docs/parallel.md).
A single rank (`SINGLE`) makes none of these calls and computes exactly what the unsplit model computes.
With data-parallel attention (`data`, parallel/data.py) the MoE layers also exchange tokens with the other DP ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .shard import SINGLE, Shard

if TYPE_CHECKING:
    from .data import DataParallel


class ReplicaDown(RuntimeError):
    """A rank of the replica (or a DP rank of the group) died, hung past the collective timeout or failed its
    forward: nothing can run here any more."""


@dataclass
class CommStats:
    """What this rank's collectives cost: calls and seconds spent in them (waiting for the slowest rank included),
    and the bytes this rank contributed."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


@dataclass(frozen=True)
class Parallel:
    shard: Shard = SINGLE
    group: Any = None  # torch.distributed ProcessGroup (None: the default group)
    stats: CommStats = field(default_factory=CommStats, compare=False)
    data: DataParallel | None = None  # the DP group with data-parallel attention (data.py), else None

    @property
    def single(self) -> bool:
        """No tensor parallelism: attention, MLPs and the vocabulary are whole here (no collectives of this group)."""
        return self.shard.size == 1

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `x` (in place)."""
        if self.single:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self._count(t0, x)
        return x

    def _count(self, t0: float, x: torch.Tensor) -> None:
        s = self.stats
        s.calls += 1
        s.seconds += time.perf_counter() - t0
        s.bytes += x.numel() * x.element_size()

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary part of [T, V/N] logits, joined in rank order: [T, V]."""
        if self.single:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.shard.size)]
        t0 = time.perf_counter()
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self._count(t0, x)
        return torch.cat(parts, dim=-1)

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Token embeddings from vocabulary-split rows: each rank looks up the ids it holds (zeros elsewhere) and
        the rows are summed over ranks."""
        if self.single:
            return F.embedding(ids, weight)
        lo = self.shard.rank * weight.shape[0]
        local = ids - lo
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out = out.masked_fill(outside[:, None], 0)
        return self.reduce(out)


SINGLE_RANK = Parallel()
