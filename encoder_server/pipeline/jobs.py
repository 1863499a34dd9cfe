"""What travels through the pipeline: a request's items (`ItemRequest`), their answers (`ItemResult`),
the per-item `Job` the stages pass along, and `Next`, the place a stage sends a job to."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import torch

from ..embedding_cache import CachedEmbedding
from ..errors import ItemError
from ..fetch import MediaSource

STAGES = ("fetch", "decode", "preprocess", "queue", "encode")


class Next(enum.Enum):
    """Where a job goes after a stage. A stage that fails a job raises an `ItemError` instead."""
    FETCH = "fetch"  # checked on arrival, not answered from the cache: get its bytes
    DECODE = "decode"  # bytes in hand, not cached, first of its content key: decode the image
    PREPROCESS = "preprocess"  # pixels decoded: resize / normalize / patchify
    BATCH = "batch"  # patches ready (`job.batch_item`): to the batcher and the vision forward
    VIDEO = "video"  # a video's bytes in hand: to the video path (parallel decode streamed into the tower)
    ANSWERED = "answered"  # answered from the cache: nothing left to do
    ATTACHED = "attached"  # an identical item is in flight: answered when that one is


@dataclass
class ItemRequest:
    source: MediaSource
    modality: str = "image"
    content_hash: str = ""
    # VIDEO: per-item overrides of the server's sampling defaults (0 = default)
    video_fps: float = 0.0
    video_max_frames: int = 0
    video_min_frames: int = 0


@dataclass
class ItemResult:
    content_key: str
    embedding: torch.Tensor  # [num_tokens, hidden] on the CPU
    grid_thw: tuple[int, int, int]
    cache_hit: bool
    timings_ms: dict[str, float]
    meta: dict | None = None  # videos: timestamps_s and the sampled video's description

    @property
    def num_tokens(self) -> int:
        return int(self.embedding.shape[0])


@dataclass(eq=False)
class Job:
    index: int
    request: ItemRequest
    future: asyncio.Future
    timings_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    data: bytes | None = None
    key: str = ""
    pixels: object = None  # decoded HxWx3 uint8 (or patches, when the decoder patchified)
    batch_item: object = None  # the BatchItem, once preprocessed
    followers: list["Job"] = field(default_factory=list)
    sampling: object = None  # VideoSampling for video items
    abandoned: bool = False  # its request already failed; finish only if others wait on it

    @property
    def wanted(self) -> bool:
        return not self.future.done() and (not self.abandoned or any(not f.future.done() for f in self.followers))

    def fail(self, err: ItemError) -> None:
        for job in [self, *self.followers]:
            if not job.future.done():
                job.future.set_exception(ItemError(err.code, err.reason, job.index))

    def succeed(self, emb: CachedEmbedding, cache_hit: bool) -> None:
        if not self.future.done():
            self.future.set_result(ItemResult(self.key, emb.embedding, emb.grid_thw, cache_hit, self.timings_ms, emb.meta))
        for f in self.followers:
            if not f.future.done():
                f.future.set_result(ItemResult(f.key, emb.embedding, emb.grid_thw, True, f.timings_ms, emb.meta))
