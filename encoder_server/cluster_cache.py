"""The fleet's embedding cache (L3): embeddings on Mooncake Store, shared by every encoder of every node, and a
fleet-wide lease so that concurrent requests for the same new media anywhere encode it once.

Tiers: the process's or node's cache (`EmbeddingLRU` / `ShmEmbeddingStore`, L1/L2) first, then the store. An
encoder writes what it encodes to both; a node's miss looks in the store before encoding, and a store hit fills
the node's cache. Keys are content keys (mimo_epd.common.content_key: the bytes, the model id, the preprocessing,
the options), so an entry is never served for another model or other settings.

- **Entries** (`encode_entry` / `decode_entry`): a magic, a JSON header (the content key itself, dtype, shape,
  grid, the video / audio metadata), an xxh3-64 of the payload, the rows. A value whose magic, key, size or
  checksum does not match is dropped as a miss and counted (`corrupt`), never served.
- **Bounds**: the store's pool is the sum of the segments its clients mount (`--embedding-store-segment-bytes` each);
  Mooncake evicts by itself past its high watermark (LRU-like, by the master). Items over
  `--embedding-store-max-item-bytes` are not stored (a one-hour video's rows stay on their node).
- **Writes** go through one writer thread (a bounded queue; a full queue drops the write, counted), so encoding never
  waits on the network; an encoder whose store is down keeps serving from its own cache.
- **The lease** (`EmbeddingLease`, in the router state's Redis): before encoding a miss, an encoder takes
  `mimo-epd:lease:{key}` with SET NX PX (`--embedding-lease-ms`). The holder encodes and its write releases the
  lease; any other encoder that misses meanwhile waits for the entry to appear in the store (polling every 20 ms)
  and answers from it (`lease_waits_served`: an encode saved), or encodes itself once the lease is gone without an
  entry (the holder failed or its write was dropped). A lease never outlives its TTL, so a dead holder costs at
  most that long.

Metrics (`EncoderMetrics.cluster`): hits, misses, corrupt, writes, write drops, bytes read and written, lease waits
served and lease waits that ended in an encode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import struct
import threading
import time

import numpy as np
import torch
import xxhash

from .embedding_cache import CachedEmbedding

log = logging.getLogger(__name__)

MAGIC = b"MEPDEMB1"
NOT_FOUND_CODES = (-704,)  # Mooncake: object not found
POLL_S = 0.02
CONNECT_S = 30.0  # how long a call may take while the helper connects (Mooncake's setup against a live master)


def encode_entry(key: str, entry: CachedEmbedding) -> bytes:
    t = entry.embedding.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    header = json.dumps(
        {"key": key, "dtype": dtype, "shape": list(t.shape), "grid": list(entry.grid_thw), "meta": entry.meta}
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)) + raw


def decode_entry(key: str, value: bytes) -> CachedEmbedding | None:
    """The entry stored under `key`, or None when the value is not a whole, intact entry for that very key."""
    try:
        if not value.startswith(MAGIC):
            return None
        (n,) = struct.unpack_from("<I", value, len(MAGIC))
        at = len(MAGIC) + 4
        header = json.loads(value[at : at + n])
        (digest,) = struct.unpack_from("<Q", value, at + n)
        raw = memoryview(value)[at + n + 8 :]
        if header["key"] != key or xxhash.xxh3_64_intdigest(raw) != digest:
            return None
        dtype = header["dtype"]
        np_dtype = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
        arr = np.frombuffer(raw, dtype=np_dtype).reshape(header["shape"]).copy()
        t = torch.from_numpy(arr)
        if dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return CachedEmbedding(t, tuple(header["grid"]), header["meta"])
    except (ValueError, KeyError, TypeError, struct.error):
        return None


class MooncakeEmbeddingStore:
    """Values by key on Mooncake Store (`mooncake://` URLs, llm_backend/kv/tiers/mooncake_store.py's `parse_url`),
    through a helper process of its own (`_store_process`).

    Why a process: Mooncake's Python calls hold the GIL while they block, and they block against a master that is
    down or dies mid-call (setup up to 90 s, a put ~10 s, a close 1.5 s: measured), which would stop every thread
    of the encoder, health answers included, and its router would drop it. In the helper only the helper stops: a
    call that gets no answer within `timeout_s` fails (OSError, a miss or a dropped write above), and the helper is
    replaced. The helper connects once the master's port answers and again after a failure (`retry_s`)."""

    def __init__(self, url: str, segment_bytes: int, retry_s: float = 5.0, timeout_s: float = 2.0):
        from llm_backend.kv.tiers.mooncake_store import parse_url

        self.cfg = parse_url(url)
        self.segment_bytes, self.retry_s, self.timeout_s = segment_bytes, retry_s, timeout_s
        self._lock = threading.Lock()
        self._conn = self._proc = None
        self._connected = False
        self._closed = threading.Event()
        self.restarts = 0
        self._start()
        self._watcher = threading.Thread(target=self._watch, name="embedding-store-watch", daemon=True)
        self._watcher.start()

    def _start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, self.cfg, self.segment_bytes, self.retry_s)
        self._proc = ctx.Process(target=_store_process, args=args, name="embedding-store", daemon=True)
        self._proc.start()
        child.close()

    def _watch(self) -> None:
        """Asks the helper for its status every second: the only caller that waits through a connect (up to
        CONNECT_S); gets and puts fail at once while the helper is not connected, so the first requests after a
        start or a master's restart never wait on Mooncake's setup."""
        while not self._closed.is_set():
            try:
                self._call("status", wait=self.timeout_s if self._connected else max(self.timeout_s, CONNECT_S))
            except OSError:
                pass
            self._closed.wait(1.0)

    def _call(self, *msg, wait: float | None = None):
        if not self._lock.acquire(timeout=self.timeout_s):  # the watcher is waiting through a connect
            raise OSError("the embedding store is busy connecting")
        try:
            if self._closed.is_set():
                raise OSError("the embedding store is closed")
            if not self._proc.is_alive():
                self._replace("exited")
            try:
                self._conn.send(msg)
                wait = self.timeout_s if wait is None else wait
                if not self._conn.poll(wait):
                    self._replace(f"gave no answer within {wait:g} s")
                    raise OSError("the embedding store did not answer in time")
                ok, value, self._connected = self._conn.recv()
            except (EOFError, BrokenPipeError, ConnectionError) as e:
                self._replace(f"broke ({e})")
                raise OSError("the embedding store's helper process failed") from None
        finally:
            self._lock.release()
        if not ok:
            raise OSError(value)
        return value

    def _replace(self, why: str) -> None:
        self._proc.kill()
        self._proc.join(5)
        self._conn.close()
        self._connected = False
        if self._closed.is_set():
            return
        log.warning("embedding store helper %s: replaced", why)
        self.restarts += 1
        self._start()

    @property
    def connected(self) -> bool:
        """Whether the helper was connected at its last answer (the watcher asks every second)."""
        return self._connected

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._connected and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._connected

    def _ready(self) -> None:
        if not self._connected:
            raise OSError("the embedding store is not connected")

    def get(self, key: str) -> bytes | None:
        self._ready()
        return self._call("get", key)

    def put(self, key: str, value: bytes) -> bool:
        self._ready()
        return self._call("put", key, value)

    def close(self) -> None:
        """Stops the helper: asked to close its client, killed if it does not within 3 s, or at once while the
        watcher waits through a connect."""
        self._closed.set()
        got = self._lock.acquire(timeout=self.timeout_s)
        try:
            if got and self._proc.is_alive():
                try:
                    self._conn.send(("close",))
                except (BrokenPipeError, OSError):
                    pass
                self._proc.join(3)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        finally:
            if got:
                self._lock.release()
        self._watcher.join(5)


