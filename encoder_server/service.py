"""The encoder's gRPC service: `mimo_epd.v1.Encoder/Encode`, plus standard health checking and reflection.

`run_encoder_server(config)` is what `mimo-epd encoder` runs: it loads the model, starts the
pipeline, serves on `host:port`, prints `ready host:port` once serving, and on SIGTERM/SIGINT stops
accepting, lets in-flight requests finish within `--grace-period-s`, and returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time

import grpc
import torch

from mimo_epd.common.grpc_server import GrpcServer, stop_on_signals, wait_for_signal
from mimo_epd.common.transfer_buffer import TransferError, reachable_host
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

from .config import EncoderServerConfig
from .errors import ItemError
from .fetch import MediaSource
from .pipeline import EncodePipeline, ItemRequest, ItemResult
from .transfer import EmbeddingSender, NotHeld

log = logging.getLogger(__name__)

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name
_MODALITIES = {
    encoder_pb2.MODALITY_UNSPECIFIED: "image",
    encoder_pb2.IMAGE: "image",
    encoder_pb2.VIDEO: "video",
    encoder_pb2.AUDIO: "audio",
}


def fill_tensor(out: encoder_pb2.Tensor, t: torch.Tensor) -> None:
    """Writes `t` into a message field in place. Embeddings are megabytes: building a message and passing it
    to a parent's constructor copies it once per level, so responses are filled where they live."""
    t = t.detach().to("cpu").contiguous()
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("big-endian hosts are not supported")
    out.data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    out.shape.extend(t.shape)
    out.dtype = str(t.dtype).removeprefix("torch.")


def item_from_proto(item: encoder_pb2.MediaItem, index: int) -> ItemRequest:
    which = item.WhichOneof("source")
    if which is None:
        raise ItemError(grpc.StatusCode.INVALID_ARGUMENT, "no source set (one of url, data, path)", index)
    value = getattr(item, which)
    if which == "data":
        source = MediaSource("data", bytes(value))
    else:
        if not value:
            raise ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"empty {which}", index)
        source = MediaSource(which, value)
    modality = _MODALITIES.get(item.modality)
    if modality is None:
        raise ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown modality {item.modality}", index)
    v = item.video
    for name in ("fps",):  # every float of the message: finite and not negative (0 = the server's default)
        x = getattr(v, name)
        if not math.isfinite(x) or x < 0:
            raise ItemError(
                grpc.StatusCode.INVALID_ARGUMENT, f"video.{name} must be a finite number >= 0, got {x}", index
            )
    return ItemRequest(
        source,
        modality,
        item.content_hash,
        video_fps=v.fps,
        video_max_frames=v.max_frames,
        video_min_frames=v.min_frames,
    )


def fill_item(out: encoder_pb2.ItemEmbedding, r: ItemResult, held: tuple[str, int, int] | None = None) -> None:
    """The reply item; with `held` = (encoder address, id, bytes) the rows stay here for a Transfer and the
    embedding carries only their shape and dtype."""
    t = r.timings_ms
    out.content_key = r.content_key
    if held is None:
        fill_tensor(out.embedding, r.embedding)
    else:
        out.embedding.shape.extend(r.embedding.shape)
        out.embedding.dtype = str(r.embedding.dtype).removeprefix("torch.")
        out.held.encoder, out.held.id, out.held.bytes = held
    out.grid_thw.extend(r.grid_thw)
    out.num_tokens, out.cache_hit = r.num_tokens, r.cache_hit
    out.timings.fetch_ms, out.timings.decode_ms, out.timings.preprocess_ms = t["fetch"], t["decode"], t["preprocess"]
    out.timings.queue_ms, out.timings.encode_ms = t["queue"], t["encode"]
    if r.meta:
        out.timestamps_s.extend(r.meta.get("timestamps_s", []))
        out.end_s = float(r.meta.get("end_s", 0.0))
        if "video" in r.meta:
            out.video.CopyFrom(encoder_pb2.VideoInfo(**r.meta["video"]))
        if "audio" in r.meta:
            out.audio.CopyFrom(encoder_pb2.AudioInfo(**r.meta["audio"]))
            out.window_tokens.extend(r.meta.get("window_tokens", []))


