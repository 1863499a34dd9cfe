"""One Mooncake transfer engine with one buffer registered once, carved into ranges: what moves media embeddings
between an encoder (its staging buffer, the source) and an LLM worker (its receive buffer, the destination).

- `RangeAllocator`: first fit over [0, size) with adjacent free ranges merged on free. Ranges are aligned to
  `ALIGN` bytes (rows of any dtype start aligned). `alloc(n)` returns an offset or None (no free range of n bytes:
  the caller falls back to gRPC bytes; nothing waits for room).
- `TransferBuffer`: `initialize(host, "P2PHANDSHAKE", protocol, device)` as the KV transfer does (no metadata server;
  a peer names this engine by `session` = host:rpc_port), a numpy buffer of `size` bytes registered with it (its
  pages are touched only where rows are written), and `write(session, srcs, dsts, lens)`: one blocking
  `batch_transfer_sync_write` of (local offset -> peer address) entries. A failed write raises `TransferError`.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading

import numpy as np

log = logging.getLogger(__name__)

ALIGN = 256


class TransferError(RuntimeError):
    """A write to a peer failed (it is gone, or the address is outside what it registered)."""


def reachable_host(host: str) -> str:
    """`host`, or this machine's name's address for a wildcard listen address (peers need a name they can reach)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostbyname(socket.gethostname())
    return host


class RangeAllocator:
    """First-fit ranges of a `size`-byte region; thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self._starts = [0]  # free ranges, sorted by start, never adjacent
        self._lens = [size]
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        n = max(ALIGN, -(-n // ALIGN) * ALIGN)
        with self._lock:
            for i, (s, ln) in enumerate(zip(self._starts, self._lens)):
                if ln >= n:
                    if ln == n:
                        del self._starts[i], self._lens[i]
                    else:
                        self._starts[i], self._lens[i] = s + n, ln - n
                    self._used[s] = n
                    return s
        return None

    def free(self, off: int) -> None:
        with self._lock:
            n = self._used.pop(off)
            i = bisect.bisect(self._starts, off)
            if i > 0 and self._starts[i - 1] + self._lens[i - 1] == off:  # merge with the range before
                i -= 1
                self._lens[i] += n
            else:
                self._starts.insert(i, off)
                self._lens.insert(i, n)
            if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:  # and after
                self._lens[i] += self._lens.pop(i + 1)
                del self._starts[i + 1]

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())


def engine_class():
    """Mooncake's `TransferEngine` class (RuntimeError naming the wheel when it is missing)."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise RuntimeError(
            "the Mooncake transfer engine is not installed (pip install mooncake-transfer-engine-non-cuda; "
            f"it needs the system library libibverbs1): {e}"
        ) from None
    return TransferEngine


class TransferBuffer:
    """A transfer engine and `size` registered bytes (see the module docstring)."""

    def __init__(self, size: int, host: str = "127.0.0.1", protocol: str = "tcp", device: str = ""):
        host = reachable_host(host)
        for attempt in range(3):  # its RPC port is picked free, then bound: another process may take it between
            self.engine = engine_class()()
            rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
            if rc == 0:
                break
            log.warning(
                "the Mooncake transfer engine did not start on %s (code %d, try %d of 3)", host, rc, attempt + 1
            )
        else:
            raise RuntimeError(f"the Mooncake transfer engine did not start on {host} ({protocol}): code {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.buf = np.empty(size, dtype=np.uint8)
        self.base = int(self.buf.ctypes.data)
        if self.engine.register_memory(self.base, size) != 0:
            raise RuntimeError(f"the Mooncake transfer engine refused to register {size} bytes")
        self.ranges = RangeAllocator(size)
        log.info("transfer engine %s (%s): %d MiB registered", self.session, protocol, size >> 20)

    def view(self, off: int, n: int) -> np.ndarray:
        return self.buf[off : off + n]

    def write(self, session: str, offsets: list[int], dsts: list[int], lens: list[int]) -> int:
        """Writes local ranges to a peer's addresses (blocking); returns the bytes moved. Raises TransferError."""
        if not lens:
            return 0
        rc = self.engine.batch_transfer_sync_write(session, [self.base + o for o in offsets], dsts, lens)
        if rc != 0:
            raise TransferError(f"the write to {session} failed (Mooncake code {rc}): the peer is gone or refused it")
        return sum(lens)

    def close(self) -> None:
        self.engine.unregister_memory(self.base)
