"""Which URLs the encoder may fetch (SSRF protection).

By default only http(s) URLs whose every resolved address is globally routable are fetched:
loopback, private (RFC 1918, ULA), link-local, carrier-grade NAT, multicast, reserved, unspecified
and cloud-metadata addresses are refused. `--allow-private-urls` lifts the address rule;
`--url-allowlist` allows chosen networks only (e.g. `127.0.0.1/32` for a local media server).

Checks happen (1) on the URL before any connection (IP literals are refused without connecting),
(2) on every redirect target (redirects are followed by hand), and (3) on the addresses DNS returns,
inside the connector's resolver, so the address actually connected to is the one that was checked
(no DNS-rebinding window between check and connect).
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver

from ..errors import denied, invalid

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Instance-metadata endpoints of the large clouds; refused even with --allow-private-urls.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean
    "169.254.170.2",  # AWS ECS task metadata
    "fd00:ec2::254",  # AWS IPv6
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud
))
METADATA_HOSTNAMES = frozenset({"metadata.google.internal", "metadata", "instance-data"})


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


@dataclass
class UrlPolicy:
    allow_private: bool = False
    allowlist: list[Network] = field(default_factory=list)
    schemes: tuple[str, ...] = ("http", "https")

    def check_address(self, addr: str | IPAddress, what: str) -> None:
        ip = ipaddress.ip_address(addr) if isinstance(addr, str) else addr
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in net for net in self.allowlist):
            return
        if ip in METADATA_ADDRESSES:
            raise denied(f"URL refused by policy: {what} is a cloud metadata address ({ip})")
        if self.allow_private:
            return
        if not ip.is_global or ip.is_multicast:
            kind = ("loopback" if ip.is_loopback else "link-local" if ip.is_link_local else
                    "private" if ip.is_private else "non-public")
            raise denied(f"URL refused by policy: {what} resolves to a {kind} address ({ip}); "
                         "use --url-allowlist or --allow-private-urls to allow it")

    def check_url(self, url: str) -> None:
        """Checks scheme and host of a URL without any network access."""
        try:
            parts = urlsplit(url)
            host = parts.hostname
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError as e:
            raise invalid(f"malformed URL {url!r}: {e}") from None
        if parts.scheme.lower() not in self.schemes:
            raise invalid(f"unsupported URL scheme {parts.scheme!r} (allowed: {', '.join(self.schemes)}, data)")
        if not host:
            raise invalid(f"URL {url!r} has no host")
        if parts.username or parts.password:
            raise denied("URL refused by policy: URLs with credentials are not fetched")
        if host.lower().rstrip(".") in METADATA_HOSTNAMES:
            raise denied(f"URL refused by policy: {host} is a cloud metadata host")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return  # a name: checked on resolution by PolicyResolver
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
