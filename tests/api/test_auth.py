"""API keys on a real worker and a real router in front of it: every HTTP endpoint but /health refuses no key and
a wrong key (401, OpenAI error shape) and serves the right one; gRPC Generate refuses a call without the key
(UNAUTHENTICATED) while health stays open; the router sends its internal key to the worker, so a client with the
router's public key is served through the router and refused by the worker's port reached directly."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mimo_epd.v1 import generator_pb2, generator_pb2_grpc
from tests.conftest import start_server

pytestmark = pytest.mark.integration

WORKER_KEY, INTERNAL, PUBLIC = "worker-key", "internal-key", "public-key"
GET = ["/v1/models", "/v1/models/tiny-random", "/metrics", "/get_server_info", "/server_info", "/model_info"]
POST = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}


@pytest.fixture(scope="module")
def keyed():
    worker = start_server(
        ["--model", "tiny-random", "--http-port", "0", "--api-key", WORKER_KEY, "--internal-api-key", INTERNAL],
        subcommand="llm",
    )
    os.environ["MIMO_EPD_API_KEY"] = PUBLIC  # the router takes its public key from the environment
    try:
        router = start_server(
            [
                *("--workers", f"{worker.address}/{worker.http_address}", "--http-port", "0"),
                *("--model", "tiny-random", "--internal-api-key", INTERNAL),
            ],
            "router",
        )
    finally:
        del os.environ["MIMO_EPD_API_KEY"]
    yield worker, router
    assert router.stop() == 0
    assert worker.stop() == 0


def call(address: str, path: str, key: str | None) -> tuple[int, bytes]:
    body = POST.get(path)
    req = urllib.request.Request(
        f"http://{address}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("path", GET + list(POST))
def test_every_http_endpoint_wants_the_key(keyed, path):
    worker, router = keyed
    for address, good in ((worker.http_address, [WORKER_KEY, INTERNAL]), (router.http_address, [PUBLIC])):
        for key in (None, "wrong"):
            status, body = call(address, path, key)
            assert status == 401, (address, path, key, status)
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
        for key in good:
            status, body = call(address, path, key)
            assert status == 200, (address, path, key, status, body[:200])
    assert call(worker.http_address, path, PUBLIC)[0] == 401  # the router's public key is no key for the worker


def test_health_stays_open(keyed):
    for s in keyed:
        assert call(s.http_address, "/health", None)[0] == 200


def test_grpc_generate_wants_the_key(keyed):
    worker, router = keyed
    req = generator_pb2.GenerateRequest(prompt="hi", sampling=generator_pb2.SamplingOptions(max_tokens=1))
    for address, key in ((worker.address, WORKER_KEY), (router.address, PUBLIC)):
        with grpc.insecure_channel(address) as ch:
            stub = generator_pb2_grpc.GeneratorStub(ch)
            for md in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(req, timeout=30, metadata=md))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            try:
                out = list(stub.Generate(req, timeout=60, metadata=(("authorization", f"Bearer {key}"),)))
            except grpc.RpcError as err:
                raise AssertionError((address, err.details(), router.stderr_lines[-5:])) from None
            assert out, address
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_on_http_and_grpc(tmp_path):
    """--tls-cert/--tls-key: the HTTP site and the gRPC port speak TLS with that certificate (self-signed here)."""
    import asyncio
    import shutil
    import ssl
    import subprocess

    import aiohttp
    from aiohttp import web

    from mimo_epd.common.auth import AuthConfig, ssl_context
    from mimo_epd.common.grpc_server import GrpcServer
    from mimo_epd.common.http_server import EdgeConfig, edge_app, start_site

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    cfg = AuthConfig(api_key="k", tls_cert=str(cert), tls_key=str(key)).resolved()

    async def ok(request):
        return web.json_response({"ok": True})

    async def go():
        app = edge_app(EdgeConfig(), [], keys=cfg.keys)
        app.router.add_get("/v1/models", ok)
        runner, port = await start_site(app, "127.0.0.1", 0, EdgeConfig(), ssl_context(cfg))
        srv = GrpcServer("127.0.0.1", 0, 16, auth=cfg)
        gport = await srv.start()
        try:
            client = ssl.create_default_context(cafile=str(cert))
            async with aiohttp.ClientSession() as s:
                async with s.get(
                    f"https://localhost:{port}/v1/models", ssl=client, headers={"Authorization": "Bearer k"}
                ) as r:
                    status = r.status
                with pytest.raises(aiohttp.ClientError):  # plain HTTP to a TLS port
                    await s.get(f"http://127.0.0.1:{port}/v1/models")
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{gport}", creds) as ch:
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return status, h.status
        finally:
            await srv.stop(0)
            await runner.cleanup()

    status, health = asyncio.run(go())
    assert status == 200 and health == health_pb2.HealthCheckResponse.SERVING


def test_serve_with_a_key_guards_the_front_and_its_workers():
    """`serve --api-key`: the front wants the key and forwards with the node's own (random) internal key; the
    node's gRPC Generate wants the key too."""
    s = start_server(
        ["--http-port", "0", "--llm-kv-cache-tokens", "6000", "--llm-swa-cache-tokens", "1500", "--api-key", PUBLIC],
        subcommand="serve",
        timeout=300,
    )
    try:
        for path in ("/v1/models", "/v1/chat/completions"):
            assert call(s.http_address, path, None)[0] == 401
            status, body = call(s.http_address, path, PUBLIC)
            assert status == 200, (path, body[:300])
        assert call(s.http_address, "/health", None)[0] == 200
        req = generator_pb2.GenerateRequest(prompt="hi", sampling=generator_pb2.SamplingOptions(max_tokens=1))
        with grpc.insecure_channel(s.address) as ch:
            stub = generator_pb2_grpc.GeneratorStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert list(stub.Generate(req, timeout=60, metadata=(("authorization", f"Bearer {PUBLIC}"),)))
    finally:
        assert s.stop() == 0