class EncoderService(encoder_pb2_grpc.EncoderServicer):
    def __init__(
        self, pipeline: EncodePipeline, sender: EmbeddingSender | None = None, server: GrpcServer | None = None
    ):
        """`sender`: the transfer engine's side of held rows (--embedding-transfer); `server`: the gRPC server this
        service runs in (its bound port names this encoder in `held`, what a worker calls Transfer on)."""
        self.pipeline, self.sender, self.server = pipeline, sender, server

    @property
    def address(self) -> str:
        return f"{reachable_host(self.server.host)}:{self.server.port}" if self.server is not None else ""

    def _held(self, r: ItemResult, hold: bool) -> tuple[str, int, int] | None:
        if not hold or self.sender is None:
            return None
        h = self.sender.hold(r.embedding)
        return None if h is None else (self.address, h[0], h[1])

    async def Transfer(self, request: encoder_pb2.TransferRequest, context: grpc.aio.ServicerContext):
        ids, addrs = list(request.ids), list(request.addresses)
        if self.sender is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this encoder holds no rows (started without --embedding-transfer)"
            )
        if not request.session:
            self.sender.release(ids)
            return encoder_pb2.TransferReply()
        if len(ids) != len(addrs) or not ids:
            self.sender.release(ids)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{len(ids)} ids and {len(addrs)} addresses: one address per id"
            )
        t0 = time.perf_counter()
        try:
            n = await asyncio.to_thread(self.sender.send, request.session, ids, addrs)
        except NotHeld as e:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"held rows {e.args[0]} are not here (expired after --embedding-transfer-hold-s, moved, or never held)",
            )
        except TransferError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        return encoder_pb2.TransferReply(bytes=n, seconds=time.perf_counter() - t0)

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        t0 = time.perf_counter()
        try:
            items = [item_from_proto(it, i) for i, it in enumerate(request.items)]
            results = await self.pipeline.encode(items)
        except ItemError as e:
            log.info("Encode %s failed: %s %s", request.request_id or "-", e.code.name, e)
            await context.abort(e.code, str(e))
        log.debug(
            "Encode %s: %d items in %.1f ms", request.request_id or "-", len(results), (time.perf_counter() - t0) * 1e3
        )
        response = encoder_pb2.EncodeResponse(model=self.pipeline.model_id)
        for r in results:
            fill_item(response.items.add(), r, self._held(r, request.hold))
            if not response.items[-1].HasField("held"):
                self.pipeline.metrics.reply_bytes.inc(len(response.items[-1].embedding.data))
        # The pipeline refuses a reply it can size in advance; this catches any remainder (field overhead),
        # so an unsendable reply is a clear INVALID_ARGUMENT, never a transport error after the work.
        size, limit = response.ByteSize(), self.pipeline.config.max_message_mb << 20
        if size > limit:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the reply is {size / (1 << 20):.1f} MiB, over the largest message this server sends "
                f"({self.pipeline.config.max_message_mb} MiB, --max-message-mb); send fewer or smaller "
                "items per request",
            )
        return response


async def _expire_holds(sender: EmbeddingSender) -> None:
    """Frees rows held past --embedding-transfer-hold-s even while no request comes."""
    while True:
        await asyncio.sleep(1.0)
        sender.expire()


async def serve_encoder(
    config: EncoderServerConfig,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    announce: bool = True,
) -> int:
    pipeline = EncodePipeline(config)
    await pipeline.start()
    sender = None
    if config.embedding_transfer:
        sender = EmbeddingSender(
            config.embedding_transfer_staging_bytes,
            config.embedding_transfer_hold_s,
            config.host,
            config.embedding_transfer,
            config.embedding_transfer_device,
        )
        pipeline.metrics.watch_transfer(sender)
    srv = GrpcServer(config.host, config.port, config.max_message_mb)
    srv.add(encoder_pb2_grpc.add_EncoderServicer_to_server, EncoderService(pipeline, sender, srv), SERVICE_NAME)
    try:
        await srv.start()
    except BaseException:
        await pipeline.stop()
        raise
    expiry = asyncio.create_task(_expire_holds(sender)) if sender is not None else None
    log.info(
        "encoder serving model %s on %s (device %s, preprocessing %s)",
        pipeline.model_id,
        srv.address,
        config.device,
        pipeline.preprocess_config,
    )
    stop = stop or asyncio.Event()
    stop_on_signals(stop)  # before the ready line: a SIGTERM right after it is a clean stop
    if announce:
        srv.announce()
    if ready is not None:
        ready.port = srv.port  # type: ignore[attr-defined]
        ready.set()
    await wait_for_signal(stop)
    log.info("shutting down: refusing new requests, %gs grace for in-flight ones", config.grace_period_s)
    await srv.stop(config.grace_period_s)
    if expiry is not None:
        expiry.cancel()
        sender.close()
    await pipeline.stop()
    log.info("stopped")
    return 0
