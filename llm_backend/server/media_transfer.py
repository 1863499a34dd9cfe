"""Media embedding rows from encoders over Mooncake's transfer engine (`--encoder-transfer tcp|rdma`): the
worker's side of encoder_server/transfer.py's protocol.

The worker registers one receive buffer once (`--encoder-transfer-buffer-bytes`). Its Encode asks the encoder to
`hold` the rows; the reply says, per item, which encoder holds how many bytes. `take` then takes an exact range of
the buffer per held item, asks each holding encoder to `Transfer` them there (the encoder writes; the worker only
awaits a small gRPC reply, so its engine thread never waits on Mooncake), copies the rows out and frees the ranges.

Failure rules: a range is freed on every path, at once. No room for a reply's rows, or a Transfer that fails (the
encoder died mid-transfer, an expired hold, a write the engine refused), raises `MediaTransferFailed` after
releasing what the other encoders still hold; the caller then asks for the same items again as bytes in the reply
(the encoders' caches make it a hit, and a router in front sends it to another encoder when the first is gone).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from mimo_epd.common.auth import client_interceptors
from mimo_epd.common.transfer_buffer import TransferBuffer
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)


class MediaTransferFailed(RuntimeError):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason  # "no_room" or "failed"


class EmbeddingReceiver:
    def __init__(self, buffer_bytes: int, host: str, protocol: str = "tcp", device: str = "", max_message_mb: int = 64):
        self.buf = TransferBuffer(buffer_bytes, host, protocol, device)
        self._max_message_mb = max_message_mb
        self._stubs: dict[str, encoder_pb2_grpc.EncoderStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> encoder_pb2_grpc.EncoderStub:
        stub = self._stubs.get(address)
        if stub is None:
            mb = self._max_message_mb << 20
            ch = grpc.aio.insecure_channel(
                address,
                interceptors=client_interceptors(),
                options=[("grpc.max_receive_message_length", mb), ("grpc.max_send_message_length", mb)],
            )
            self._channels.append(ch)
            stub = self._stubs[address] = encoder_pb2_grpc.EncoderStub(ch)
        return stub

    async def take(self, items, timeout: float | None) -> tuple[dict[int, torch.Tensor], int, float]:
        """The rows of the reply's held items by item index, the bytes moved and the seconds taken. Raises
        MediaTransferFailed (every range freed, every other hold released)."""
        held = [(i, it) for i, it in enumerate(items) if it.HasField("held")]
        if not held:
            return {}, 0, 0.0
        t0 = time.perf_counter()
        offs: dict[int, int] = {}
        try:
            for i, it in held:
                off = self.buf.ranges.alloc(it.held.bytes)
                if off is None:
                    raise MediaTransferFailed(
                        "no_room",
                        f"no room for {it.held.bytes} bytes of item {i} in the receive buffer "
                        f"(--encoder-transfer-buffer-bytes, {self.buf.ranges.used_bytes} of {self.buf.ranges.size} "
                        "in use)",
                    )
                offs[i] = off
            by_encoder: dict[str, list[int]] = {}
            for i, it in held:
                by_encoder.setdefault(it.held.encoder, []).append(i)
            calls = {
                enc: self._stub(enc).Transfer(
                    encoder_pb2.TransferRequest(
                        session=self.buf.session,
                        ids=[items[i].held.id for i in idx],
                        addresses=[self.buf.base + offs[i] for i in idx],
                    ),
                    timeout=timeout,
                )
                for enc, idx in by_encoder.items()
            }
            outcomes = await asyncio.gather(*calls.values(), return_exceptions=True)
            for enc, out in zip(calls, outcomes):
                if isinstance(out, BaseException):
                    detail = out.details() if isinstance(out, grpc.aio.AioRpcError) else str(out)
                    raise MediaTransferFailed("failed", f"the transfer from encoder {enc} failed: {detail}")
            rows = {i: self._copy_out(offs[i], it) for i, it in held}
            return rows, sum(it.held.bytes for _, it in held), time.perf_counter() - t0
        except MediaTransferFailed:
            self._release([it for _, it in held])
            raise
        finally:
            for off in offs.values():
                self.buf.ranges.free(off)

    def _copy_out(self, off: int, it) -> torch.Tensor:
        dtype = getattr(torch, it.embedding.dtype, None)
        shape = tuple(it.embedding.shape)
        n = 0 if not isinstance(dtype, torch.dtype) else torch.Size(shape).numel() * dtype.itemsize
        if n != it.held.bytes:
            raise MediaTransferFailed(
                "failed",
                f"held rows of {it.held.bytes} bytes do not match shape {shape} and dtype {it.embedding.dtype}",
            )
        raw = torch.from_numpy(self.buf.view(off, n).copy())
        return raw.view(dtype).view(*shape)

    def _release(self, held) -> None:
        """Frees what encoders still hold for this reply (best effort: a release an encoder misses expires there)."""
        by_encoder: dict[str, list[int]] = {}
        for it in held:
            by_encoder.setdefault(it.held.encoder, []).append(it.held.id)
        for enc, ids in by_encoder.items():
            call = self._stub(enc).Transfer(encoder_pb2.TransferRequest(ids=ids), timeout=2.0)
            task = asyncio.ensure_future(call)
            task.add_done_callback(_ignore_outcome)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
        self.buf.close()


def _ignore_outcome(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("releasing held rows failed: %s", task.exception())
