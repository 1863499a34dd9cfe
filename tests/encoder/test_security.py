"""The URL policy through the real gRPC server: every spelling of a refused address is refused with
PERMISSION_DENIED, and the loopback media server the spelling points at never sees a request.

The server runs with the default policy (no allowlist). The spellings are ones aiohttp/yarl normalise
or the C library maps onto loopback / link-local / metadata addresses: fullwidth digits and ideographic
dots (IDNA turns them into a plain IP literal), IPv6 forms carrying an IPv4 address, site-local IPv6,
and legacy numeric IPv4 (`2130706433`, `0177.0.0.1`, `127.1`).
"""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest

from encoder_server.fetch.client import PolicyConnector
from encoder_server.fetch.url_policy import UrlPolicy, parse_networks
from mimo_epd.v1 import encoder_pb2 as pb
from tests.conftest import encode_image, start_server, textured
from tests.encoder.media import MediaServer
from tests.integration.test_encoder_server import encode, expect_error

pytestmark = pytest.mark.integration

JPEG = encode_image(textured(120, 160, seed=11), "JPEG")


@pytest.fixture(scope="module")
def media():
    m = MediaServer({"photo.jpg": JPEG}).start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def server():
    s = start_server(["--decode-workers", "0", "--fetch-timeout-s", "3"])
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines)[-2000:]


SPELLINGS = [
    ("fullwidth-digits", "http://１２７.０.０.１:{port}/photo.jpg", "loopback"),
    ("ideographic-dots", "http://127。0。0。1:{port}/photo.jpg", "loopback"),
    ("fullwidth-metadata", "http://１６９.２５４.１６９.２５４:{port}/latest", "metadata"),
    ("ideographic-metadata", "http://169。254。169。254:{port}/latest", "metadata"),
    ("ipv4-compatible", "http://[::7f00:1]:{port}/photo.jpg", "127.0.0.1"),
    ("ipv4-translated", "http://[::ffff:0:7f00:1]:{port}/photo.jpg", "127.0.0.1"),
    ("ipv4-mapped-hex", "http://[::ffff:7f00:1]:{port}/photo.jpg", "127.0.0.1"),
    ("nat64-loopback", "http://[64:ff9b::7f00:1]:{port}/photo.jpg", "127.0.0.1"),
    ("nat64-metadata", "http://[64:ff9b::a9fe:a9fe]:{port}/latest", "metadata"),
    ("6to4-loopback", "http://[2002:7f00:1::]:{port}/photo.jpg", "127.0.0.1"),
    ("site-local", "http://[fec0::1]:{port}/photo.jpg", "site-local"),
    ("decimal-ipv4", "http://2130706433:{port}/photo.jpg", "non-canonical"),
    ("octal-ipv4", "http://0177.0.0.1:{port}/photo.jpg", "non-canonical"),
    ("short-ipv4", "http://127.1:{port}/photo.jpg", "non-canonical"),
    ("hex-ipv4", "http://0x7f.0.0.1:{port}/photo.jpg", "non-canonical"),
    ("trailing-dot", "http://127.0.0.1.:{port}/photo.jpg", "loopback"),
]


@pytest.mark.parametrize("name,url,fragment", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_every_spelling_of_a_refused_address_is_refused_before_any_request(server, media, name, url, fragment):
    before = media.total_hits
    details = expect_error(
        server.address,
        grpc.StatusCode.PERMISSION_DENIED,
        "refused by policy",
        pb.MediaItem(url=url.format(port=media.port)),
    )
    assert fragment in details, details
    assert details.startswith("item 0: ")
    assert media.total_hits == before == 0, "the loopback media server was reached"


def test_server_keeps_serving_after_refusals(server, media):
    assert encode(server.address, pb.MediaItem(data=JPEG)).items[0].num_tokens > 0
    assert media.total_hits == 0


# ----------------------------------------------------------------------------------- the socket layer
async def _get(policy: UrlPolicy, url: str) -> int:
    async with aiohttp.ClientSession(connector=PolicyConnector(policy)) as session:
        async with session.get(url) as resp:
            return resp.status


def test_connector_refuses_the_connected_address_whatever_resolved_it(media):
    """The structural guarantee on its own: no URL check and no policy resolver, only the connector.
    A name (`localhost`) and an IP literal reaching loopback are both refused at the socket."""
    for url in (f"http://127.0.0.1:{media.port}/photo.jpg", f"http://localhost:{media.port}/photo.jpg"):
        with pytest.raises(aiohttp.ClientConnectorError) as ei:
            asyncio.run(_get(UrlPolicy(), url))
        assert "refused by policy" in str(ei.value), ei.value
    assert media.total_hits == 0
    # The same connector with loopback allowed connects: the refusal above was the policy's.
    allowed = UrlPolicy(allowlist=parse_networks("127.0.0.0/8,::1"))
    assert asyncio.run(_get(allowed, f"http://127.0.0.1:{media.port}/photo.jpg")) == 200
    assert media.hits["photo.jpg"] == 1
    media.hits.clear()
