"""Which URLs the encoder may fetch (SSRF protection).

By default only http(s) URLs whose every address is globally routable are fetched: loopback, private
(RFC 1918, ULA), link-local, site-local, carrier-grade NAT, multicast, reserved, unspecified and
cloud-metadata addresses are refused, and so are IPv6 addresses that carry one of those IPv4 addresses
inside them (IPv4-compatible, mapped, translated, NAT64, 6to4, Teredo). `--allow-private-urls` lifts the
address rule (metadata addresses stay refused); `--url-allowlist` allows chosen networks only (e.g.
`127.0.0.1/32` for a local media server).

Checks happen in three layers, each on the address the HTTP client will really use:
1. on the URL before any connection (`check_url`): the host is normalised exactly as the HTTP client
   normalises it (yarl: IDNA, so fullwidth digits and ideographic dots become the plain IP literal they
   are), IP literals are checked, and legacy numeric IPv4 spellings (`2130706433`, `0177.0.0.1`, `127.1`)
   are refused outright;
2. on every address DNS returns, inside the connector's resolver (`PolicyResolver`), so a name is
   refused as a whole if any of its addresses is;
3. structurally, on the socket itself (`PolicyConnector` in client.py): every socket the client opens
   is checked against `check_address` before it connects and its peer address again once connected,
   so no spelling, resolver path or redirect can reach an address this policy refuses.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from mimo_epd.common.redact import redact_url

from ..errors import denied, invalid

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Instance-metadata endpoints of the large clouds; refused even with --allow-private-urls.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean
        "169.254.170.2",  # AWS ECS task metadata
        "fd00:ec2::254",  # AWS IPv6
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud
    )
)
METADATA_HOSTNAMES = frozenset({"metadata.google.internal", "metadata", "instance-data"})

_net = ipaddress.ip_network
# IPv6 ranges whose low 32 bits are an IPv4 address the packet ends up at (or is treated as).
_LOW32_EMBEDDING = (
    (_net("::ffff:0:0/96"), "IPv4-mapped"),
    (_net("::ffff:0:0:0/96"), "IPv4-translated"),
    (_net("64:ff9b::/96"), "NAT64"),
    (_net("::/96"), "IPv4-compatible"),
)
_LOCAL_NAT64 = _net("64:ff9b:1::/48")  # RFC 8215 local-use NAT64: the IPv4 position depends on the site's prefix
_SIX_TO_FOUR = _net("2002::/16")
_TEREDO = _net("2001::/32")
_SITE_LOCAL = _net("fec0::/10")  # deprecated (RFC 3879) but still routed inside sites

# Characters of a legacy numeric IPv4 spelling (decimal, octal, hex parts; 1 to 4 of them).
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?$", re.I)


def parse_networks(spec: str | list[str] | None) -> list[Network]:
    """'127.0.0.1/32, ::1' -> networks. A bare address is a /32 (or /128)."""
    if not spec:
        return []
    items = spec.split(",") if isinstance(spec, str) else spec
    out = []
    for item in items:
        item = item.strip()
        if item:
            try:
                out.append(ipaddress.ip_network(item, strict=False))
            except ValueError as e:
                raise ValueError(f"--url-allowlist: {item!r} is not an IP address or network ({e})") from None
    return out


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    """IPv4 addresses an IPv6 address carries (and may be delivered to), with the mechanism's name."""
    out = []
    for net, name in _LOW32_EMBEDDING:
        if ip in net:
            out.append((ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), name))
            break
    if ip in _SIX_TO_FOUR:
        out.append((ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF), "6to4"))
    if ip in _TEREDO:
        server, client = ip.teredo
        out += [(server, "Teredo server"), (client, "Teredo client")]
    return out


def legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The address a non-canonical numeric IPv4 spelling means to the C library (inet_aton), else None.

    `2130706433`, `0x7f.1`, `0177.0.0.1` and `127.1` all mean 127.0.0.1 to inet_aton/getaddrinfo."""
    if not _NUMERIC_HOST.match(host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host.rstrip(".")))
    except (OSError, ValueError):
        return None


def url_host(url: str) -> str:
    """The host of `url` exactly as the HTTP client (aiohttp, through yarl) will connect to it."""
    host = URL(url).raw_host
    if not host:
        raise ValueError("no host")
    return host


@dataclass
class UrlPolicy:
    allow_private: bool = False
    allowlist: list[Network] = field(default_factory=list)
    schemes: tuple[str, ...] = ("http", "https")

    def refusal(self, addr: str | IPAddress, what: str) -> str | None:
        """Why `addr` may not be connected to (a message naming `what`), or None when it may."""
        ip = ipaddress.ip_address(addr) if isinstance(addr, str) else addr
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            ip = ipaddress.IPv6Address(ip.compressed.split("%")[0])  # fe80::1%eth0: the zone is no address
        if any(ip.version == net.version and ip in net for net in self.allowlist):
            return None
        if ip in METADATA_ADDRESSES:
            return f"URL refused by policy: {what} is a cloud metadata address ({ip})"
        if isinstance(ip, ipaddress.IPv6Address):
            if ip in _LOCAL_NAT64 and not self.allow_private:
                return f"URL refused by policy: {what} is a local-use NAT64 address ({ip})"
            inner = (
                [] if ip in _LOW32_EMBEDDING[-1][0] and int(ip) <= 1 else embedded_ipv4(ip)
            )  # :: and ::1 are themselves
            for v4, name in inner:
                why = self.refusal(v4, f"{what} ({ip}, {name} for {v4})")
                if why:
                    return why
            if inner and ip not in _TEREDO:
                return None  # the embedded IPv4 address is where it goes, and it is allowed
        if self.allow_private:
            return None
        site_local = isinstance(ip, ipaddress.IPv6Address) and ip in _SITE_LOCAL
        if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified or site_local:
            kind = (
                "loopback"
                if ip.is_loopback
                else "link-local"
                if ip.is_link_local
                else "site-local"
                if site_local
                else "multicast"
                if ip.is_multicast
                else "unspecified"
                if ip.is_unspecified
                else "private"
                if ip.is_private
                else "non-public"
            )
            article = "an" if kind[0] in "aeiou" else "a"
            return (
                f"URL refused by policy: {what} resolves to {article} {kind} address ({ip}); "
                "use --url-allowlist or --allow-private-urls to allow it"
            )
        return None

    def check_address(self, addr: str | IPAddress, what: str) -> None:
        why = self.refusal(addr, what)
        if why:
            raise denied(why)

    def check_url(self, url: str) -> None:
        """Checks scheme and host of a URL without any network access."""
        try:
            parsed = URL(url)
            host = parsed.raw_host
            parsed.explicit_port  # noqa: B018 - raises on a malformed port
        except (ValueError, TypeError, UnicodeError) as e:
            raise invalid(f"malformed URL {redact_url(url)!r}: {redact_url(str(e))}") from None
        if parsed.scheme.lower() not in self.schemes:
            raise invalid(f"unsupported URL scheme {parsed.scheme!r} (allowed: {', '.join(self.schemes)}, data)")
        if not host:
            raise invalid(f"URL {redact_url(url)!r} has no host")
        if "%" in host:  # DNS would be asked for a name no host has: the client's mistake, not a 503
            raise invalid(f"URL {redact_url(url)!r}: the host {host[:64]!r} is percent-encoded; write it plainly")
        if parsed.user or parsed.password:
            raise denied("URL refused by policy: URLs with credentials are not fetched")
        name = host.lower().rstrip(".")
        if name in METADATA_HOSTNAMES:
            raise denied(f"URL refused by policy: {host} is a cloud metadata host")
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            legacy = legacy_ipv4(name)
            if legacy is not None:
                raise denied(
                    f"URL refused by policy: host {host} is a non-canonical spelling of the IPv4 address "
                    f"{legacy}; write it as a dotted quad"
                ) from None
            return  # a name: checked on resolution by PolicyResolver, and on the socket by PolicyConnector
        self.check_address(ip, f"host {host}")


class PolicyResolver(AbstractResolver):
    """DNS resolver for the fetch session that refuses names resolving to disallowed addresses.

    A name with any disallowed address is refused as a whole (a mixed answer is a classic rebinding trick).
    """

    def __init__(self, policy: UrlPolicy):
        self.policy = policy
        self._inner = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        results = await self._inner.resolve(host, port, family)
        for r in results:
            self.policy.check_address(r["host"], f"host {host}")
        return results

    async def close(self) -> None:
        await self._inner.close()
