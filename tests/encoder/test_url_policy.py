"""URL policy decisions, made without any network access."""

import asyncio

import grpc
import pytest

from encoder_server.errors import ItemError
from encoder_server.fetch import parse_data_uri
from encoder_server.fetch.url_policy import PolicyResolver, UrlPolicy, parse_networks

REFUSED = [
    "http://127.0.0.1/a",
    "http://127.8.9.10/a",
    "http://10.0.0.1/a",
    "http://172.16.5.4/a",
    "http://192.168.0.1/a",
    "http://169.254.169.254/latest",
    "http://169.254.1.1/",
    "http://[::1]/a",
    "http://[fe80::1]/a",
    "http://[fd00::1]/a",
    "http://[::ffff:10.0.0.1]/a",
    "http://0.0.0.0/a",
    "http://100.64.0.1/a",
    "http://224.0.0.1/a",
    "http://metadata.google.internal/",
    # spellings the HTTP client normalises (IDNA) into a loopback / metadata literal
    "http://１２７.０.０.１:8080/a",
    "http://127。0。0。1/a",
    "http://１６９.２５４.１６９.２５４/",
    "http://127.0.0.1./a",
    # IPv6 forms carrying a refused IPv4 address, and site-local IPv6
    "http://[::7f00:1]/a",
    "http://[::ffff:0:7f00:1]/a",
    "http://[64:ff9b::7f00:1]/a",
    "http://[64:ff9b::a9fe:a9fe]/a",
    "http://[2002:7f00:1::]/a",
    "http://[2002:a9fe:a9fe::1]/a",
    "http://[fec0::1]/a",
    "http://[64:ff9b:1::a00:1]/a",
    "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/a",
    # legacy numeric IPv4 (inet_aton): refused outright, never retried as UNAVAILABLE
    "http://2130706433/a",
    "http://0177.0.0.1/a",
    "http://127.1/a",
    "http://0x7f.1/a",
    "http://0x7f000001/a",
]


@pytest.mark.parametrize("url", REFUSED)
def test_private_and_metadata_refused_by_default(url):
    with pytest.raises(ItemError) as ei:
        UrlPolicy().check_url(url)
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "refused by policy" in str(ei.value)


def test_public_literal_allowed():
    UrlPolicy().check_url("http://93.184.216.34/x.jpg")
    # IPv6 forms of a public IPv4 address are decided by that address
    for host in ("[::ffff:93.184.216.34]", "[64:ff9b::5db8:d822]", "[2002:5db8:d822::1]", "[2606:4700::1111]"):
        UrlPolicy().check_url(f"http://{host}/x.jpg")
    UrlPolicy().check_url("https://example.com/x.jpg")  # a name: decided at resolution


def test_allowlist_and_allow_private():
    p = UrlPolicy(allowlist=parse_networks("127.0.0.1/32, ::1"))
    p.check_url("http://127.0.0.1:8080/x")
    p.check_url("http://[::1]/x")
    with pytest.raises(ItemError):
        p.check_url("http://127.0.0.2/x")
    p.check_url("http://[::ffff:127.0.0.1]/x")  # the embedded address is the allowlisted one
    lax = UrlPolicy(allow_private=True)
    lax.check_url("http://10.1.2.3/x")
    lax.check_url("http://[::7f00:1]/x")
    for metadata in ("http://169.254.169.254/", "http://[64:ff9b::a9fe:a9fe]/", "http://１６９.２５４.１６９.２５４/"):
        with pytest.raises(ItemError, match="metadata"):  # metadata stays refused, however it is spelled
            lax.check_url(metadata)


def test_embedded_ipv4_and_legacy_spellings():
    from ipaddress import IPv4Address, IPv6Address

    from encoder_server.fetch.url_policy import embedded_ipv4, legacy_ipv4

    lo = IPv4Address("127.0.0.1")
    assert embedded_ipv4(IPv6Address("64:ff9b::7f00:1")) == [(lo, "NAT64")]
    assert embedded_ipv4(IPv6Address("2002:7f00:1::")) == [(lo, "6to4")]
    assert embedded_ipv4(IPv6Address("::ffff:0:7f00:1")) == [(lo, "IPv4-translated")]
    assert embedded_ipv4(IPv6Address("2606:4700::1111")) == []
    for spelling in ("2130706433", "0177.0.0.1", "127.1", "0x7f.0.0.1", "017700000001"):
        assert legacy_ipv4(spelling) == lo, spelling
    for name in ("example.com", "1e100.net", "123.example", "deadbeef"):
        assert legacy_ipv4(name) is None, name


@pytest.mark.parametrize(
    "url,fragment",
    [
        ("ftp://host/x", "scheme"),
        ("file:///etc/passwd", "scheme"),
        ("http:///nohost", "no host"),
        ("http://u:p@example.com/", "credentials"),
        ("http://example.com:99999/", "malformed"),
    ],
)
def test_malformed_urls(url, fragment):
    with pytest.raises(ItemError, match=fragment):
        UrlPolicy().check_url(url)


def test_resolver_refuses_names_resolving_to_private_addresses():
    async def go():
        r = PolicyResolver(UrlPolicy())
        try:
            with pytest.raises(ItemError, match="loopback"):
                await r.resolve("localhost", 80)
        finally:
            await r.close()
        ok = PolicyResolver(UrlPolicy(allowlist=parse_networks("127.0.0.0/8,::1")))
        try:
            assert (await ok.resolve("localhost", 80))[0]["host"] in ("127.0.0.1", "::1")
        finally:
            await ok.close()

    asyncio.run(go())


def test_bad_allowlist_entry():
    with pytest.raises(ValueError, match="not an IP"):
        parse_networks("not-an-ip")


def test_data_uri_parsing():
    assert parse_data_uri("data:image/png;base64,aGVsbG8=", 100) == b"hello"
    assert parse_data_uri("data:,hi%20there", 100) == b"hi there"
    with pytest.raises(ItemError, match="base64"):
        parse_data_uri("data:image/png;base64,@@@", 100)
    with pytest.raises(ItemError, match="larger than"):
        parse_data_uri("data:;base64," + "QUFB" * 100, 10)
    with pytest.raises(ItemError, match="comma"):
        parse_data_uri("data:image/png;base64", 100)
