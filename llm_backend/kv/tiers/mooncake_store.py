"""The shared KV tier on Mooncake Store (the `mooncake-transfer-engine` wheel's `MooncakeDistributedStore`).

URL: `mooncake://MASTER_HOST:RPC_PORT[?metadata=URL&protocol=tcp&device=NAME&local=HOST&replicas=N]`.
The master (`mooncake_master`, default RPC port 50051) keeps only metadata: which worker's segment holds which
key. Every worker mounts a segment of `segment_bytes` of its own memory into the store's pool and registers a
read buffer of `buffer_bytes`; values move between workers over the transfer engine (`protocol` tcp here, rdma
where a NIC has it). `metadata` is the transfer engine's metadata service, by default the master's HTTP one at
`http://MASTER_HOST:8080/metadata` (`mooncake_master --enable_http_metadata_server`). `local` is the address
other workers reach this one's segment at (default: this host's address on the route to the master).

- Reads: one `batch_get_into` per lookup straight into the registered buffer, one slot per page, the slot the
  largest value a valid page can have (from the bound shapes); per key the store returns the bytes read or an
  error code: not found = a miss, a value larger than the slot = corrupt, an RPC failure = the tier is down.
- Writes: `put` for a page without its window (Mooncake keeps an existing key's value: the SET-NX rule) and
  `upsert` for one with it; a full pool refuses the write (a dropped page), an RPC failure marks the tier down.
- The store evicts by itself (the master's high watermark); there is no TTL. A worker's pages live in its own
  segment: when it exits they are gone, and a master restart forgets every key (hits only, the clients
  re-register by themselves).
- `setup` retries for up to 90 s when the master is down, and holds the GIL meanwhile (every thread of the worker
  stops): it is called only once the master's RPC port accepts a connection (`master_answers`), on the writer
  thread (store.SharedKVStore); until it succeeds lookups are misses and writes are dropped. A `put` against a
  master that died blocks ~10 s the same way, so every read and write checks the master's port first (a loopback
  connect, tens of microseconds) and a dead master marks the tier down instead.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import parse_qs, urlsplit

import numpy as np
import torch

from .store import MAGIC, SharedKVStore, StoreError

NOT_FOUND, BUFFER_TOO_SMALL, RPC_ERRORS = -704, -600, -900  # Mooncake error codes; -900 and below: RPC
DEFAULT_RPC_PORT, DEFAULT_METADATA_PORT = 50051, 8080


def parse_url(url: str) -> dict:
    """The store's settings from a mooncake:// URL (ValueError naming what is wrong)."""
    u = urlsplit(url)
    if u.scheme != "mooncake" or not u.hostname:
        raise ValueError(f"--kv-store {url!r}: expected mooncake://MASTER_HOST[:PORT][?metadata=URL&protocol=...]")
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    unknown = set(q) - {"metadata", "protocol", "device", "local", "replicas"}
    if unknown:
        raise ValueError(f"--kv-store {url!r}: unknown option(s) {sorted(unknown)}")
    host, port = u.hostname, u.port or DEFAULT_RPC_PORT
    replicas = q.get("replicas", "1")
    if not replicas.isdigit() or int(replicas) < 1:
        raise ValueError(f"--kv-store {url!r}: replicas must be a positive integer")
    return {
        "master": f"{host}:{port}",
        "metadata": q.get("metadata", f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"),
        "protocol": q.get("protocol", "tcp"),
        "device": q.get("device", ""),
        "local": q.get("local") or route_address(host, port),
        "replicas": int(replicas),
    }


def master_answers(address: str, timeout: float = 0.5) -> bool:
    """Whether the master's RPC port (host:port) accepts a TCP connection. Mooncake's `setup` against a master that
    is down retries for up to 90 s without releasing the GIL, which stops every thread of the process (the engine
    loop, the servers): it is only called once this answers."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def route_address(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def max_value_bytes(expect: dict, dtype: torch.dtype) -> int:
    """The largest encoded page the bound shapes allow (store.encode_page: magic, header, checksum, payload)."""
    esz = torch.empty(0, dtype=dtype).element_size()
    shapes = [[part, layer, list(shape)] for (part, layer), ks in sorted(expect.items()) for shape in ks]
    payload = sum(int(np.prod(s)) * esz for _, _, s in shapes)
    header = json.dumps({"hash": 2**64 - 1, "window": False, "dtype": str(dtype), "shapes": shapes}).encode()
    return len(MAGIC) + 4 + len(header) + 8 + payload


class MooncakeKVStore(SharedKVStore):
    scheme = "mooncake"
    connect_in_background = True

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        segment_bytes: int = 1 << 30,
        buffer_bytes: int = 64 << 20,
        retry_s: float = 5.0,
        max_queue: int = 1024,
    ):
        self.cfg = parse_url(url)
        if segment_bytes <= 0 or buffer_bytes <= 0:
            raise ValueError("--kv-store-segment-bytes and --kv-store-buffer-bytes must be positive")
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.buf = np.zeros(buffer_bytes, dtype=np.uint8)
        self.slot = 0
        self.client = None
        super().__init__(url, namespace, retry_s=retry_s, max_queue=max_queue)

    def bind(self, expect: dict, dtype: torch.dtype) -> None:
        super().bind(expect, dtype)
        self.slot = max_value_bytes(expect, dtype) + 64
        if self.slot > self.buffer_bytes:
            raise ValueError(
                f"--kv-store-buffer-bytes {self.buffer_bytes} is smaller than one page ({self.slot} bytes)"
            )

    def _connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        c = self.cfg
        if not master_answers(c["master"]):
            raise StoreError(f"the master {c['master']} does not answer")
        client = MooncakeDistributedStore()
        rc = client.setup(
            c["local"], c["metadata"], self.segment_bytes, self.buffer_bytes, c["protocol"], c["device"], c["master"]
        )
        if rc != 0:
            raise StoreError(f"setup against master {c['master']} returned {rc}")
        rc = client.register_buffer(self.buf.ctypes.data, self.buf.nbytes)
        if rc != 0:
            client.close()
            raise StoreError(f"register_buffer returned {rc}")
        self.replicate = ReplicateConfig()
        self.replicate.replica_num = c["replicas"]
        self.client = client

    def _alive(self) -> None:
        """Raises StoreError when the master does not accept a connection: Mooncake's calls against a dead master
        block for ~10 s each holding the GIL (measured: a `put` froze every thread of the process 10.7 s), so none
        is made then; the store is marked down and tried again after --kv-store-retry-s."""
        if not master_answers(self.cfg["master"], 0.2):
            raise StoreError(f"the master {self.cfg['master']} does not answer")

    def _read(self, keys: list[str]) -> list[bytes | None]:
        self._alive()
        slot = self.slot or self.buffer_bytes // max(len(keys), 1)
        per_call = max(1, self.buffer_bytes // slot)
        out: list[bytes | None] = []
        base = self.buf.ctypes.data
        for i in range(0, len(keys), per_call):
            chunk = keys[i : i + per_call]
            codes = self.client.batch_get_into(chunk, [base + j * slot for j in range(len(chunk))], [slot] * len(chunk))
            for j, rc in enumerate(codes):
                if rc > 0:
                    out.append(self.buf[j * slot : j * slot + rc].tobytes())
                elif rc == BUFFER_TOO_SMALL:
                    out.append(b"")  # larger than any valid page: decoded as corrupt
                elif rc <= RPC_ERRORS:
                    raise StoreError(f"batch_get_into returned {rc}")
                else:
                    out.append(None)  # not found (or not readable yet): a miss
        return out

    def _write(self, key: str, raw: bytes, replace: bool) -> bool:
        self._alive()
        rc = (self.client.upsert if replace else self.client.put)(key, raw, self.replicate)
        if rc <= RPC_ERRORS:
            raise StoreError(f"{'upsert' if replace else 'put'} returned {rc}")
        return rc == 0  # else the pool is full (or the key busy): the page is dropped

    def _disconnect(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
