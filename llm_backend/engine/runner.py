"""The model runner: one forward over a step's segments, then sampling. The scheduler talks to it through
`execute(segments) -> results` only, so a simulated runner (llm_backend/sim) can stand in for it.

Every step is one forward over all running requests (`forward_batch`: GEMMs over all their tokens at once;
attention over the paged pools through `PagedBatch`: Triton kernels on CUDA, torch on the CPU). Media
embeddings replace the token embeddings at their prompt positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol

import torch

from ..models.mimo_v2_flash import SeqInput
from ..paged_attention import KVPools, PagedBatch, SeqSlots
from ..parallel.mirror import MirroredModel
from ..parallel.replica import Replica
from .interfaces import KVLoader, mask_rows
from .penalties import Penalties
from .sampler import SamplingError, sample
from .scheduler import Segment, SegmentResult


class Runner(Protocol):
    def execute(self, segments: list[Segment]) -> list[SegmentResult]: ...


class ModelRunner:
    def __init__(self, model, pools: KVPools, kv_loader: KVLoader | None = None, peers: Replica | None = None):
        """`pools`: the KV pools the forward reads and writes (built for the model: `KVPools(model.config, ...)`).
        `kv_loader`: what queues KV for this forward from the host / shared store (kv.tiers.TieredRadixCache),
        loaded layer by layer while the forward runs; None without KV tiers. `peers`: the other ranks of a
        model-parallel replica (this runner is rank 0's): each forward is sent to them first, then run here."""
        # A split model's forwards are sent to its other ranks first (parallel/mirror.py); one rank: the model.
        self.model = MirroredModel(model, peers) if peers is not None else model
        self.pools = pools
        self.device = next(model.parameters()).device
        self.kv_loader = kv_loader
        self.penalties = Penalties(model.config.vocab_size)  # sampling controls, per request

    def metrics(self) -> dict:
        return {}

    def _segment_tokens(self, seg: Segment) -> list[int]:
        """The token ids a segment computes."""
        return seg.request.tokens[seg.start : seg.start + seg.n]

    def _inputs(self, seg: Segment) -> SeqInput:
        r, start, n = seg.request, seg.start, seg.n
        new = self._segment_tokens(seg)
        ids = torch.tensor(new, device=self.device)
        media = None
        if r.media:
            rows = [j for j in range(n) if start + j in r.media]
            if rows:
                values = torch.stack([r.media[start + j] for j in rows]).to(self.device)
                media = (torch.tensor(rows, device=self.device), values)
        return SeqInput(ids, torch.arange(start, start + n, device=self.device), media=media)

    @contextmanager
    def _batch(self, segments: list[Segment]) -> Iterator[PagedBatch]:
        """The step's attention over the pools for `segments`, with this forward's KV-tier loads running layer by
        layer (finished when the block exits, whatever happens in it)."""
        kvs = [s.request.kv for s in segments]
        assert all(kv is not None for kv in kvs), "every scheduled request has its KV"
        load = self.kv_loader.start_load() if self.kv_loader is not None else None
        try:
            yield PagedBatch(
                self.pools,
                [SeqSlots(kv.full, kv.swa, s.start, s.n) for kv, s in zip(kvs, segments)],  # type: ignore[union-attr]
                wait=load.wait if load is not None else None,
            )
        finally:
            if load is not None:
                load.finish()

    def execute(self, segments: list[Segment]) -> list[SegmentResult]:
        with self._batch(segments) as paged:
            logits = self.model.forward_batch(
                [self._inputs(s) for s in segments], ["all" if s.all_logits else "last" for s in segments], paged
            )
        logits = self._masked(segments, logits)
        return [self._result(s, lg) for s, lg in zip(segments, logits)]

    @staticmethod
    def _masked(segments: list[Segment], logits) -> list[torch.Tensor]:
        """The logits with the last row of every constrained request that samples masked by its grammar (one
        bitmask for the batch); verifying segments are masked row by row by the speculative runner."""
        idx = [j for j, s in enumerate(segments) if s.samples and not s.drafts and s.request.constraint is not None]
        out = list(logits)
        if not idx:
            return out
        rows = mask_rows([segments[j].request.constraint for j in idx], [out[j][-1] for j in idx])  # type: ignore[misc]
        for j, row in zip(idx, rows):
            lg = out[j].float().clone()
            lg[-1] = row
            out[j] = lg
        return out

    def _result(self, seg: Segment, logits: torch.Tensor) -> SegmentResult:
        r = seg.request
        prompt_lp: list[float | None] = []
        tops: tuple[list[tuple[int, float]], ...] = ()
        if seg.all_logits:
            lp = torch.log_softmax(logits.float(), dim=-1)
            rows = [j for j in range(seg.n) if seg.start + j + 1 < len(r.prompt)]
            nexts = [r.tokens[seg.start + j + 1] for j in rows]
            vocab = lp.shape[-1]  # a media placeholder (id >= vocab) has no logprob: None, like the first token
            nxt = torch.tensor([t if t < vocab else 0 for t in nexts], dtype=torch.long, device=lp.device)
            got = lp[rows, nxt].tolist() if rows else []
            prompt_lp = [v if t < vocab else None for v, t in zip(got, nexts)]
            k = r.params.top_logprobs
            if k and rows:  # each prompt position's top k (a scoring client checks whether the prompt was greedy)
                values, ids = torch.topk(lp[rows], min(k, lp.shape[-1]))
                tops = tuple(
                    [(int(i), float(v)) for i, v in zip(ri, rv)] for ri, rv in zip(ids.tolist(), values.tolist())
                )
        if not seg.samples:
            return SegmentResult(None, prompt_lp, prompt_top=tops)
        try:
            row = self.penalties.adjust(r, logits[-1])
            return SegmentResult(sample(row, r.params, r.generator), prompt_lp, prompt_top=tops)
        except SamplingError as e:
            return SegmentResult(None, prompt_lp, str(e), prompt_top=tops)
