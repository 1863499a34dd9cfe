"""Where the routers' shared knowledge lives: the page-hash index, each worker's load, and the member registry.

`--router-state memory` (default): `MemoryState`, in this process (one router).
`--router-state redis://HOST:PORT/DB`: `RedisState`, in a real Redis, so any number of stateless routers see the
same index and loads (and make the same decisions), a restarted router is warm at once, and members on other
machines are found. Layout (prefix `mimo` by default):

    {p}:kv:{worker}      HASH  8-byte big-endian block hash -> b"1" stored | b"2" stored, usable match end
    {p}:member:{id}      HASH  kind, address, node, model, block_size, epoch, queued_tokens, running_tokens, ...
    {p}:members          SET   member ids (a member whose key has expired is dropped from it by the next reader)
    {p}:relay:{worker}   STRING the relay that currently writes this worker's events (a lease, see WorkerFeed)
    {p}:answered:{worker} STRING "EPOCH:SEQ": the KV-event position of the worker's latest answer to any router
                         (router/sync.py: every router waits for the index to reach it, not only the one answered)

Every key but the set has a TTL that the member's heartbeat (for a worker: each event poll) refreshes, so a
dead worker's entries expire with its heartbeat. One writer per worker key: the relay holding the lease.

`apply` returns whether it continued a live record: a relay that stalls past the TTL (a starved process) finds
the worker's entries gone, and a delta written onto nothing would leave the index missing every block stored
before it, for good. Then `apply` answers False and the feed asks its worker for a full snapshot at once.

A member record also carries `epoch` and `kv_seq` (the worker's KV-event log position the index has reached);
`position(member)` reads them, so a router can wait for the index to catch up with what a worker has answered.

A Redis error raises `StateUnavailable`; the LLM router then routes by load only (its own counts) until the
state answers again, and says so in its logs and metrics.
"""

from __future__ import annotations

import logging
import time

from llm_backend.kv.events import ABSENT

from .index import MemoryIndex
from .records import LOAD_FIELDS, BadRecord, BadRecords, kv_state, member

__all__ = ["LOAD_FIELDS", "MemoryState", "RedisState", "StateUnavailable", "open_state"]

log = logging.getLogger(__name__)

PROGRESS_LOAD = (*LOAD_FIELDS, "updated")  # what a feed writes with each position: the load and its wall time


def _progress(epoch, seq, load: list) -> tuple[str, dict]:
    """("EPOCH:SEQ" or "", the load fields as integers and `updated` as seconds; {} when there is no load)."""
    if not epoch or not seq:
        return "", {}
    try:
        fields = {k: int(v) for k, v in zip(LOAD_FIELDS, load)}
        fields["updated"] = float(load[-1])
    except (TypeError, ValueError):  # a record without (or with a bad) load: the position alone
        fields = {}
    return f"{epoch}:{seq}", fields


# Seconds a Redis client's close may take before it is abandoned.
CLOSE_S = 5.0


class StateUnavailable(RuntimeError):
    pass


def _hkey(h: int) -> bytes:
    return int(h).to_bytes(8, "big")


