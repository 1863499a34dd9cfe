"""Consistent hashing with virtual nodes: which encoder owns a media item.

Each endpoint is placed on a 64-bit ring at `vnodes` pseudo-random points (xxh3-64 of "endpoint#i");
an item belongs to the first point clockwise of its own hash. When an endpoint leaves, only the items
it owned move (to the next endpoints clockwise, spread over all the others thanks to the virtual
nodes): about 1/N of all items. When it comes back, exactly those items return to it.

`owners(key)` lists every endpoint in the order a request should try them, so a dead owner's items
go to the next live one without rebuilding the ring.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Iterator

import xxhash


def _h64(data: bytes | str) -> int:
    return xxhash.xxh3_64_intdigest(data.encode() if isinstance(data, str) else data)


class HashRing:
    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 160):
        if vnodes <= 0:
            raise ValueError(f"vnodes must be positive, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._nodes: set[str] = set()
        for n in nodes:
            self.add(n)

    @property
    def nodes(self) -> set[str]:
        return set(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, node: str) -> None:
        if node in self._nodes:
            return
        self._nodes.add(node)
        for i in range(self.vnodes):
            p = _h64(f"{node}#{i}")
            at = bisect.bisect_left(self._points, p)
            self._points.insert(at, p)
            self._owners.insert(at, node)

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def owners(self, key: bytes | str) -> Iterator[str]:
        """Every node once, clockwise from the key: the owner first, then the failover order."""
        if not self._points:
            return
        start = bisect.bisect_right(self._points, _h64(key)) % len(self._points)
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            o = self._owners[(start + i) % n]
            if o not in seen:
                seen.add(o)
                yield o
                if len(seen) == len(self._nodes):
                    return

    def owner(self, key: bytes | str, alive: set[str] | None = None) -> str | None:
        """The first node clockwise that is in `alive` (every node when `alive` is None)."""
        for o in self.owners(key):
            if alive is None or o in alive:
                return o
        return None
