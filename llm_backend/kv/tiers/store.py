"""The shared KV tier (L3): content-addressed pages in a store every worker uses (Redis or Mooncake Store).

A page is `page_size` tokens starting at a multiple of it, named by the chained page hash of
`llm_backend.kv.events.block_hashes` (equal hashes = equal token prefixes), under a namespace that names the
model shape and dtype (two models never share a key). Its value holds the full-attention layers' KV of the page
and, when the page ends where a match may end, the sliding layers' KV of the W tokens before its end (a sliding
layer needs exactly those to go on from there); a page without that window is only a path to later pages.

Value layout: b"MKV1" | u32 header length | JSON header {hash, page, window, dtype, shapes} | u64 xxh3 checksum of
the payload | payload (every tensor's bytes, in header order). A value whose magic, hash, shapes, dtype, length or
checksum does not match is a miss (`corrupt` in the stats), never KV.

Every backend implements the `KVStore` protocol (`get_many`, `put`, `bind`, `flush`, `close`, `stats`, `up`).
The networked ones subclass `SharedKVStore`, which owns what they share: the page format, the writer thread
(writes are asynchronous: a bounded queue drained by one thread, a full queue drops the page, it is a cache), the
SET-NX rule (a page without its window is written only where the key is absent; one with it always), the
integrity check on every value read, the failure rule (any backend error marks the tier down for `retry_s`:
meanwhile lookups are misses and writes are dropped, so requests never fail because the store did; each error is
logged and counted) and the measured read / write seconds and per-page load latencies. A backend supplies
`_connect` (on the writer thread when it may block, `connect_in_background`: a store that is down at
start then never blocks the worker), `_read` (raw
values or None per key) and `_write(key, raw, replace)`. `open_store` picks the backend by URL scheme
(`redis_store.py`, `mooncake_store.py`); `MemoryKVStore` is the in-process one of the benchmarks.
"""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"MKV1"


@dataclass
class PageData:
    """One page: `full` = {layer: (k, v)} of its P tokens, `swa` = {layer: (k, v)} of the window before its end
    (empty: not a match end). In bookkeeping mode (the benchmark) both are empty and only `nbytes` is set."""

    hash: int
    full: dict = field(default_factory=dict)
    swa: dict = field(default_factory=dict)
    has_window: bool = False
    nbytes: int = 0
    stale: list[int] = field(default_factory=list)  # window rows whose MTP entries were never computed (kv/pools.py)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode_page(p: PageData) -> bytes:
    tensors, shapes = [], []
    dtype = None
    for part in ("full", "swa"):
        for layer in sorted(getattr(p, part)):
            k, v = getattr(p, part)[layer]
            for t in (k, v):
                dtype = str(t.dtype).removeprefix("torch.")
                tensors.append(_tensor_bytes(t))
                shapes.append([part, layer, list(t.shape)])
    payload = b"".join(tensors)
    header = json.dumps(
        {"hash": p.hash, "window": p.has_window, "dtype": dtype, "shapes": shapes, "stale": p.stale}
    ).encode()
    return (
        MAGIC + struct.pack("<I", len(header)) + header + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload)) + payload
    )


def decode_page(raw: bytes, want_hash: int, expect: dict, dtype: torch.dtype) -> PageData | None:
    """The page, or None when anything does not match what was asked for (`expect`: {(part, layer): shape})."""
    try:
        if raw[:4] != MAGIC:
            return None
        (hlen,) = struct.unpack_from("<I", raw, 4)
        header = json.loads(raw[8 : 8 + hlen])
        (checksum,) = struct.unpack_from("<Q", raw, 8 + hlen)
        payload = memoryview(raw)[16 + hlen :]
        if header["hash"] != want_hash or header["dtype"] != str(dtype).removeprefix("torch."):
            return None
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            return None
        esz = torch.empty(0, dtype=dtype).element_size()
        stale = header.get("stale", [])
        if not isinstance(stale, list) or not all(isinstance(i, int) and i >= 0 for i in stale):
            return None
        out = PageData(want_hash, has_window=bool(header["window"]), nbytes=len(raw), stale=stale)
        pos, pending = 0, {}
        for part, layer, shape in header["shapes"]:
            key = (part, layer)
            if key not in expect:
                return None
            want = expect[key][1 if key in pending else 0]  # (k shape, v shape): k comes first
            if part == "full" and list(shape) != list(want):
                return None
            if part == "swa" and (list(shape[1:]) != list(want[1:]) or shape[0] > want[0]):
                return None
            n = int(np.prod(shape)) * esz
            if pos + n > len(payload):
                return None
            t = torch.frombuffer(bytearray(payload[pos : pos + n]), dtype=torch.uint8).view(dtype).reshape(shape)
            pos += n
            if key in pending:
                getattr(out, part)[layer] = (pending.pop(key), t)
            else:
                pending[key] = t
        if pos != len(payload) or pending:
            return None
        full_layers = {layer for part, layer in expect if part == "full"}
        if set(out.full) != full_layers:
            return None
        if out.has_window and set(out.swa) != {layer for part, layer in expect if part == "swa"}:
            return None
        return out
    except (ValueError, KeyError, TypeError, struct.error, RuntimeError):
        return None


