"""A joined node's health service (`serve --join`, mimo_epd/launcher/node.py `report_children`): SERVING while
every child runs, NOT_SERVING while one is down, SERVING again once it is back — what the container's probes
ask on --host:--port."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mimo_epd.common.grpc_server import GrpcServer
from mimo_epd.launcher.node import report_children


class Child:
    def __init__(self):
        self.running = True


async def status(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_health_follows_the_children():
    srv = GrpcServer("127.0.0.1", 0, 4)
    await srv.start()
    children = [Child(), Child()]
    task = asyncio.create_task(report_children(srv, children, interval_s=0.05))
    try:
        await asyncio.sleep(0.2)
        assert await status(srv.address) == "SERVING"
        children[1].running = False  # a child died (its node restarts it)
        await asyncio.sleep(0.2)
        assert await status(srv.address) == "NOT_SERVING"
        children[1].running = True
        await asyncio.sleep(0.2)
        assert await status(srv.address) == "SERVING"
    finally:
        task.cancel()
        await srv.stop(0)