class MemoryState:
    kind = "memory"

    def __init__(self):
        self.index = MemoryIndex()
        self.bad = BadRecords()
        self._members: dict[str, tuple[float, dict]] = {}  # id -> (expires at, fields)
        self._leases: dict[str, tuple[str, float]] = {}

    async def apply(self, worker: str, reset: bool, hashes, states, member: dict, ttl_s: float) -> bool:
        """Writes a feed's changes; False when the worker's record had expired (and its index was dropped)."""
        live = worker in self._members
        self.index.apply(worker, reset, hashes, states)
        await self.register(worker, member, ttl_s)
        return reset or live

    async def answered(self, member_id: str, position: str, ttl_s: float) -> None:
        pass  # one router: its own IndexSync already knows

    async def answered_positions(self, member_ids) -> dict[str, str]:
        return {}

    async def position(self, member_id: str) -> str:
        return (await self.progress(member_id))[0]

    async def progress(self, member_id: str) -> tuple[str, dict]:
        """Where the worker's index stands ("EPOCH:SEQ", "" = nowhere) and the load its feed wrote with it."""
        f = self._members.get(member_id, (0, {}))[1]
        return _progress(f.get("epoch"), f.get("kv_seq"), [f.get(k) for k in PROGRESS_LOAD])

    async def lookup(self, hashes, workers) -> dict[str, list[int]]:
        return self.index.states(hashes, workers)

    async def register(self, member_id: str, fields: dict, ttl_s: float) -> None:
        old = self._members.get(member_id, (0, {}))[1]
        self._members[member_id] = (time.monotonic() + ttl_s, {**old, **{k: str(v) for k, v in fields.items()}})

    async def unregister(self, member_id: str) -> None:
        self._members.pop(member_id, None)
        self.index.drop(member_id)

    async def members(self, kind: str | None = None) -> dict[str, dict]:
        now = time.monotonic()
        for mid in [m for m, (exp, _) in self._members.items() if exp < now]:
            del self._members[mid]
            self.index.drop(mid)
        return {m: f for m, (_, f) in self._members.items() if kind is None or f.get("kind") == kind}

    async def lease(self, name: str, owner: str, ttl_s: float) -> bool:
        now = time.monotonic()
        holder = self._leases.get(name)
        if holder is None or holder[0] == owner or holder[1] < now:
            self._leases[name] = (owner, now + ttl_s)
            return True
        return False

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        pass