@dataclass
class StoreStats:
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    puts: int = 0
    dropped: int = 0  # writes dropped: queue full, the store full or down
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0  # seconds spent in reads (the store's calls, values decoded)
    write_s: float = 0.0  # seconds spent in writes (on the writer thread)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["read_s"], d["write_s"] = round(self.read_s, 6), round(self.write_s, 6)
        return d


@runtime_checkable
class KVStore(Protocol):
    """What the tiered cache needs of a shared page store."""

    stats: StoreStats

    @property
    def up(self) -> bool: ...

    def bind(self, expect: dict, dtype: torch.dtype) -> None:
        """The shapes ({(part, layer): (k shape, v shape)}) and dtype a valid page has (data mode)."""

    def get_many(self, hashes: list[int]) -> list[PageData | None]: ...

    def put(self, page: PageData) -> None: ...

    def flush(self, timeout_s: float = 10.0) -> None: ...

    def close(self) -> None: ...


class StoreError(RuntimeError):
    """A backend failure (connection, RPC): the tier goes down for `retry_s`."""


class SharedKVStore:
    """The networked stores' common part (module docstring); subclasses implement the three backend calls."""

    scheme = ""
    connect_in_background = False  # True: `_connect` may block (it runs on the writer thread)

    def __init__(self, url: str, namespace: str, *, retry_s: float = 5.0, max_queue: int = 1024, samples: int = 4096):
        self.url = url
        self.prefix = f"mimo:kv:{namespace}:"
        self.retry_s = retry_s
        self.stats = StoreStats()
        self.load_ms: deque[float] = deque(maxlen=samples)  # per-page load latency of recent reads
        self.expect: dict = {}
        self.dtype = torch.float32
        self._connected = False
        self._down_until = 0.0
        self._q: queue.Queue = queue.Queue(max_queue)
        self._stop = False
        if not self.connect_in_background:
            self._connect()
            self._connected = True
        self._writer = threading.Thread(target=self._drain, name=f"kv-store-{self.scheme}", daemon=True)
        self._writer.start()

    # --- backend calls ----------------------------------------------------------------------------
    def _connect(self) -> None:
        """Connects (on the writer thread); raises on failure."""

    def _read(self, keys: list[str]) -> list[bytes | None]:
        raise NotImplementedError

    def _write(self, key: str, raw: bytes, replace: bool) -> bool:
        """Writes `raw` (only where `key` is absent unless `replace`); False = not stored (store full)."""
        raise NotImplementedError

    def _disconnect(self) -> None:
        pass

    # --- the shared rules -------------------------------------------------------------------------
    def key(self, h: int) -> str:
        return self.prefix + f"{h:016x}"

    @property
    def up(self) -> bool:
        return self._connected and time.monotonic() >= self._down_until

    def bind(self, expect: dict, dtype: torch.dtype) -> None:
        self.expect, self.dtype = expect, dtype

    def _failed(self, e: Exception) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.retry_s
        log.warning("KV store %s unavailable (%s): skipped for %.0f s", self.scheme, e, self.retry_s)

    def get_many(self, hashes: list[int]) -> list[PageData | None]:
        if not hashes or not self.up:
            return [None] * len(hashes)
        self.stats.gets += len(hashes)
        t0 = time.perf_counter()
        try:
            raws = self._read([self.key(h) for h in hashes])
        except Exception as e:  # noqa: BLE001 - the store is optional: any failure is a miss
            self._failed(e)
            return [None] * len(hashes)
        out = []
        for h, raw in zip(hashes, raws):
            if raw is None:
                self.stats.misses += 1
                out.append(None)
                continue
            page = decode_page(raw, h, self.expect, self.dtype)
            if page is None:
                self.stats.corrupt += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(raw)
            out.append(page)
        dt = time.perf_counter() - t0
        self.stats.read_s += dt
        self.load_ms.append(dt * 1e3 / len(hashes))
        return out

    def put(self, page: PageData) -> None:
        if not self.up:
            self.stats.dropped += 1
            return
        try:
            self._q.put_nowait(page)
        except queue.Full:
            self.stats.dropped += 1

    def _ensure_connected(self) -> bool:
        if self._connected:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            self._connect()
            self._connected = True
            log.info("KV store %s connected (%s)", self.scheme, self.url)
        except Exception as e:  # noqa: BLE001 - down at start: retried after retry_s, the worker serves meanwhile
            self._failed(e)
        return self._connected

    def _drain(self) -> None:
        while not self._stop:
            if not self._ensure_connected():
                time.sleep(min(0.2, self.retry_s))
                continue
            try:
                page = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._write_page(page)
            except Exception as e:  # noqa: BLE001
                self._failed(e)
            finally:
                self._q.task_done()

    def _write_page(self, page: PageData) -> None:
        if not self.up:
            self.stats.dropped += 1
            return
        raw = encode_page(page)
        t0 = time.perf_counter()
        # A page without its window never replaces one with it (the same prefix written again as a path to
        # later pages: a split node's head, a node removed after an insert-time write).
        stored = self._write(self.key(page.hash), raw, replace=page.has_window)
        self.stats.write_s += time.perf_counter() - t0
        if stored:
            self.stats.puts += 1
            self.stats.bytes_written += len(raw)
        else:
            self.stats.dropped += 1

    def wait_connected(self, timeout_s: float = 10.0) -> bool:
        """Waits until the writer thread connected (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while not self._connected and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._connected

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.flush(2.0)
        self._stop = True
        self._writer.join(1.0)
        if not self._writer.is_alive():
            self._disconnect()


class MemoryKVStore:
    """An in-process store with the same interface, bounded by bytes, LRU (the benchmark: it replays several
    workers in one process; the tests use the real stores)."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self.pages: OrderedDict[int, PageData] = OrderedDict()
        self.stats = StoreStats()
        self.up = True

    def bind(self, expect: dict, dtype: torch.dtype) -> None:
        pass

    def get_many(self, hashes):
        out = []
        for h in hashes:
            self.stats.gets += 1
            p = self.pages.get(h)
            if p is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += p.nbytes
                self.pages.move_to_end(h)
            out.append(p)
        return out

    def put(self, page: PageData) -> None:
        old = self.pages.pop(page.hash, None)
        if old is not None:
            self.used -= old.nbytes
            if old.has_window and not page.has_window:
                page = old  # keep the richer value
        self.pages[page.hash] = page
        self.used += page.nbytes
        self.stats.puts += 1
        self.stats.bytes_written += page.nbytes
        while self.used > self.capacity and self.pages:
            _, p = self.pages.popitem(last=False)
            self.used -= p.nbytes

    def flush(self, timeout_s: float = 0) -> None:
        pass

    def close(self) -> None:
        pass


SCHEMES = {"redis": "redis", "rediss": "redis", "unix": "redis", "mooncake": "mooncake"}


def store_scheme(url: str) -> str:
    """The backend a --kv-store URL names ("redis" or "mooncake"); ValueError for anything else."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(f"--kv-store must be a redis://, rediss://, unix:// or mooncake:// URL, got {url!r}")
    return SCHEMES[scheme]


def open_store(url: str, namespace: str, **opts) -> SharedKVStore:
    """The store a URL names; `opts` are the backend's keyword options (unknown ones are ignored)."""
    import inspect

    if store_scheme(url) == "redis":
        from .redis_store import RedisKVStore as cls
    else:
        from .mooncake_store import MooncakeKVStore as cls  # type: ignore[assignment]
    accepted = inspect.signature(cls.__init__).parameters
    return cls(url, namespace, **{k: v for k, v in opts.items() if k in accepted})
