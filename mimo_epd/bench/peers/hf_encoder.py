"""Peer encoder server: the image path the Qwen2.5-VL model card shows, served the way a user would serve it.

Per image: the bytes come through one persistent aiohttp session (pooled connections), then
`qwen_vl_utils.fetch_image` (RGB conversion + smart_resize with PIL, under our preprocessing bounds),
transformers' fast processor `Qwen2VLImageProcessor` (its torchvision backend: rescale/normalize/patchify, same
patch/merge/temporal sizes and CLIP mean/std as ours) and transformers' `Qwen2_5_VisionTransformerPretrainedModel`
loaded from the same checkpoint as our tower. It speaks our gRPC Encode contract (image URL items only), so
the benchmark's load generator is identical for every mode.

- `--batching off` (peer_per_request): each request runs fetch_image + processor + forward in a thread
  pool as wide as `--threads` (the client concurrency);
- `--batching on` (peer_batched): fetch_image + processor in that pool, then a dynamic batcher gathers up to
  `--max-batch` images (or what arrived within `--max-wait-ms` of the first) into one forward on one
  model thread (transformers packs images with cu_seqlens, so batching does not change an embedding).

    python -m mimo_epd.bench.peers.hf_encoder --checkpoint DIR [--batching] --threads 16 --port 0
prints `ready HOST:PORT` once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc


class HfImagePath:
    """fetch_image -> fast processor -> vision tower, all from the public packages."""

    def __init__(self, checkpoint: str, min_pixels: int, max_pixels: int, patch_size: int = 14):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        # In transformers 5, `Qwen2VLImageProcessor` is the torchvision ("fast") backend; the PIL one is
        # `Qwen2VLImageProcessorPil`. The older `...Fast` name is a deprecated alias of the same class.
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        self.min_pixels, self.max_pixels, self.patch_size = min_pixels, max_pixels, patch_size
        self.processor = Qwen2VLImageProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
            patch_size=patch_size,
            temporal_patch_size=2,
            merge_size=2,
        )  # default image_mean/std are the CLIP ones we use
        self.model = Qwen2_5_VisionTransformerPretrainedModel.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def preprocess(self, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image
        from qwen_vl_utils import fetch_image

        img = fetch_image(
            {"image": Image.open(io.BytesIO(data)), "min_pixels": self.min_pixels, "max_pixels": self.max_pixels},
            image_patch_size=self.patch_size,
        )
        out = self.processor(images=[img], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(pixel_values, grid_thw=grid_thw).pooler_output

    def encode_one(self, data: bytes) -> tuple[np.ndarray, list[int]]:
        pv, grid = self.preprocess(data)
        return self.forward(pv, grid).numpy(), grid[0].tolist()


class DynamicBatcher:
    """Gathers preprocessed images from concurrent callers into one forward on a single model thread."""

    def __init__(self, path: HfImagePath, max_batch: int, max_wait_s: float):
        self.path, self.max_batch, self.max_wait_s = path, max_batch, max_wait_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.task: asyncio.Task | None = None

    async def submit(self, pv: torch.Tensor, grid: torch.Tensor) -> np.ndarray:
        if self.task is None:
            self.task = asyncio.create_task(self._run())
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((pv, grid, fut))
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            pv = torch.cat([b[0] for b in batch])
            grid = torch.cat([b[1] for b in batch])
            try:
                out = await loop.run_in_executor(self.model_thread, self.path.forward, pv, grid)
            except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
                for b in batch:
                    if not b[2].done():
                        b[2].set_exception(e)
                continue
            start = 0
            for _, g, fut in batch:
                n = int(g.prod()) // 4  # tokens after the 2x2 merge
                if not fut.done():
                    fut.set_result(out[start : start + n].numpy())
                start += n


class PeerEncoder(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, path: HfImagePath, threads: int, batcher: DynamicBatcher | None):
        self.path, self.batcher = path, batcher
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="work")
        self.session = None  # one aiohttp session for the server's life, created on its loop
        self.connections = threads

    async def _fetch(self, url: str) -> bytes:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections))
        async with self.session.get(url) as r:
            r.raise_for_status()
            return await r.read()

    async def Encode(self, request, context):
        loop = asyncio.get_running_loop()
        items = []
        for i, item in enumerate(request.items):
            if item.WhichOneof("source") != "url":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"item {i}: this peer takes image URLs only")
            try:
                data = await self._fetch(item.url)
                if self.batcher is None:
                    emb, grid = await loop.run_in_executor(self.pool, self.path.encode_one, data)
                else:
                    pv, g = await loop.run_in_executor(self.pool, self.path.preprocess, data)
                    emb, grid = await self.batcher.submit(pv, g), g[0].tolist()
            except Exception as e:  # noqa: BLE001 - reported to the client, the server keeps serving
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"item {i}: {type(e).__name__}: {e}")
            emb = np.ascontiguousarray(emb, dtype=np.float32)
            items.append(
                encoder_pb2.ItemEmbedding(
                    embedding=encoder_pb2.Tensor(data=emb.tobytes(), shape=list(emb.shape), dtype="float32"),
                    grid_thw=grid,
                    num_tokens=emb.shape[0],
                )
            )
        return encoder_pb2.EncodeResponse(items=items, model="transformers-qwen2.5-vl-vision")


async def serve(args) -> None:
    path = HfImagePath(args.checkpoint, args.min_pixels, args.max_pixels, args.patch_size)
    batcher = DynamicBatcher(path, args.max_batch, args.max_wait_ms / 1000) if args.batching else None
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 256 << 20)])
    encoder_pb2_grpc.add_EncoderServicer_to_server(PeerEncoder(path, args.threads, batcher), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"ready {args.host}:{port}", flush=True)
    await stop.wait()
    await server.stop(0.2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="vision tower checkpoint directory (transformers layout)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--threads", type=int, default=16, help="worker threads (= the client concurrency) (default: 16)")
    p.add_argument(
        "--batching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="dynamic batching across callers (default: off)",
    )
    p.add_argument("--max-batch", type=int, default=16, help="images per batched forward (default: 16)")
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="how long a batch waits for more images after its first (default: 5)",
    )
    p.add_argument("--min-pixels", type=int, default=56 * 56)
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 1280)
    p.add_argument("--patch-size", type=int, default=14)
    args = p.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
