"""`mimo-epd bench cache-routing --hot`: one hot item under plain consistent hashing vs bounded loads, live.

A node (`mimo-epd serve --encoders N`, its one LLM worker idle: N encoder processes sharing the node's shm cache behind the
node's encoder router) is loaded closed-loop at `--concurrency` with a mix: a fraction `--hot-fraction` of the
requests ask for one hot image (large: its cached rows are megabytes to read and send), the rest for unique small
images (encodes). Under plain hashing (`--encoder-load-factor 0`) every hot request goes to the hot item's ring
owner, which also owns its share of the unique items; with bounded loads (`--encoder-load-factor`, default 1.25)
an owner over the bound passes items to the next encoder, which finds the hot item in the same shm cache.

Reported per run: QPS, P50 / P90 / P99 of all requests and of the hot ones, items per encoder, and every
hot reply checked equal to the first. `ratios.p90_bounded_vs_plain` is the bounded run's P90 over the plain run's.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from mimo_epd.bench.common import closed_loop, latency_stats


def _run(args, hot: bytes, unique: list[bytes], plan: list[bool], load_factor: float) -> dict:
    import grpc

    from mimo_epd.testing.redis_server import free_port
    from mimo_epd.testing.servers import scrape, start_server
    from mimo_epd.v1 import encoder_pb2 as pb
    from mimo_epd.v1 import encoder_pb2_grpc

    port = free_port()
    node = start_server(
        [
            "--encoders",
            str(args.hot_encoders),
            "--llm-workers",  # a node needs one; this load never calls it
            "1",
            "--llm-model",
            "tiny-random",
            "--llm-torch-threads",
            "1",
            "--http-port",
            "-1",
            "--encoder-load-factor",
            str(load_factor),
            "--decode-workers",
            "1",
            "--torch-threads",
            "1",
            "--shm-cache-bytes",
            str(256 << 20),
            "--metrics-port",
            str(port),
        ],
        "serve",
        timeout=240,
    )
    hot_lat: list[float] = []
    replies: list[bytes] = []
    try:

        async def go():
            async with grpc.aio.insecure_channel(
                node.address, options=[("grpc.max_receive_message_length", 1 << 30)]
            ) as ch:
                stub = encoder_pb2_grpc.EncoderStub(ch)
                await stub.Encode(pb.EncodeRequest(items=[pb.MediaItem(data=hot)]), timeout=120)  # cached from here

                async def send(i: int) -> None:
                    data = hot if plan[i] else unique[i]
                    t0 = time.perf_counter()
                    r = await stub.Encode(pb.EncodeRequest(items=[pb.MediaItem(data=data)]), timeout=120)
                    if plan[i]:
                        hot_lat.append(time.perf_counter() - t0)
                        replies.append(bytes(r.items[0].embedding.data))

                return await closed_loop(send, len(plan), args.concurrency)

        lat, wall, failures = asyncio.run(go())
        m = scrape(port)
    finally:
        node.stop()
    per_encoder = sorted(int(v) for k, v in m.items() if k.startswith("encoder_items_total"))
    return {
        **latency_stats(lat, wall),
        "hot": latency_stats(hot_lat, wall),
        "failures": failures,
        "items_per_encoder": per_encoder,  # how the items spread (the owner of the hot item takes the most)
        "hot_replies_equal": len(set(replies)) <= 1,
    }


def main(args) -> dict:
    from mimo_epd.testing.media_server import photo_like

    from .fleet_cache import _png

    n = 32 if args.quick else args.hot_requests
    rng = np.random.default_rng(args.seed)
    hot = _png(photo_like(896, 896, seed=10_000))
    unique = [_png(photo_like(int(rng.integers(64, 160)), int(rng.integers(64, 160)), seed=i)) for i in range(n)]
    plan = [bool(x) for x in rng.random(n) < args.hot_fraction]
    t0 = time.perf_counter()
    plain = _run(args, hot, unique, plan, 0.0)
    bounded = _run(args, hot, unique, plan, args.hot_load_factor)
    return {
        "bench": "cache-routing-hot",
        "live": True,
        "workload": {
            "encoders": args.hot_encoders,
            "requests": n,
            "hot_fraction": args.hot_fraction,
            "hot_requests": sum(plan),
            "hot_image": "896x896 PNG",
            "unique_images": "64-160 px PNGs",
            "concurrency": args.concurrency,
            "load_factor": args.hot_load_factor,
            "seed": args.seed,
        },
        "plain": plain,
        "bounded": bounded,
        "outputs_match": plain["hot_replies_equal"] and bounded["hot_replies_equal"],
        "ratios": {
            "p90_bounded_vs_plain": round(bounded["p90_ms"] / plain["p90_ms"], 3),
            "hot_p90_bounded_vs_plain": round(bounded["hot"]["p90_ms"] / plain["hot"]["p90_ms"], 3),
            "qps_bounded_vs_plain": round(bounded["qps"] / plain["qps"], 3),
        },
        "seconds": round(time.perf_counter() - t0, 2),
    }