def _store_process(conn, cfg: dict, segment_bytes: int, retry_s: float) -> None:
    """The helper: answers (ok, value, connected) to ("status",), ("get", key), ("put", key, value) and stops on
    ("close",). Connects lazily, only once the master's port answers; a dead master or an RPC failure drops the
    client (not closed: closing it then blocks too) until the next connect."""
    import signal as _signal

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    from llm_backend.kv.tiers.mooncake_store import master_answers

    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # the server's Ctrl-C is for the server; it closes this
    client, replicate, last_try, stale = None, None, -1e9, []
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "close":
            if client is not None:
                client.close()
            return
        if client is not None and not master_answers(cfg["master"], 0.2):
            stale.append(client)
            client = None
        if client is None and time.monotonic() - last_try >= retry_s and master_answers(cfg["master"], 0.2):
            last_try = time.monotonic()
            c = MooncakeDistributedStore()
            if (
                c.setup(
                    cfg["local"],
                    cfg["metadata"],
                    segment_bytes,
                    16 << 20,
                    cfg["protocol"],
                    cfg["device"],
                    cfg["master"],
                )
                == 0
            ):
                client, replicate = c, ReplicateConfig()
                replicate.replica_num = cfg["replicas"]
        if msg[0] == "status" or client is None:
            conn.send((msg[0] == "status", "the embedding store is not connected", client is not None))
            continue
        if msg[0] == "get":
            value = client.get(msg[1])
            conn.send((True, bytes(value) if value else None, True))
        else:
            rc = client.put(msg[1], msg[2], replicate)
            if rc <= -900:  # an RPC failure: connect again next time
                stale.append(client)
                client = None
                conn.send((False, f"put returned {rc}", False))
            else:
                conn.send((True, rc == 0, True))


