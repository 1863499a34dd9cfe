"""The shared graceful shutdown (`mimo_epd.common.grpc_server.Drain`) on a real aio server on a loopback port."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mimo_epd.common.grpc_server import add_health_and_reflection, new_server, set_serving
from mimo_epd.v1 import encoder_pb2 as pb
from mimo_epd.v1 import encoder_pb2_grpc, generator_pb2, generator_pb2_grpc


class SlowEncoder(encoder_pb2_grpc.EncoderServicer):
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def Encode(self, request, context):
        self.started.set()
        await self.release.wait()
        # A large response: the case where a connection closed right after the status lost the response's tail.
        return pb.EncodeResponse(model="x" * (8 << 20))


class SlowGenerator(generator_pb2_grpc.GeneratorServicer):
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        self.started.set()
        yield generator_pb2.GenerateResponse(delta=generator_pb2.TokenDelta(token_ids=[1]))
        await self.release.wait()
        yield generator_pb2.GenerateResponse(delta=generator_pb2.TokenDelta(token_ids=[2]))


async def _serve():
    server, drain = new_server(64)
    enc, gen = SlowEncoder(), SlowGenerator()
    encoder_pb2_grpc.add_EncoderServicer_to_server(enc, server)
    generator_pb2_grpc.add_GeneratorServicer_to_server(gen, server)
    health = add_health_and_reflection(server, ["mimo_epd.v1.Encoder"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await set_serving(health, ["mimo_epd.v1.Encoder"])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    return server, drain, health, enc, gen, channel


def test_in_flight_rpcs_finish_new_ones_are_refused_then_the_server_stops():
    async def main():
        server, drain, health, enc, gen, channel = await _serve()
        encode = asyncio.ensure_future(encoder_pb2_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(), timeout=30))
        stream = generator_pb2_grpc.GeneratorStub(channel).Generate(generator_pb2.GenerateRequest(), timeout=30)
        first = await stream.read()
        await enc.started.wait()
        assert drain.in_flight == 2 and first.delta.token_ids == [1]

        stopping = asyncio.ensure_future(drain.stop(server, health, grace_s=30))
        await asyncio.sleep(0.2)
        assert not stopping.done()
        check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered while draining
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await encoder_pb2_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()

        enc.release.set()
        gen.release.set()
        response = await encode
        assert len(response.model) == 8 << 20  # the whole response arrived
        assert (await stream.read()).delta.token_ids == [2]
        await asyncio.wait_for(stopping, 10)
        assert drain.in_flight == 0
        await channel.close()

    asyncio.run(main())


def test_grace_period_bounds_the_wait_and_cancelled_calls_are_not_waited_for():
    async def main():
        server, drain, health, enc, gen, channel = await _serve()
        call = encoder_pb2_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(), timeout=30)
        await enc.started.wait()
        call.cancel()  # the client goes away: its RPC stops counting
        for _ in range(100):
            if drain.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert drain.in_flight == 0

        stuck = asyncio.ensure_future(encoder_pb2_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(), timeout=30))
        for _ in range(100):
            if drain.in_flight == 1:
                break
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await drain.stop(server, health, grace_s=0.5)  # never released: cancelled when the grace period ends
        assert loop.time() - t0 < 5
        with pytest.raises(grpc.aio.AioRpcError):
            await stuck
        await channel.close()

    asyncio.run(main())
