"""Consistent hashing with bounded loads on the encoder router: a hot item pinned to its owner is spread once the
owner holds more than the load factor times the mean of the router's items in flight; under light load every item
stays with its owner; 0 turns the bound off. Real gRPC encoders stand in by a servicer that blocks until released."""

from __future__ import annotations

import asyncio

import grpc

from mimo_epd.router.encoder import EncoderRouter, RouterConfig, routing_key
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc


class Slow(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, gate: asyncio.Event):
        self.gate, self.seen = gate, 0

    async def Encode(self, request, context):
        self.seen += len(request.items)
        await self.gate.wait()
        return encoder_pb2.EncodeResponse(
            items=[encoder_pb2.ItemEmbedding(num_tokens=1) for _ in request.items], model="m"
        )


async def _scenario(load_factor: float, concurrent: int) -> tuple[dict[str, int], int]:
    gate = asyncio.Event()
    servers, encoders, addrs = [], [], []
    for _ in range(3):
        server = grpc.aio.server()
        enc = Slow(gate)
        encoder_pb2_grpc.add_EncoderServicer_to_server(enc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        encoders.append(enc)
        addrs.append(f"127.0.0.1:{port}")
    router = EncoderRouter(addrs, RouterConfig(load_factor=load_factor))
    hot = encoder_pb2.MediaItem(data=b"the same hot image")
    owner = router.ring.owner(routing_key(hot))

    class Ctx:
        def time_remaining(self):
            return 30.0

        async def abort(self, code, details):
            raise AssertionError(f"{code}: {details}")

    calls = [
        asyncio.ensure_future(router.Encode(encoder_pb2.EncodeRequest(items=[hot]), Ctx())) for _ in range(concurrent)
    ]
    for _ in range(200):
        await asyncio.sleep(0.01)
        if sum(e.seen for e in encoders) == concurrent:
            break
    seen = {a: e.seen for a, e in zip(addrs, encoders)}
    gate.set()
    replies = await asyncio.gather(*calls)
    assert all(r.items[0].num_tokens == 1 for r in replies)
    assert sum(router.inflight.values()) == 0  # every count returned
    await router.close()
    for s in servers:
        await s.stop(None)
    return {"owner": seen[owner], "others": sum(seen.values()) - seen[owner]}, router.diversions


def test_a_hot_item_spreads_past_the_bound():
    seen, diverted = asyncio.run(_scenario(1.25, 12))
    # 12 in flight over 3 encoders, c = 1.25: the owner takes at most ceil(1.25 x 12 / 3) = 5
    assert seen["owner"] <= 5 and seen["others"] == 12 - seen["owner"] and diverted == seen["others"], seen


def test_light_load_and_factor_zero_keep_the_owner():
    assert asyncio.run(_scenario(1.25, 1)) == ({"owner": 1, "others": 0}, 0)
    assert asyncio.run(_scenario(0.0, 12)) == ({"owner": 12, "others": 0}, 0)


def test_diversions_are_on_the_routers_metrics():
    from mimo_epd.router.config import LLMRouterConfig
    from mimo_epd.router.llm import LLMRouter

    async def main():
        ring = EncoderRouter([], RouterConfig())
        ring.diversions = 7
        router = LLMRouter(LLMRouterConfig(model="tiny-random"), encoders=ring)
        text = router.metrics.render().decode()
        await router.close()
        await ring.close()
        return text

    assert "router_encoder_diversions 7.0" in asyncio.run(main())
