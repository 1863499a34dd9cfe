"""The one way a server starts (`mimo_epd.common.grpc_server.GrpcServer`), the encoder router that starts with no
encoders, and the node's one supervisor (`mimo_epd.launcher.Supervisor`) with a switch per kind of child."""

from __future__ import annotations

import asyncio
import socket
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mimo_epd.common.grpc_server import GrpcServer, shown_host
from mimo_epd.launcher import ChildProcess, Supervisor
from mimo_epd.router.encoder import EncoderRouter, RouterConfig
from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6(), reason="no IPv6 loopback")
def test_the_ready_line_brackets_an_ipv6_host_and_that_address_answers(capsys):
    async def main():
        srv = GrpcServer("::1", 0, 16)
        srv.add(
            encoder_pb2_grpc.add_EncoderServicer_to_server, EncoderRouter([], RouterConfig()), "mimo_epd.v1.Encoder"
        )
        await srv.start()
        srv.announce()
        line = capsys.readouterr().out.strip()
        assert line == f"ready [::1]:{srv.port}"
        async with grpc.aio.insecure_channel(line.split()[1]) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await srv.stop(1.0)

    asyncio.run(main())
    assert shown_host("127.0.0.1") == "127.0.0.1" and shown_host("[::1]") == "[::1]"


def test_a_port_in_use_is_refused_with_the_address_and_the_reason():
    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            srv = GrpcServer("127.0.0.1", port, 16)
            with pytest.raises(OSError) as e:
                await srv.start()
            await srv.stop(0)
        return port, str(e.value)

    port, message = asyncio.run(main())
    assert message == f"cannot listen on 127.0.0.1:{port} (--host/--port): Address already in use"


def test_an_encoder_router_starts_with_no_encoders_and_follows_its_members():
    async def main():
        router = EncoderRouter([], RouterConfig())
        srv = GrpcServer("127.0.0.1", 0, 16)
        srv.add(encoder_pb2_grpc.add_EncoderServicer_to_server, router, "mimo_epd.v1.Encoder")
        await srv.start()
        item = encoder_pb2.MediaItem(url="https://example.com/a.png")
        async with grpc.aio.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await encoder_pb2_grpc.EncoderStub(ch).Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no live encoder" in e.value.details()
        router.add_endpoint("127.0.0.1:1")
        router.add_endpoint("127.0.0.1:2")
        assert router.endpoints == router.alive == router.ring.nodes == {"127.0.0.1:1", "127.0.0.1:2"}
        router.remove_endpoint("127.0.0.1:1")
        assert router.endpoints == router.alive == router.ring.nodes == {"127.0.0.1:2"}
        await router.close()
        await srv.stop(0)

    asyncio.run(main())


class _Sleeper(ChildProcess):
    """A child that is a plain `sleep` (the supervisor only waits on the process and calls start again)."""

    starts = 0

    async def start(self) -> None:
        self.starts += 1
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")


@pytest.mark.parametrize("restart_encoders, restart_llm", [(True, False), (False, True)])
def test_one_supervisor_restarts_each_kind_of_child_by_its_own_switch(restart_encoders, restart_llm):
    async def main():
        encoder, worker = _Sleeper(0, [], 5.0), _Sleeper(0, [], 5.0, subcommand="llm")
        await encoder.start()
        await worker.start()
        sup = Supervisor(lambda c: restart_llm if c.subcommand == "llm" else restart_encoders, delay_s=0.05)
        sup.watch([encoder, worker])
        for child in (encoder, worker):
            child.proc.kill()
        for _ in range(100):
            if encoder.starts + worker.starts == 3:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        sup.stop()
        out = (encoder.starts, worker.starts)
        for child in (encoder, worker):
            await child.stop(1.0)
        return out

    assert asyncio.run(main()) == (1 + restart_encoders, 1 + restart_llm)
