"""A node-local embedding store in POSIX shared memory, shared by every encoder process of a node.

Any number of processes read and write at once. Needs only numpy, the standard library and `xxhash`
(the integrity hash); nothing else, no torch.

Layout of the segment `/dev/shm/<name>` (mode 0600, fixed size, preallocated so a full tmpfs fails
at creation with a clear error, not later with SIGBUS):

    [ header (4 KiB) | slot table | pin table | keys | states | key index | data arena ]

- A *slot* describes one entry: 128-bit key (in the key columns), state (EMPTY / WRITING / READY), where
  its bytes are in the arena, their xxh3-64 hash, dtype, shape, grid_thw, the length of its metadata
  blob, its neighbours in address order and a CLOCK use counter.
- An entry's arena bytes are `[tensor bytes | metadata blob]`: the metadata (a video's timestamps, ...)
  lives and dies with its tensor, so a hit always carries it. One hash covers both.
- The *key index* (`index.py`) maps keys to slots: open addressing with bounded probing, so a lookup is
  O(1) whatever the number of entries, not a scan of the slot table.
- A *pin* records that process `pid` holds a zero-copy view of slot `s` (generation `g`). A pinned
  entry is never evicted, so the view stays valid until the reader releases it.
- The arena is allocated contiguously by a CLOCK hand sweeping the address space: the bytes under the
  hand are reused if their entries are neither pinned, nor being written, nor recently used. Each use
  adds one to an entry's counter (saturating at 3, "generalised CLOCK"); the hand takes one off and
  skips the entry while it is above zero, so frequently used entries survive several sweeps (better
  than plain LRU/CLOCK on Zipf-like traffic). Eviction is by bytes, and by slots when the slot table is
  full. Live entries form a list in address order, so the hand finds what lies under it in O(1).

Concurrency: every metadata change happens under an exclusive `flock` on the segment (plus a thread
lock, because flock does not exclude threads sharing a descriptor). Large copies happen outside it:
`put` reserves space and a WRITING slot, copies and hashes without the lock, then publishes the
slot as READY. Readers only ever see READY slots, so no reader sees a partial entry.

Integrity (where the cost goes): an entry's bytes are hashed once, by its writer, outside the lock.
A READY entry's bytes can only have been broken if some process died in the middle of changing the
metadata (a recovery ran since) or by a stray write. So a read verifies the hash (xxh3, ~15 GB/s:
~7 ms for 100 MB, outside the lock, on the reader's thread) only when the entry has not been verified
since the last recovery (a per-entry epoch: the first reader after a recovery checks it, for everyone),
on a random sample of reads (`verify_sample_rate`, per process), or when asked (`get(verify=True)`).
A mismatch is dropped and reported as a miss, never served. `ShmEmbeddingStore.get_async` runs the
read (copy + any verification; both release the GIL) off the event loop.

Crash safety (a process SIGKILLed anywhere):
- the kernel drops a dead process's flock, so nobody deadlocks;
- a `dirty` flag is set while metadata is being changed; whoever next takes the lock and finds it set
  runs recovery: WRITING slots of dead writers are freed, slots with impossible extents or overlapping
  bytes are dropped, pins of dead processes are cleared, the address list, the key index and the byte
  counts are rebuilt from the slot table, and the recovery epoch advances (every entry is verified on
  its next read, see Integrity);
- outside the lock, a writer killed mid-copy leaves a WRITING slot owned by a dead pid, which is
  freed when found; a reader killed holding a pin leaves a pin of a dead pid, cleared when found.
Process liveness is `kill(pid, 0)` plus /proc state (zombies count as dead). Statistics updated by
a process that died inside the lock may lose that one update.

Attach after fork: a forked child must open its own `ShmCache` (flock is per open file description).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import xxhash

from mimo_epd.common.parent import pid_alive  # one rule for "is this pid alive" (zombies are not)

from . import index as hindex
from .index import HashIndex

MAGIC = b"MIMOSHM2"
OLD_MAGICS = (b"MIMOSHM1",)
HEADER_BYTES = 4096
ALIGN = 64
EMPTY, WRITING, READY = 0, 1, 2
MAX_REF = 3  # GCLOCK: a saturating use counter; the hand decrements it and evicts at zero
MAX_META_BYTES = 1 << 20  # an entry's metadata blob: timestamps and descriptions, not payloads
NIL = -1

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("dirty", "<u4"),
        ("total_size", "<u8"),
        ("data_offset", "<u8"),
        ("data_size", "<u8"),
        ("max_entries", "<u8"),
        ("max_pins", "<u8"),
        ("slots_offset", "<u8"),
        ("pins_offset", "<u8"),
        ("keys_offset", "<u8"),
        ("state_offset", "<u8"),
        ("index_offset", "<u8"),
        ("hand", "<u8"),
        ("hand_next", "<i8"),
        ("lhead", "<i8"),
        ("ltail", "<i8"),
        ("slot_hint", "<u8"),
        ("clock", "<u8"),
        ("generation", "<u8"),
        ("hits", "<u8"),
        ("misses", "<u8"),
        ("inserts", "<u8"),
        ("evictions", "<u8"),
        ("bytes_used", "<u8"),
        ("recoveries", "<u8"),
        ("corrupt", "<u8"),
        ("rejected", "<u8"),
        ("verifications", "<u8"),
    ]
)
# Keys and states live in their own contiguous arrays (struct of arrays), next to the records.
SLOT_DTYPE = np.dtype(
    [
        ("offset", "<u8"),
        ("length", "<u8"),
        ("span", "<u8"),
        ("gen", "<u8"),
        ("last_access", "<u8"),
        ("checksum", "<u8"),
        ("shape", "<i8", (4,)),
        ("grid", "<i4", (3,)),
        ("owner", "<i4"),
        ("prev", "<i4"),
        ("next", "<i4"),
        ("meta_len", "<u4"),
        ("checked", "<u4"),
        ("dtype", "u1"),
        ("ndim", "u1"),
        ("ref", "u1"),
    ]
)
PIN_DTYPE = np.dtype([("pid", "<i4"), ("slot", "<i4"), ("gen", "<u8")])
# Hot paths read and write header counters through a memoryview (a Python int per access, several times
# cheaper than a numpy field): the 8-byte fields' indices in it.
_HF: dict = dict(HEADER_DTYPE.fields or {})
_H = {f: _HF[f][1] // 8 for f in (HEADER_DTYPE.names or ()) if _HF[f][0].itemsize == 8 and f != "magic"}
H_HITS, H_MISSES, H_CLOCK, H_RECOV, H_GEN = _H["hits"], _H["misses"], _H["clock"], _H["recoveries"], _H["generation"]
H_INSERTS, H_BYTES, H_HINT, H_REJECTED, H_VERIF, H_CORRUPT = (
    _H["inserts"],
    _H["bytes_used"],
    _H["slot_hint"],
    _H["rejected"],
    _H["verifications"],
    _H["corrupt"],
)

DTYPES = ["float32", "float16", "bfloat16", "float64", "uint8", "int32", "int64", "uint16"]
# bfloat16 has no numpy dtype: its bytes are stored and viewed as uint16.
_NUMPY_OF = {"bfloat16": np.dtype("<u2"), **{d: np.dtype(d).newbyteorder("<") for d in DTYPES if d != "bfloat16"}}


class ShmCacheError(RuntimeError):
    pass


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _key_parts(key: bytes | str) -> tuple[int, int]:
    raw = bytes.fromhex(key) if isinstance(key, str) else bytes(key)
    if len(raw) != 16:
        raise ValueError(f"keys are 128-bit (16 bytes / 32 hex digits), got {len(raw)} bytes")
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


def _layout(max_entries: int, max_pins: int) -> dict[str, int]:
    slots = HEADER_BYTES
    pins = _align(slots + max_entries * SLOT_DTYPE.itemsize)
    keys = _align(pins + max_pins * PIN_DTYPE.itemsize)
    state = _align(keys + 16 * max_entries)
    idx = _align(state + max_entries)
    data = _align(idx + hindex.region_bytes(max_entries))
    return {"slots": slots, "pins": pins, "keys": keys, "state": state, "index": idx, "data": data}


def metadata_bytes(max_entries: int = 65536, max_pins: int = 4096) -> int:
    """Bytes of a segment before its data arena: size a segment as this plus the arena wanted."""
    return _layout(max_entries, max_pins)["data"]


@dataclass
class Entry:
    """A READY entry pinned by this process. `array` is a read-only zero-copy view into shared memory,
    valid until `release()` (or the end of a `with` block); `meta` is a private copy of its metadata blob
    (None when it was stored without one)."""

    array: np.ndarray
    dtype: str
    grid_thw: tuple[int, int, int]
    _cache: "ShmCache | None"
    _pin: int
    meta: bytes | None = None

    def release(self) -> None:
        if self._cache is not None:
            self._cache._unpin(self._pin)
            self._cache = None
            self.array = None  # type: ignore[assignment]

    def __enter__(self) -> "Entry":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):  # a forgotten release must not pin the entry forever
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ShmCache:
    """Open (create or attach) with `ShmCache.open(name, size_bytes)`; see the module docstring."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, created: bool, verify_sample_rate: float = 0.01):
        if not 0.0 <= verify_sample_rate <= 1.0:
            raise ValueError(f"verify_sample_rate must be in [0, 1], got {verify_sample_rate}")
        self.name = name
        self.created = created
        self.verify_sample_rate = verify_sample_rate
        self._rng = random.Random()
        self._fd = fd
        self._mm = mm
        self._tlock = threading.RLock()
        buf = memoryview(mm)
        self._buf = buf
        self._hdr = np.frombuffer(buf, HEADER_DTYPE, 1, 0)[0:1]
        h = self._hdr[0]
        n = int(h["max_entries"])
        self.max_entries = n
        self._slots = np.frombuffer(buf, SLOT_DTYPE, n, int(h["slots_offset"]))
        self._pins = np.frombuffer(buf, PIN_DTYPE, int(h["max_pins"]), int(h["pins_offset"]))
        self._key_lo = np.frombuffer(buf, "<u8", n, int(h["keys_offset"]))
        self._key_hi = np.frombuffer(buf, "<u8", n, int(h["keys_offset"]) + 8 * n)
        self._state = np.frombuffer(buf, "u1", n, int(h["state_offset"]))
        self._st = buf[int(h["state_offset"]) : int(h["state_offset"]) + n]  # fast scalar reads
        self._index = HashIndex(buf, int(h["index_offset"]), n, int(h["keys_offset"]))
        self._data_offset = int(h["data_offset"])
        self.data_size = int(h["data_size"])
        self._pid = os.getpid()
        self._pin_hint = 0
        # Views for the hot paths (lookups, reads, puts): one per slot column and pin column, and the header
        # as machine words; numpy structured-field access would cost a view per access.
        self._col = {f: self._slots[f] for f in (SLOT_DTYPE.names or ())}
        self._pin_pid, self._pin_slot, self._pin_gen = self._pins["pid"], self._pins["slot"], self._pins["gen"]
        d = _HF["dirty"][1]
        self._dirty = buf[d : d + 4].cast("I")
        self._hq = buf[: HEADER_DTYPE.itemsize].cast("Q")

    # ------------------------------------------------------------------ open / close
    @staticmethod
    def path_of(name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid shared-memory name {name!r}")
        return f"/dev/shm/{name}"

    @classmethod
    def open(
        cls,
        name: str,
        size_bytes: int,
        max_entries: int = 65536,
        max_pins: int = 4096,
        attach_timeout_s: float = 10.0,
        verify_sample_rate: float = 0.01,
    ) -> "ShmCache":
        """Creates the segment, or attaches when another process created it first (its size and slot count
        win). `verify_sample_rate`: the share of this process's reads that re-check an entry's hash even
        though nothing suggests it is broken (see the module docstring)."""
        path = cls.path_of(name)
        if max_entries < 1 or max_pins < 1 or max_entries >= 1 << 31:
            raise ValueError(f"max_entries must be in [1, 2**31) and max_pins >= 1, got {max_entries}, {max_pins}")
        layout_min = metadata_bytes(max_entries, max_pins)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:  # attaching: the creator's size and slot count apply, not ours
            fd = os.open(path, os.O_RDWR)
            created = False
        try:
            if created and size_bytes < layout_min + (1 << 20):
                os.unlink(path)
                raise ValueError(
                    f"shm cache size {size_bytes} is too small: at least {layout_min + (1 << 20)} "
                    f"bytes for {max_entries} entries and 1 MiB of data"
                )
            if created:
                cls._initialise(fd, path, size_bytes, max_entries, max_pins)
            else:
                cls._wait_initialised(fd, path, attach_timeout_s)
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, created, verify_sample_rate)

    @staticmethod
    def _initialise(fd: int, path: str, size: int, max_entries: int, max_pins: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            free = os.statvfs("/dev/shm")
            avail = free.f_bavail * free.f_frsize
            if size > avail:
                raise ShmCacheError(
                    f"shm cache of {size} bytes does not fit in /dev/shm ({avail} bytes free); "
                    "lower --shm-cache-bytes or enlarge /dev/shm"
                )
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise ShmCacheError(f"cannot reserve {size} bytes in /dev/shm for the cache: {e.strerror}") from None
            lay = _layout(max_entries, max_pins)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                buf = memoryview(mm)
                HashIndex.initialise(buf, lay["index"], max_entries)
                hdr = np.frombuffer(buf, HEADER_DTYPE, 1, 0)
                hdr["version"] = 2
                hdr["total_size"] = size
                hdr["slots_offset"] = lay["slots"]
                hdr["pins_offset"] = lay["pins"]
                hdr["keys_offset"] = lay["keys"]
                hdr["state_offset"] = lay["state"]
                hdr["index_offset"] = lay["index"]
                hdr["data_offset"] = lay["data"]
                hdr["data_size"] = (size - lay["data"]) // ALIGN * ALIGN
                hdr["max_entries"] = max_entries
                hdr["max_pins"] = max_pins
                hdr["hand_next"] = hdr["lhead"] = hdr["ltail"] = NIL
                hdr["magic"] = MAGIC  # last: attachers wait for it
                del hdr
                buf.release()
            finally:
                mm.close()
        except BaseException:
            os.unlink(path)
            raise
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    @staticmethod
    def _wait_initialised(fd: int, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.fstat(fd).st_size >= HEADER_BYTES:
                    magic = os.pread(fd, 8, 0)
                    if magic == MAGIC:
                        return
                    if magic in OLD_MAGICS:
                        raise ShmCacheError(
                            f"{path} was created by an older mimo-epd (layout {magic.decode()}); "
                            "stop the processes using it and remove it"
                        )
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                raise ShmCacheError(f"{path} exists but was never initialised (a creator died?); remove it and retry")
            time.sleep(0.01)

    def close(self) -> None:
        if self._mm is None:
            return
        self._index.release()
        for mv in (self._st, self._dirty, self._hq):
            mv.release()
        for name in (
            "_hdr",
            "_slots",
            "_pins",
            "_key_lo",
            "_key_hi",
            "_state",
            "_index",
            "_st",
            "_col",
            "_pin_pid",
            "_pin_slot",
            "_pin_gen",
            "_dirty",
            "_hq",
        ):
            setattr(self, name, None)
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:  # entries still exported to callers: leave the mapping to the GC
            pass
        os.close(self._fd)
        self._mm = None  # type: ignore[assignment]

    def unlink(self) -> None:
        """Removes the segment name (processes that have it open keep their mapping)."""
        try:
            os.unlink(self.path_of(self.name))
        except FileNotFoundError:
            pass

    def __enter__(self) -> "ShmCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ locking
    @contextmanager
    def _critical(self):
        self._lock()
        ok = False
        try:
            yield self._hdr
            ok = True
        finally:
            self._unlock(ok)

    # The same as `with self._critical()`, for the hot paths (a generator context manager costs microseconds).
    def _lock(self) -> None:
        self._tlock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._tlock.release()
            raise
        try:
            if self._dirty[0]:
                self._recover()
            self._dirty[0] = 1
        except BaseException:
            self._unlock(False)
            raise

    def _unlock(self, clean: bool) -> None:
        try:
            if clean:
                self._dirty[0] = 0  # only on a clean exit: an exception mid-update leaves it for recovery
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._tlock.release()

    def _recover(self) -> None:
        """Called with the lock held when the last holder died (or raised) mid-update: rebuilds every derived
        structure from the slot records. The bytes are not read here (that would hold every process up for
        as long as hashing the whole arena takes): the epoch advances and each entry is verified on its next
        read."""
        s, state, h = self._slots, self._state, self._hdr
        self._reap_dead_writers_locked(rebuilding=True)
        # Slots with impossible extents, bytes overlapping an earlier slot's, or a key another slot already
        # has are dropped (a READY one counts as corrupt): what is left is a consistent slot table.
        live = np.flatnonzero(state != EMPTY)
        off = s["offset"][live].astype(np.int64)
        span = s["span"][live].astype(np.int64)
        used = s["length"][live].astype(np.int64) + s["meta_len"][live].astype(np.int64)
        drop = (off % ALIGN != 0) | (span < np.maximum(used, 1)) | (off + span > self.data_size)
        ok = np.flatnonzero(~drop)
        order = ok[np.argsort(off[ok], kind="stable")]
        if len(order) > 1:
            ends = np.maximum.accumulate((off + span)[order])
            drop[order[1:]] |= off[order[1:]] < ends[:-1]
        ok = np.flatnonzero(~drop)
        if len(ok):
            keys = np.stack([self._key_lo[live[ok]], self._key_hi[live[ok]]], 1)
            _, first = np.unique(keys, axis=0, return_index=True)
            dup = np.ones(len(ok), bool)
            dup[first] = False
            drop[ok[dup]] = True
        h["corrupt"] += int((drop & (state[live] == READY)).sum())
        state[live[drop]] = EMPTY
        for j in np.nonzero(self._pins["pid"] != 0)[0]:
            if not pid_alive(int(self._pins["pid"][j])):
                self._pins["pid"][j] = 0
        self._rebuild_derived_locked()
        h["recoveries"] += 1  # the epoch: entries verified before it are verified again on their next read

    def _rebuild_derived_locked(self) -> None:
        s, state, h = self._slots, self._state, self._hdr
        live = np.flatnonzero(state != EMPTY)
        live = live[np.argsort(s["offset"][live], kind="stable")]
        unplaced = self._index.rebuild(live)
        if len(unplaced):  # cannot happen at half load; never leave an entry that lookups cannot reach
            state[unplaced] = EMPTY
            live = live[state[live] != EMPTY]
        s["prev"][live] = np.concatenate([[NIL], live[:-1]]) if len(live) else []
        s["next"][live] = np.concatenate([live[1:], [NIL]]) if len(live) else []
        h["lhead"] = int(live[0]) if len(live) else NIL
        h["ltail"] = int(live[-1]) if len(live) else NIL
        ends = s["offset"][live].astype(np.int64) + s["span"][live].astype(np.int64)
        k = int(np.searchsorted(ends, int(h["hand"][0]), side="right"))  # the first entry not wholly before it
        h["hand_next"] = int(live[k]) if k < len(live) else NIL
        ready = state == READY
        h["bytes_used"] = int(s["length"][ready].sum() + s["meta_len"][ready].sum())

    # ------------------------------------------------------------------ slots
    def _free_slot_locked(self, i: int) -> None:
        """EMPTY, out of the index and the address list. The one way a slot is given up (outside recovery)."""
        h, s = self._hdr, self._col
        self._index.remove(i)
        p, n = int(s["prev"][i]), int(s["next"][i])
        if p != NIL:
            s["next"][p] = n
        else:
            h["lhead"] = n
        if n != NIL:
            s["prev"][n] = p
        else:
            h["ltail"] = p
        if int(h["hand_next"][0]) == i:
            h["hand_next"] = n
        self._st[i] = EMPTY
        self._hq[H_HINT] = i

    def _evict_locked(self, i: int) -> None:
        if self._st[i] == READY:
            self._hdr["evictions"] += 1
            self._hq[H_BYTES] -= int(self._col["length"][i]) + int(self._col["meta_len"][i])
        self._free_slot_locked(i)

    def _find_free_slot_locked(self) -> int:
        n = self.max_entries
        hint = self._hq[H_HINT] % n
        if self._st[hint] == EMPTY:
            return hint
        for a in list(range(hint, n, 4096)) + list(range(0, hint, 4096)):
            free = np.flatnonzero(self._state[a : min(a + 4096, n)] == EMPTY)
            if len(free):
                return a + int(free[0])
        return -1

    def _lookup(self, lo: int, hi: int) -> tuple[int, int]:
        """(slot, state) of a key, (-1, EMPTY) when absent."""
        i = self._index.find(lo, hi)
        return (i, self._st[i]) if i >= 0 else (-1, EMPTY)

    # ------------------------------------------------------------------ lookups
    def contains(self, key: bytes | str) -> bool:
        lo, hi = _key_parts(key)
        self._lock()
        try:
            found = self._lookup(lo, hi)[1] == READY
        except BaseException:
            self._unlock(False)
            raise
        self._unlock(True)
        return found

    def get(self, key: bytes | str, verify: bool | None = None) -> Entry | None:
        """Pins and returns the entry, or None. `verify`: None checks the bytes against their hash when the
        entry was not verified since the last recovery or on a `verify_sample_rate` sample of reads; True
        always; False never. An entry that fails is dropped and reported as a miss; it is never served."""
        lo, hi = _key_parts(key)
        hq, col = self._hq, self._col
        self._lock()
        try:
            i, st = self._lookup(lo, hi)
            if st != READY:
                hq[H_MISSES] += 1
                self._unlock(True)
                return None
            epoch = hq[H_RECOV] & 0xFFFFFFFF
            if verify is None:
                verify = int(col["checked"][i]) != epoch or (
                    self.verify_sample_rate > 0 and self._rng.random() < self.verify_sample_rate
                )
            pin = self._take_pin_locked(i)
            if pin < 0:  # every pin record is held: serve a private copy instead of a view
                e = self._copy_entry_locked(i, verify)
                hq[H_HITS if e is not None else H_MISSES] += 1
                self._unlock(True)
                return e
            ref = col["ref"]
            if ref[i] < MAX_REF:
                ref[i] += 1
            hq[H_CLOCK] += 1
            col["last_access"][i] = hq[H_CLOCK]
            hq[H_HITS] += 1
            off, n, m = int(col["offset"][i]), int(col["length"][i]), int(col["meta_len"][i])
            dt, ndim = int(col["dtype"][i]), int(col["ndim"][i])
            shape, grid = col["shape"][i].tolist(), tuple(col["grid"][i].tolist())
            crc, gen = int(col["checksum"][i]), int(col["gen"][i])
        except BaseException:
            self._unlock(False)
            raise
        self._unlock(True)
        start = self._data_offset + off
        if verify:  # outside the lock: the pin keeps the bytes in place
            ok = xxhash.xxh3_64_intdigest(self._buf[start : start + n + m]) == crc
            with self._critical() as h:
                h["verifications"] += 1
                live = int(self._slots["gen"][i]) == gen and self._st[i] == READY
                if ok and live:
                    self._slots["checked"][i] = epoch
                elif not ok:
                    if live:
                        self._pins["pid"][pin] = 0
                        self._evict_locked(i)
                        h["evictions"] -= 1  # dropped as corrupt, not evicted
                    h["corrupt"] += 1
                    h["hits"] -= 1
                    h["misses"] += 1
            if not ok:
                self._unpin(pin)
                return None
        meta = bytes(self._buf[start + n : start + n + m]) if m else None
        name = DTYPES[dt]
        arr = np.frombuffer(self._buf, _NUMPY_OF[name], n // _NUMPY_OF[name].itemsize, start).reshape(shape[:ndim])
        arr.flags.writeable = False
        return Entry(arr, name, grid, self, pin, meta)

    def _copy_entry_locked(self, i: int, verify: bool) -> Entry | None:
        s = self._slots[i]
        name = DTYPES[int(s["dtype"])]
        start, n, m = self._data_offset + int(s["offset"]), int(s["length"]), int(s["meta_len"])
        raw = bytes(self._buf[start : start + n + m])
        if verify and xxhash.xxh3_64_intdigest(raw) != int(s["checksum"]):
            self._hdr["corrupt"] += 1
            self._evict_locked(i)
            self._hdr["evictions"] -= 1  # dropped as corrupt, not evicted
            return None
        arr = np.frombuffer(raw[:n], _NUMPY_OF[name]).reshape(tuple(s["shape"][: int(s["ndim"])]))
        gt, gh, gw = (int(x) for x in s["grid"])
        return Entry(arr, name, (gt, gh, gw), None, -1, raw[n:] if m else None)

    def _take_pin_locked(self, slot: int) -> int:
        pid = self._pin_pid
        j = self._pin_hint
        if pid[j] != 0:
            free = np.flatnonzero(pid == 0)
            if not len(free):
                for k in range(len(pid)):
                    if not pid_alive(int(pid[k])):
                        pid[k] = 0
                free = np.flatnonzero(pid == 0)
                if not len(free):
                    return -1
            j = int(free[0])
        self._pin_slot[j] = slot
        self._pin_gen[j] = self._col["gen"][slot]
        pid[j] = self._pid
        self._pin_hint = (j + 1) % len(pid)
        return j

    def _unpin(self, pin: int) -> None:
        if pin < 0 or self._mm is None:
            return
        self._lock()
        try:
            if self._pin_pid[pin] == self._pid:
                self._pin_pid[pin] = 0
                self._pin_hint = pin
        finally:
            self._unlock(True)

    # ------------------------------------------------------------------ insertion
    def put(
        self,
        key: bytes | str,
        array: np.ndarray,
        grid_thw: tuple[int, int, int] = (0, 0, 0),
        dtype: str | None = None,
        meta: bytes | None = None,
    ) -> bool:
        """Stores a copy of `array` (and `meta`, a small blob returned with every hit as `Entry.meta`) under
        `key`. Returns False when the entry cannot be placed (larger than the arena, every candidate byte
        pinned or being written, or every slot pinned or being written). Entries are immutable: putting an
        existing key only refreshes it. `dtype="bfloat16"` stores a uint16 array's bytes as bfloat16."""
        lo, hi = _key_parts(key)
        arr = np.ascontiguousarray(array)
        name = dtype or arr.dtype.name
        if name not in _NUMPY_OF:
            raise ValueError(f"unsupported dtype {name!r}; supported: {DTYPES}")
        if arr.ndim > 4:
            raise ValueError(f"at most 4 dimensions, got {arr.ndim}")
        if _NUMPY_OF[name].itemsize != arr.dtype.itemsize:
            raise ValueError(f"array of {arr.dtype} cannot be stored as {name}")
        meta = bytes(meta) if meta else b""
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"metadata of {len(meta)} bytes is over the limit of {MAX_META_BYTES}")
        n, m = arr.nbytes, len(meta)
        shape = list(arr.shape) + [0] * (4 - arr.ndim)
        grid = [int(x) for x in grid_thw]
        col, hq = self._col, self._hq
        with self._critical():
            i, st = self._lookup(lo, hi)
            if st == READY:
                if col["ref"][i] < MAX_REF:
                    col["ref"][i] += 1
                return True
            if st == WRITING:
                if pid_alive(int(col["owner"][i])):
                    return False  # another (live) process is writing the same content right now
                self._free_slot_locked(i)  # its writer died mid-copy: the bytes were never visible
            i = self._find_free_slot_locked()
            if i < 0 and self._evict_one_locked():
                i = self._find_free_slot_locked()
            span = _align(max(n + m, 1))
            off = self._allocate_locked(span, i) if i >= 0 else None
            if off is None:
                hq[H_REJECTED] += 1
                return False
            hq[H_GEN] += 1
            gen = hq[H_GEN]
            self._key_lo[i], self._key_hi[i] = lo, hi
            col["length"][i], col["meta_len"][i] = n, m
            col["gen"][i], col["owner"][i], col["ref"][i] = gen, self._pid, 0
            col["dtype"][i], col["ndim"][i] = DTYPES.index(name), arr.ndim
            col["shape"][i], col["grid"][i] = shape, grid
            self._st[i] = WRITING  # before the index: the slot is complete before anyone can find it
            if not self._index.insert(lo, hi, i):
                self._free_slot_locked(i)
                hq[H_REJECTED] += 1
                return False
            hq[H_HINT] = (i + 1) % self.max_entries
        # The copy and the hash run without the lock; no one reads a WRITING slot.
        start = self._data_offset + off
        dst = np.frombuffer(self._buf, np.uint8, n + m, start)
        dst[:n] = arr.reshape(-1).view(np.uint8)
        if m:
            dst[n:] = np.frombuffer(meta, np.uint8)
        digest = xxhash.xxh3_64_intdigest(self._buf[start : start + n + m])
        with self._critical():
            if self._st[i] != WRITING or int(col["gen"][i]) != gen:
                return False  # reclaimed meanwhile (cannot happen while we live; defensive)
            col["checksum"][i] = digest
            col["checked"][i] = hq[H_RECOV] & 0xFFFFFFFF  # hashed from what was just written
            hq[H_CLOCK] += 1
            col["last_access"][i] = hq[H_CLOCK]
            self._st[i] = READY
            hq[H_INSERTS] += 1
            hq[H_BYTES] += n + m
        return True

    def _reap_dead_writers_locked(self, rebuilding: bool = False) -> None:
        """Frees WRITING slots whose writer died mid-copy (their bytes were never visible). O(slots): only
        stats and recovery call it; put and the hand free the ones they meet. `rebuilding`: recovery rebuilds
        the index and the address list afterwards, so only the state changes."""
        s = self._slots
        for i in np.flatnonzero(self._state == WRITING):
            if not pid_alive(int(s["owner"][i])):
                if rebuilding:
                    self._state[i] = EMPTY
                else:
                    self._free_slot_locked(int(i))

    def _start(self, i: int) -> int:
        return int(self._col["offset"][i])

    def _end(self, i: int) -> int:
        return int(self._col["offset"][i]) + int(self._col["span"][i])

    def _evict_one_locked(self) -> bool:
        """The slot table is full: the CLOCK hand frees the first entry it may, and stays at its bytes."""
        h, s = self._hdr, self._slots
        c, wraps = int(h["hand_next"][0]), 0
        while wraps <= MAX_REF + 1:
            if c == NIL:
                wraps += 1
                c = int(h["lhead"][0])
                if c == NIL:
                    return False
                continue
            if not self._blocks_locked(c):
                h["hand"], h["hand_next"] = self._start(c), c  # freeing c moves hand_next to its successor
                self._evict_locked(c)
                return True
            c = int(s["next"][c])
        return False

    def _allocate_locked(self, need: int, slot: int) -> int | None:
        """CLOCK over the arena's address space: finds `need` bytes at or after the hand (wrapping), evicts
        the entries there, links `slot` into the address list at that place and returns its offset."""
        size = self.data_size
        if need > size:
            return None
        h, s = self._hdr, self._col
        pos, c = int(h["hand"][0]), int(h["hand_next"][0])
        wraps = 0
        while True:
            if pos + need > size:
                wraps += 1
                if wraps > MAX_REF + 1:  # every counter has reached zero by then: only pins/writers block
                    return None
                pos, c = 0, int(h["lhead"][0])
            k, blocker, under = c, NIL, []
            while k != NIL and self._start(k) < pos + need:
                if self._blocks_locked(k):
                    blocker = k
                    break
                under.append(k)
                k = int(s["next"][k])
            if blocker == NIL:
                for u in under:
                    self._evict_locked(u)
                prev = int(s["prev"][k]) if k != NIL else int(h["ltail"][0])
                s["offset"][slot], s["span"][slot] = pos, need
                s["prev"][slot], s["next"][slot] = prev, k
                if prev != NIL:
                    s["next"][prev] = slot
                else:
                    h["lhead"] = slot
                if k != NIL:
                    s["prev"][k] = slot
                else:
                    h["ltail"] = slot
                h["hand"], h["hand_next"] = pos + need, k
                return pos
            pos, c = self._end(blocker), int(s["next"][blocker])

    def _blocks_locked(self, i: int) -> bool:
        """Whether slot i's bytes must not be reused now; a used entry spends one unit of its counter."""
        s = self._slots
        if self._st[i] == WRITING:
            return pid_alive(int(s["owner"][i]))  # a dead writer's bytes were never visible: reusable
        p = self._pins
        held = np.flatnonzero((p["pid"] != 0) & (p["slot"] == i) & (p["gen"] == s["gen"][i]))
        for j in held:
            if pid_alive(int(p["pid"][j])):
                return True
            p["pid"][j] = 0
        if s["ref"][i]:
            s["ref"][i] -= 1
            return True
        return False

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        with self._critical() as h:
            self._reap_dead_writers_locked()
            st = self._state
            return {
                "hits": int(h["hits"][0]),
                "misses": int(h["misses"][0]),
                "inserts": int(h["inserts"][0]),
                "evictions": int(h["evictions"][0]),
                "bytes_used": int(h["bytes_used"][0]),
                "capacity_bytes": self.data_size,
                "entries": int((st == READY).sum()),
                "max_entries": self.max_entries,
                "writing": int((st == WRITING).sum()),
                "pinned": int((self._pins["pid"] != 0).sum()),
                "recoveries": int(h["recoveries"][0]),
                "corrupt_dropped": int(h["corrupt"][0]),
                "rejected": int(h["rejected"][0]),
                "verifications": int(h["verifications"][0]),
                "index_tombstones": int(self._index.counts[1]),
            }
