"""The shared KV tier on Redis: one key per page (`SET`, with `NX` for a page without its window, and a TTL),
read with one `MGET` per lookup. redis-py connects lazily with the socket timeout, so construction never blocks
and every network failure surfaces as an exception the shared rules (store.SharedKVStore) turn into a miss. The
server bounds its memory itself (maxmemory + an LRU policy)."""

from __future__ import annotations

from .store import SharedKVStore


class RedisKVStore(SharedKVStore):
    scheme = "redis"

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        ttl_s: int = 3600,
        timeout_s: float = 0.5,
        retry_s: float = 5.0,
        max_queue: int = 1024,
    ):
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        super().__init__(url, namespace, retry_s=retry_s, max_queue=max_queue)

    def _connect(self) -> None:
        import redis

        self.client = redis.Redis.from_url(
            self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
        )

    def _read(self, keys: list[str]) -> list[bytes | None]:
        return self.client.mget(keys)

    def _write(self, key: str, raw: bytes, replace: bool) -> bool:
        self.client.set(key, raw, ex=self.ttl_s, nx=not replace)
        return True  # NX refusing an existing key is the rule working, not a dropped page

    def _disconnect(self) -> None:
        self.client.close()
