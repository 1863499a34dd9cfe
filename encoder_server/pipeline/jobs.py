"""What travels through the pipeline: a request's items (`ItemRequest`), their answers (`ItemResult`),
the per-item `Job` the stages pass along, and `Next`, the place a stage sends a job to."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import grpc
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
    AUDIO = "audio"  # an audio item's bytes in hand: to the audio path (decode processes, windows batched)
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
    meta: dict | None = None  # videos: timestamps_s and the sampled video's description; audio: its description

    @property
    def num_tokens(self) -> int:
        return int(self.embedding.shape[0])


# Bytes of an item's reply besides its embedding (key, shape, dtype, grid, timings, field tags), rounded up.
ITEM_REPLY_OVERHEAD = 1024


@dataclass
class ReplyBudget:
    """The bytes one request's reply will take, charged item by item as sizes become known (after
    preprocessing, before the forward; or on a cache hit), so a reply that cannot be sent under
    --max-message-mb is refused before the work, not after it."""

    limit: int
    used: int = 0

    def charge(self, job: "Job", nbytes: int, what: str) -> None:
        if job.charged:
            return
        job.charged = nbytes + ITEM_REPLY_OVERHEAD
        self.used += job.charged
        if self.used > self.limit:
            mib = 1 << 20
            raise ItemError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the reply would be {self.used / mib:.1f} MiB, over the largest message this server sends "
                f"({self.limit / mib:g} MiB, --max-message-mb); this item's embedding is {what} = "
                f"{nbytes / mib:.1f} MiB; send fewer or smaller items per request",
            )


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
    key_extra: str = ""  # what the item's options add to its content key (its MediaKind's `prepare`)
    reply: ReplyBudget | None = None  # its request's reply size budget
    charged: int = 0  # bytes charged to `reply` for this item
    fetches: dict | None = None  # its request's downloads by (URL, byte limit): one per URL (`Stages.read`)

    @property
    def wanted(self) -> bool:
        """Someone still waits for this item: its own request, or identical items attached to it (a leader
        whose request failed keeps going for its followers)."""
        return not self.future.done() or any(not f.future.done() for f in self.followers)

    def fail(self, err: ItemError) -> None:
        for job in [self, *self.followers]:
            job.fail_self(err)

    def fail_self(self, err: ItemError) -> None:
        """Fails this item's own request only; followers keep waiting for the result."""
        if not self.future.done():
            self.future.set_exception(ItemError(err.code, err.reason, self.index))

    def succeed(self, emb: CachedEmbedding, cache_hit: bool) -> None:
        self._resolve(ItemResult(self.key, emb.embedding, emb.grid_thw, cache_hit, self.timings_ms, emb.meta))
        for f in self.followers:
            f._resolve(ItemResult(f.key, emb.embedding, emb.grid_thw, True, f.timings_ms, emb.meta))

    def _resolve(self, result: ItemResult) -> None:
        if self.future.done():
            return
        if self.reply is not None:
            e = result.embedding
            try:
                self.reply.charge(
                    self, e.numel() * e.element_size(), f"{e.shape[0]} x {e.shape[1]} {e.dtype}".replace("torch.", "")
                )
            except ItemError as err:
                self.fail_self(err)
                return
        self.future.set_result(result)