class RedisState:
    kind = "redis"

    def __init__(self, url: str, prefix: str = "mimo", timeout_s: float = 0.5):
        import redis.asyncio as aioredis

        self.url, self.p = url, prefix
        self.bad = BadRecords()
        self.r = aioredis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=0,
            retry_on_timeout=False,
        )
        self._renew = self.r.register_script(
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
            "elseif redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 else return 0 end"
        )

    async def _run(self, coro):
        import redis

        try:
            return await coro
        except (redis.RedisError, OSError) as e:
            raise StateUnavailable(f"redis {self.url}: {e}") from e

    def _kv(self, worker: str) -> str:
        return f"{self.p}:kv:{worker}"

    def _member(self, member_id: str) -> str:
        return f"{self.p}:member:{member_id}"

    async def apply(self, worker: str, reset: bool, hashes, states, member: dict, ttl_s: float) -> bool:
        """Writes a feed's changes in one transaction; False when the worker's record had expired before it."""
        ms = max(1, int(ttl_s * 1000))
        pipe = self.r.pipeline(transaction=True)
        pipe.pexpire(self._member(worker), ms)  # 0: the record (and the index with it, same TTL) had expired
        kv = self._kv(worker)
        if reset:
            pipe.delete(kv)
        stored, removed = {}, []
        for h, s in zip(hashes, states):  # later changes of the same block win, in order
            k = _hkey(h)
            if s == ABSENT:
                stored.pop(k, None)
                removed.append(k)
            else:
                stored[k] = str(int(s))
        if removed:
            pipe.hdel(kv, *removed)
        if stored:
            pipe.hset(kv, mapping=stored)
        pipe.pexpire(kv, ms)
        self._register(pipe, worker, member, ms)
        results = await self._run(pipe.execute())
        return reset or bool(results[0])

    async def answered(self, member_id: str, position: str, ttl_s: float) -> None:
        """What a worker last answered to any router (its KV-event position), for the other routers' waits."""
        await self._run(self.r.set(f"{self.p}:answered:{member_id}", position, px=max(1, int(ttl_s * 1000))))

    async def answered_positions(self, member_ids) -> dict[str, str]:
        ids = list(member_ids)
        if not ids:
            return {}
        vals = await self._run(self.r.mget([f"{self.p}:answered:{m}" for m in ids]))
        return {m: v.decode(errors="replace") for m, v in zip(ids, vals) if v}

    async def position(self, member_id: str) -> str:
        return (await self.progress(member_id))[0]

    async def progress(self, member_id: str) -> tuple[str, dict]:
        """Where the worker's index stands and the load its feed wrote with it, in one read (one HMGET)."""
        epoch, seq, *load = await self._run(self.r.hmget(self._member(member_id), ["epoch", "kv_seq", *PROGRESS_LOAD]))
        dec = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in (epoch, seq, *load)]
        return _progress(dec[0], dec[1], dec[2:])

    def _register(self, pipe, member_id: str, fields: dict, ms: int) -> None:
        key = self._member(member_id)
        if fields:
            pipe.hset(key, mapping={k: str(v) for k, v in fields.items()})
        pipe.pexpire(key, ms)
        pipe.sadd(f"{self.p}:members", member_id)

    async def register(self, member_id: str, fields: dict, ttl_s: float) -> None:
        pipe = self.r.pipeline(transaction=True)
        self._register(pipe, member_id, fields, max(1, int(ttl_s * 1000)))
        await self._run(pipe.execute())

    async def unregister(self, member_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self._member(member_id), self._kv(member_id))
        pipe.srem(f"{self.p}:members", member_id)
        await self._run(pipe.execute())

    async def lookup(self, hashes, workers) -> dict[str, list[int]]:
        workers = list(workers)
        if not hashes or not workers:
            return {w: [] for w in workers}
        keys = [_hkey(h) for h in hashes]
        pipe = self.r.pipeline(transaction=False)
        for w in workers:
            pipe.hmget(self._kv(w), keys)
        rows = await self._run(pipe.execute())
        return {w: [self._state(w, v) for v in row] for w, row in zip(workers, rows)}

    def _state(self, worker: str, v) -> int:
        if not v:
            return ABSENT
        n = kv_state(v)
        if n is None:  # garbage in the index: the block counts as absent (records.py)
            self.bad.add("kv", self._kv(worker), f"value {bytes(v)[:16]!r} is not a block state")
            return ABSENT
        return n

    async def members(self, kind: str | None = None) -> dict[str, dict]:
        ids = sorted(m.decode() for m in await self._run(self.r.smembers(f"{self.p}:members")))
        if not ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for m in ids:
            pipe.hgetall(self._member(m))
        rows = await self._run(pipe.execute())
        out, gone = {}, []
        for m, row in zip(ids, rows):
            if not row:
                gone.append(m)
                continue
            try:
                f = member(m, {k.decode(): v.decode() for k, v in row.items()})
            except (UnicodeDecodeError, BadRecord) as e:  # skipped and counted, never fatal (records.py)
                self.bad.add("member", m, str(e))
                continue
            if kind is None or f.get("kind") == kind:
                out[m] = f
        if gone:
            await self._run(self.r.srem(f"{self.p}:members", *gone))
        return out

    async def lease(self, name: str, owner: str, ttl_s: float) -> bool:
        return bool(
            await self._run(self._renew(keys=[f"{self.p}:relay:{name}"], args=[owner, max(1, int(ttl_s * 1000))]))
        )

    async def ping(self) -> bool:
        try:
            return bool(await self._run(self.r.ping()))
        except StateUnavailable:
            return False

    async def close(self) -> None:
        """Closes the client's connections; bounded (redis-py's close waits for each socket to finish closing, which
        a peer that stopped answering never lets it do): past `CLOSE_S` the connections are left to the
        garbage collector, with a warning."""
        import asyncio

        try:
            await asyncio.wait_for(self.r.aclose(), CLOSE_S)
        except TimeoutError:
            log.warning("redis %s: closing the client took over %gs; abandoned", self.url, CLOSE_S)
        except OSError as e:
            log.warning("redis %s: closing the client failed: %s", self.url, e)


def open_state(spec: str, prefix: str = "mimo"):
    """`memory` or `redis://HOST:PORT/DB` (also rediss:// and unix://)."""
    if spec in ("", "memory"):
        return MemoryState()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisState(spec, prefix)
    raise ValueError(f"--router-state must be 'memory' or a redis:// URL, got {spec!r}")
