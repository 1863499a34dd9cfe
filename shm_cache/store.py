"""A node-local embedding store in POSIX shared memory, shared by every encoder process of a node.

Any number of processes read and write at once. Needs only numpy and the standard library.

Layout of the segment `/dev/shm/<name>` (mode 0600, fixed size, preallocated so a full tmpfs fails
at creation with a clear error, not later with SIGBUS):

    [ header (4 KiB) | slot table (max_entries records) | pin table (max_pins records) | data arena ]

- A *slot* describes one entry: 128-bit key, state (EMPTY / WRITING / READY), where its bytes are in
  the arena, their CRC32, dtype, shape, grid_thw, and a CLOCK reference bit.
- A *pin* records that process `pid` holds a zero-copy view of slot `s` (generation `g`). A pinned
  entry is never evicted, so the view stays valid until the reader releases it.
- The arena is allocated contiguously by a CLOCK hand sweeping the address space: the bytes under the
  hand are reused if their entries are neither pinned, nor being written, nor recently used. Each use
  adds one to an entry's counter (saturating at 3, "generalised CLOCK"); the hand takes one off and
  skips the entry while it is above zero, so frequently used entries survive several sweeps (better
  than plain LRU/CLOCK on Zipf-like traffic). Eviction is by bytes.

Concurrency: every metadata change happens under an exclusive `flock` on the segment (plus a thread
lock, because flock does not exclude threads sharing a descriptor). Large copies happen outside it:
`put` reserves space and a WRITING slot, copies and checksums without the lock, then publishes the
slot as READY. Readers only ever see READY slots, so no reader sees a partial entry.

Crash safety (a process SIGKILLed anywhere):
- the kernel drops a dead process's flock, so nobody deadlocks;
- a `dirty` flag is set while metadata is being changed; whoever next takes the lock and finds it set
  runs recovery: WRITING slots of dead writers are freed, every READY entry's CRC32 is verified
  (a mismatch is dropped, never served), pins of dead processes are cleared, byte counts recomputed;
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
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

MAGIC = b"MIMOSHM1"
HEADER_BYTES = 4096
ALIGN = 64
EMPTY, WRITING, READY = 0, 1, 2
MAX_REF = 3  # GCLOCK: a saturating use counter; the hand decrements it and evicts at zero

HEADER_DTYPE = np.dtype([
    ("magic", "S8"), ("version", "<u4"), ("dirty", "<u4"),
    ("total_size", "<u8"), ("data_offset", "<u8"), ("data_size", "<u8"),
    ("max_entries", "<u8"), ("max_pins", "<u8"), ("slots_offset", "<u8"), ("pins_offset", "<u8"),
    ("keys_offset", "<u8"), ("state_offset", "<u8"),
    ("hand", "<u8"), ("clock", "<u8"), ("generation", "<u8"),
    ("hits", "<u8"), ("misses", "<u8"), ("inserts", "<u8"), ("evictions", "<u8"), ("bytes_used", "<u8"),
    ("recoveries", "<u8"), ("corrupt", "<u8"), ("rejected", "<u8"),
])
# Keys and states live in their own contiguous arrays (struct of arrays): a lookup scans 8 bytes
# per slot, not a whole record.
SLOT_DTYPE = np.dtype([
    ("offset", "<u8"), ("length", "<u8"), ("gen", "<u8"),
    ("last_access", "<u8"), ("shape", "<i8", (4,)), ("grid", "<i4", (3,)), ("owner", "<i4"), ("checksum", "<u4"),
    ("dtype", "u1"), ("ndim", "u1"), ("ref", "u1"),
])
PIN_DTYPE = np.dtype([("pid", "<i4"), ("slot", "<i4"), ("gen", "<u8")])

DTYPES = ["float32", "float16", "bfloat16", "float64", "uint8", "int32", "int64", "uint16"]
# bfloat16 has no numpy dtype: its bytes are stored and viewed as uint16.
_NUMPY_OF = {"bfloat16": np.dtype("<u2"), **{d: np.dtype(d).newbyteorder("<") for d in DTYPES if d != "bfloat16"}}


class ShmCacheError(RuntimeError):
    pass


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _key_parts(key: bytes | str) -> tuple[np.uint64, np.uint64]:
    raw = bytes.fromhex(key) if isinstance(key, str) else bytes(key)
    if len(raw) != 16:
        raise ValueError(f"keys are 128-bit (16 bytes / 32 hex digits), got {len(raw)} bytes")
    # numpy scalars: comparing a uint64 array with a Python int above 2**63 would go through objects.
    return np.uint64(int.from_bytes(raw[:8], "little")), np.uint64(int.from_bytes(raw[8:], "little"))


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


@dataclass
class Entry:
    """A READY entry pinned by this process. `array` is a read-only zero-copy view into shared memory,
    valid until `release()` (or the end of a `with` block)."""

    array: np.ndarray
    dtype: str
    grid_thw: tuple[int, int, int]
    _cache: "ShmCache | None"
    _pin: int

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

    def __init__(self, name: str, fd: int, mm: mmap.mmap, created: bool):
        self.name = name
        self.created = created
        self._fd = fd
        self._mm = mm
        self._tlock = threading.RLock()
        buf = memoryview(mm)
        self._buf = buf
        self._hdr = np.frombuffer(buf, HEADER_DTYPE, 1, 0)[0:1]
        h = self._hdr[0]
        self._slots = np.frombuffer(buf, SLOT_DTYPE, int(h["max_entries"]), int(h["slots_offset"]))
        self._pins = np.frombuffer(buf, PIN_DTYPE, int(h["max_pins"]), int(h["pins_offset"]))
        n = int(h["max_entries"])
        self._key_lo = np.frombuffer(buf, "<u8", n, int(h["keys_offset"]))
        self._key_hi = np.frombuffer(buf, "<u8", n, int(h["keys_offset"]) + 8 * n)
        self._state = np.frombuffer(buf, "u1", n, int(h["state_offset"]))
        self._data_offset = int(h["data_offset"])
        self.data_size = int(h["data_size"])
        self._pid = os.getpid()

    # ------------------------------------------------------------------ open / close
    @staticmethod
    def path_of(name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid shared-memory name {name!r}")
        return f"/dev/shm/{name}"

    @classmethod
    def open(cls, name: str, size_bytes: int, max_entries: int = 65536, max_pins: int = 4096,
             attach_timeout_s: float = 10.0) -> "ShmCache":
        """Creates the segment, or attaches when another process created it first (its size wins)."""
        path = cls.path_of(name)
        layout_min = HEADER_BYTES + max_entries * (SLOT_DTYPE.itemsize + 17) + max_pins * PIN_DTYPE.itemsize + 4 * ALIGN
        if size_bytes < layout_min + (1 << 20):
            raise ValueError(f"shm cache size {size_bytes} is too small: at least {layout_min + (1 << 20)} bytes "
                             f"for {max_entries} entries and 1 MiB of data")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            created = False
        try:
            if created:
                cls._initialise(fd, path, size_bytes, max_entries, max_pins)
            else:
                cls._wait_initialised(fd, path, attach_timeout_s)
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, created)

    @staticmethod
    def _initialise(fd: int, path: str, size: int, max_entries: int, max_pins: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            free = os.statvfs("/dev/shm")
            avail = free.f_bavail * free.f_frsize
            if size > avail:
                raise ShmCacheError(f"shm cache of {size} bytes does not fit in /dev/shm ({avail} bytes free); "
                                    "lower --shm-cache-bytes or enlarge /dev/shm")
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise ShmCacheError(f"cannot reserve {size} bytes in /dev/shm for the cache: {e.strerror}") from None
            slots_off = HEADER_BYTES
            pins_off = _align(slots_off + max_entries * SLOT_DTYPE.itemsize)
            keys_off = _align(pins_off + max_pins * PIN_DTYPE.itemsize)
            state_off = _align(keys_off + 16 * max_entries)
            data_off = _align(state_off + max_entries)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                hdr = np.frombuffer(mm, HEADER_DTYPE, 1, 0)
                hdr["version"] = 1
                hdr["total_size"] = size
                hdr["slots_offset"] = slots_off
                hdr["pins_offset"] = pins_off
                hdr["keys_offset"] = keys_off
                hdr["state_offset"] = state_off
                hdr["data_offset"] = data_off
                hdr["data_size"] = (size - data_off) // ALIGN * ALIGN
                hdr["max_entries"] = max_entries
                hdr["max_pins"] = max_pins
                hdr["magic"] = MAGIC  # last: attachers wait for it
                del hdr
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
                if os.fstat(fd).st_size >= HEADER_BYTES and os.pread(fd, 8, 0) == MAGIC:
                    return
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                raise ShmCacheError(f"{path} exists but was never initialised (a creator died?); remove it and retry")
            time.sleep(0.01)

    def close(self) -> None:
        if self._mm is None:
            return
        for name in ("_hdr", "_slots", "_pins", "_key_lo", "_key_hi", "_state"):
            setattr(self, name, None)
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:  # entries still exported to callers: leave the mapping to the GC
            pass
        os.close(self._fd)
        self._mm = None

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
        with self._tlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                h = self._hdr
                if h["dirty"][0]:
                    self._recover()
                h["dirty"] = 1
                yield h
                h["dirty"] = 0  # only on a clean exit: an exception mid-update leaves it for recovery
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _recover(self) -> None:
        """Called with the lock held when the last holder died (or raised) mid-update."""
        s, state = self._slots, self._state
        self._reap_dead_writers_locked()
        for i in np.flatnonzero(state == READY):
            off, n = self._data_offset + int(s["offset"][i]), int(s["length"][i])
            if zlib.crc32(self._buf[off:off + n]) != int(s["checksum"][i]):
                state[i] = EMPTY
                self._hdr["corrupt"] += 1
        for j in np.nonzero(self._pins["pid"] != 0)[0]:
            if not pid_alive(int(self._pins["pid"][j])):
                self._pins["pid"][j] = 0
        ready = state == READY
        self._hdr["bytes_used"] = int(s["length"][ready].sum())
        self._hdr["recoveries"] += 1

    # ------------------------------------------------------------------ lookups
    def _find(self, hi: int, lo: int, state: int) -> int:
        for i in np.flatnonzero(self._key_lo == lo):
            if self._key_hi[i] == hi and self._state[i] == state:
                return int(i)
        return -1

    def contains(self, key: bytes | str) -> bool:
        hi, lo = _key_parts(key)
        with self._critical():
            return self._find(hi, lo, READY) >= 0

    def get(self, key: bytes | str, verify: bool = True) -> Entry | None:
        """Pins and returns the entry, or None. With `verify`, the bytes are checked against their CRC32
        first (an entry that fails is dropped and reported as a miss; it is never served)."""
        hi, lo = _key_parts(key)
        with self._critical() as h:
            i = self._find(hi, lo, READY)
            if i < 0:
                h["misses"] += 1
                return None
            pin = self._take_pin_locked(i)
            if pin < 0:  # every pin record is held: serve a private copy instead of a view
                h["hits"] += 1
                return self._copy_entry_locked(i)
            s = self._slots[i]
            s["ref"] = min(int(s["ref"]) + 1, MAX_REF)
            h["clock"] += 1
            s["last_access"] = h["clock"][0]
            h["hits"] += 1
            meta = (int(s["offset"]), int(s["length"]), int(s["dtype"]), int(s["ndim"]), tuple(int(x) for x in s["shape"]),
                    tuple(int(x) for x in s["grid"]), int(s["checksum"]), int(s["gen"]))
        off, n, dt, ndim, shape, grid, crc, gen = meta
        start = self._data_offset + off
        if verify and zlib.crc32(self._buf[start:start + n]) != crc:
            self._unpin(pin)
            with self._critical() as h:
                if int(self._slots["gen"][i]) == gen and self._state[i] == READY:
                    self._state[i] = EMPTY
                    h["bytes_used"] -= n
                h["corrupt"] += 1
                h["hits"] -= 1
                h["misses"] += 1
            return None
        name = DTYPES[dt]
        arr = np.frombuffer(self._buf, _NUMPY_OF[name], n // _NUMPY_OF[name].itemsize, start).reshape(shape[:ndim])
        arr.flags.writeable = False
        return Entry(arr, name, grid, self, pin)

    def _copy_entry_locked(self, i: int) -> Entry:
        s = self._slots[i]
        name = DTYPES[int(s["dtype"])]
        start, n = self._data_offset + int(s["offset"]), int(s["length"])
        arr = np.frombuffer(bytes(self._buf[start:start + n]), _NUMPY_OF[name]).reshape(tuple(s["shape"][: int(s["ndim"])]))
        return Entry(arr, name, tuple(int(x) for x in s["grid"]), None, -1)

    def _take_pin_locked(self, slot: int) -> int:
        p = self._pins
        free = np.flatnonzero(p["pid"] == 0)
        if not len(free):
            for j in range(len(p)):
                if not pid_alive(int(p["pid"][j])):
                    p["pid"][j] = 0
            free = np.flatnonzero(p["pid"] == 0)
            if not len(free):
                return -1
        j = int(free[0])
        p["slot"][j] = slot
        p["gen"][j] = self._slots["gen"][slot]
        p["pid"][j] = self._pid
        return j

    def _unpin(self, pin: int) -> None:
        if pin < 0 or self._mm is None:
            return
        with self._critical():
            if self._pins["pid"][pin] == self._pid:
                self._pins["pid"][pin] = 0

    # ------------------------------------------------------------------ insertion
    def put(self, key: bytes | str, array: np.ndarray, grid_thw: tuple[int, int, int] = (0, 0, 0),
            dtype: str | None = None) -> bool:
        """Stores a copy of `array` under `key`. Returns False when the entry cannot be placed (larger than
        the arena, every candidate byte pinned or being written, or the slot table full).
        Entries are immutable: putting an existing key only refreshes it. `dtype="bfloat16"` stores a
        uint16 array's bytes as bfloat16."""
        hi, lo = _key_parts(key)
        arr = np.ascontiguousarray(array)
        name = dtype or arr.dtype.name
        if name not in _NUMPY_OF:
            raise ValueError(f"unsupported dtype {name!r}; supported: {DTYPES}")
        if arr.ndim > 4:
            raise ValueError(f"at most 4 dimensions, got {arr.ndim}")
        if _NUMPY_OF[name].itemsize != arr.dtype.itemsize:
            raise ValueError(f"array of {arr.dtype} cannot be stored as {name}")
        n = arr.nbytes
        with self._critical() as h:
            i = self._find(hi, lo, READY)
            if i >= 0:
                self._slots["ref"][i] = min(int(self._slots["ref"][i]) + 1, MAX_REF)
                return True
            self._reap_dead_writers_locked()
            if self._find(hi, lo, WRITING) >= 0:
                return False  # another (live) process is writing the same content right now
            free = np.flatnonzero(self._state == EMPTY)
            off = self._allocate_locked(max(n, 1)) if len(free) else None
            if off is None:
                h["rejected"] += 1
                return False
            i = int(free[0])
            s = self._slots[i]
            h["generation"] += 1
            self._key_hi[i], self._key_lo[i] = hi, lo
            s["offset"], s["length"] = off, n
            s["gen"], s["owner"], s["ref"] = h["generation"][0], self._pid, 0
            s["dtype"], s["ndim"] = DTYPES.index(name), arr.ndim
            shape = np.zeros(4, np.int64)
            shape[: arr.ndim] = arr.shape
            s["shape"], s["grid"] = shape, np.asarray(grid_thw, np.int32)
            self._state[i] = WRITING  # last: the slot is complete before anyone can see it
            gen = int(s["gen"])
        # The copy and the checksum run without the lock; no one reads a WRITING slot.
        start = self._data_offset + off
        dst = np.frombuffer(self._buf, np.uint8, n, start)
        dst[:] = arr.reshape(-1).view(np.uint8)
        crc = zlib.crc32(self._buf[start:start + n])
        with self._critical() as h:
            s = self._slots[i]
            if int(self._state[i]) != WRITING or int(s["gen"]) != gen:
                return False  # reclaimed meanwhile (cannot happen while we live; defensive)
            s["checksum"] = crc
            h["clock"] += 1
            s["last_access"] = h["clock"][0]
            self._state[i] = READY
            h["inserts"] += 1
            h["bytes_used"] += n
        return True

    def _reap_dead_writers_locked(self) -> None:
        """Frees WRITING slots whose writer died mid-copy (their bytes were never visible)."""
        s = self._slots
        for i in np.flatnonzero(self._state == WRITING):
            if not pid_alive(int(s["owner"][i])):
                self._state[i] = EMPTY

    def _allocate_locked(self, length: int) -> int | None:
        """CLOCK over the arena's address space; returns an offset or None."""
        need = _align(length)
        size = self.data_size
        if need > size:
            return None
        s = self._slots
        state = self._state
        live = np.flatnonzero(state != EMPTY)
        order = live[np.argsort(s["offset"][live], kind="stable")]
        starts = s["offset"][order].astype(np.int64)
        ends = starts + ((s["length"][order].astype(np.int64) + ALIGN - 1) // ALIGN * ALIGN)
        pos = int(self._hdr["hand"][0])
        j = int(np.searchsorted(ends, pos, side="right"))
        wraps = 0
        while True:
            if pos + need > size:
                wraps += 1
                if wraps > MAX_REF + 1:  # every counter has reached zero by then: only pins/writers block
                    return None
                pos, j = 0, 0
            k, blocker = j, -1
            while k < len(order) and starts[k] < pos + need:
                if self._blocks_locked(int(order[k])):
                    blocker = k
                    break
                k += 1
            if blocker < 0:
                for m in range(j, k):
                    i = int(order[m])
                    if state[i] == READY:
                        self._hdr["evictions"] += 1
                        self._hdr["bytes_used"] -= int(s["length"][i])
                    state[i] = EMPTY
                self._hdr["hand"] = pos + need
                return pos
            pos, j = int(ends[blocker]), blocker + 1

    def _blocks_locked(self, i: int) -> bool:
        """Whether slot i's bytes must not be reused now; a used entry spends one unit of its counter."""
        s = self._slots
        if self._state[i] == WRITING:
            if pid_alive(int(s["owner"][i])):
                return True
            self._state[i] = EMPTY  # a writer died mid-copy: its bytes were never visible
            return False
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
                "hits": int(h["hits"][0]), "misses": int(h["misses"][0]), "inserts": int(h["inserts"][0]),
                "evictions": int(h["evictions"][0]), "bytes_used": int(h["bytes_used"][0]),
                "capacity_bytes": self.data_size, "entries": int((st == READY).sum()),
                "writing": int((st == WRITING).sum()), "pinned": int((self._pins["pid"] != 0).sum()),
                "recoveries": int(h["recoveries"][0]), "corrupt_dropped": int(h["corrupt"][0]),
                "rejected": int(h["rejected"][0]),
            }