class EmbeddingLease:
    """A short fleet-wide lease per content key in Redis (SET NX PX; released only by its owner)."""

    RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

    def __init__(self, url: str, owner: str, ttl_ms: int):
        import redis

        self.r = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.owner, self.ttl_ms = owner, ttl_ms

    @staticmethod
    def name(key: str) -> str:
        return f"mimo-epd:lease:{key}"

    def acquire(self, key: str) -> bool:
        return bool(self.r.set(self.name(key), self.owner, nx=True, px=self.ttl_ms))

    def held(self, key: str) -> bool:
        return bool(self.r.exists(self.name(key)))

    def release(self, key: str) -> None:
        self.r.eval(self.RELEASE, 1, self.name(key), self.owner)


class ClusterEmbeddingCache:
    """The node's cache (`local`, may be None) in front of the fleet's store, with the same interface (`get`, `put`,
    `stats`) plus `fetch` and `lead` for the pipeline's miss path (see the module docstring)."""

    def __init__(self, local, store, lease: EmbeddingLease | None, max_item_bytes: int, max_queue: int = 64):
        self.local, self.store, self.lease = local, store, lease
        self.max_item_bytes = max_item_bytes
        self.counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "corrupt",
                "errors",
                "writes",
                "write_drops",
                "bytes_read",
                "bytes_written",
                "lease_waits_served",
                "lease_waits_encoded",
            ),
            0,
        )
        self._leased: set[str] = set()
        self._q: queue.Queue = queue.Queue(max_queue)
        self._writer = threading.Thread(target=self._write_loop, name="embedding-store-writer", daemon=True)
        self._writer.start()

    # the local cache's interface
    def get(self, key: str) -> CachedEmbedding | None:
        return self.local.get(key) if self.local is not None else None

    def put(self, key: str, entry: CachedEmbedding) -> bool:
        ok = self.local.put(key, entry) if self.local is not None else True
        if entry.nbytes > self.max_item_bytes:
            self._release(key)
            return ok
        try:
            self._q.put_nowait((key, entry))
        except queue.Full:
            self.counts["write_drops"] += 1
            self._release(key)
        return ok

    @property
    def connected(self) -> bool:
        return self.store.connected

    def stats(self) -> dict:
        local = self.local.stats() if self.local is not None else {}
        return {**local, "cluster": dict(self.counts)}

    def close(self) -> None:
        self._q.put(None)
        self._writer.join(5)
        self.store.close()
        if self.local is not None and hasattr(self.local, "close"):
            self.local.close()

    # the miss path
    async def fetch(self, key: str) -> CachedEmbedding | None:
        """The store's entry for `key` (then kept in the node's cache), or None."""
        try:
            value = await asyncio.to_thread(self.store.get, key)
        except OSError as e:
            self.counts["errors"] += 1
            log.debug("embedding store lookup failed: %s", e)
            return None
        if value is None:
            self.counts["misses"] += 1
            return None
        entry = decode_entry(key, value)
        if entry is None:
            self.counts["corrupt"] += 1
            log.warning("embedding store: the value under %s is not an intact entry for it; treated as a miss", key)
            return None
        self.counts["hits"] += 1
        self.counts["bytes_read"] += len(value)
        if self.local is not None:
            self.local.put(key, entry)
        return entry

    async def lead(self, key: str) -> CachedEmbedding | None:
        """After a store miss: None when this encoder should encode `key` (it holds the lease, or there is no lease
        service, or the lease ended without an entry); the entry when another encoder's arrived meanwhile."""
        if self.lease is None:
            return None
        try:
            if await asyncio.to_thread(self.lease.acquire, key):
                self._leased.add(key)
                return None
            deadline = time.monotonic() + self.lease.ttl_ms / 1e3
            while time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
                entry = await self.fetch(key)
                if entry is not None:
                    self.counts["lease_waits_served"] += 1
                    return entry
                if not await asyncio.to_thread(self.lease.held, key):
                    entry = await self.fetch(key)  # the holder's write may have landed just before it released
                    if entry is not None:
                        self.counts["lease_waits_served"] += 1
                        return entry
                    break
        except Exception as e:  # noqa: BLE001 - redis.RedisError, OSError: the lease is advisory; encode
            self.counts["errors"] += 1
            log.debug("embedding lease failed: %s", e)
        self.counts["lease_waits_encoded"] += 1
        return None

    # the writer thread
    def _write_loop(self) -> None:
        while (item := self._q.get()) is not None:
            key, entry = item
            try:
                value = encode_entry(key, entry)
                if self.store.put(key, value):
                    self.counts["writes"] += 1
                    self.counts["bytes_written"] += len(value)
                else:
                    self.counts["write_drops"] += 1
            except OSError as e:
                self.counts["write_drops"] += 1
                log.debug("embedding store write failed: %s", e)
            finally:
                self._release(key)

    def _release(self, key: str) -> None:
        if self.lease is None or key not in self._leased:
            return
        self._leased.discard(key)
        try:
            self.lease.release(key)
        except Exception as e:  # noqa: BLE001 - it expires by itself
            log.debug("embedding lease release failed: %s", e)
