"""shm_cache: real POSIX shared memory, several real processes, SIGKILL in the middle of things."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import time
import uuid
import zlib

import numpy as np
import pytest

from shm_cache import ShmCache, ShmCacheError
from shm_cache.store import WRITING

MB = 1 << 20


@pytest.fixture
def name():
    n = f"mimo-test-{uuid.uuid4().hex[:12]}"
    yield n
    try:
        os.unlink(f"/dev/shm/{n}")
    except FileNotFoundError:
        pass


def key(i: int) -> bytes:
    return int(i).to_bytes(16, "little")


def value(i: int, n_floats: int) -> np.ndarray:
    """Deterministic content derived from the key, so any reader can check what it got."""
    return (
        (np.arange(n_floats, dtype=np.float32) * 0.5 + i).reshape(-1, 4)
        if n_floats % 4 == 0
        else np.arange(n_floats, dtype=np.float32) + i
    )


def test_put_get_roundtrip_zero_copy_and_mode_0600(name):
    with ShmCache.open(name, 8 * MB, max_entries=256) as c:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
        arr = np.random.default_rng(0).standard_normal((391, 256)).astype(np.float32)
        assert c.put(key(1), arr, grid_thw=(1, 34, 46))
        with c.get(key(1)) as e:
            np.testing.assert_array_equal(e.array, arr)
            assert e.grid_thw == (1, 34, 46) and e.dtype == "float32"
            assert not e.array.flags.writeable
            assert not e.array.flags.owndata  # a view into shared memory, not a copy
            assert c.stats()["pinned"] == 1
        assert c.stats()["pinned"] == 0
        assert c.get(key(2)) is None
        st = c.stats()
        assert (st["hits"], st["misses"], st["inserts"], st["entries"]) == (1, 1, 1, 1)
        assert st["bytes_used"] == arr.nbytes
        bf = np.arange(12, dtype=np.uint16).reshape(3, 4)
        assert c.put(key(3), bf, dtype="bfloat16")
        with c.get(key(3).hex()) as e:
            assert e.dtype == "bfloat16" and e.array.dtype == np.uint16
            np.testing.assert_array_equal(e.array, bf)


def test_second_process_attaches_and_sees_entries(name):
    with ShmCache.open(name, 8 * MB, max_entries=256) as a:
        assert a.created
        with ShmCache.open(name, 999 * MB) as b:  # the creator's size wins
            assert not b.created and b.data_size == a.data_size
            assert a.put(key(5), value(5, 64))
            with b.get(key(5)) as e:
                np.testing.assert_array_equal(e.array, value(5, 64))


def test_eviction_by_bytes_never_frees_a_pinned_entry(name):
    with ShmCache.open(name, 2 * MB, max_entries=256) as c:
        held = c.put(key(0), value(0, 4096)) and c.get(key(0))  # 16 KiB, pinned
        for i in range(1, 400):  # 400 * 16 KiB >> 1 MiB of data: forces many evictions
            c.put(key(i), value(i, 4096))
        st = c.stats()
        assert st["evictions"] > 0 and st["bytes_used"] <= c.data_size
        np.testing.assert_array_equal(held.array, value(0, 4096))  # still intact
        assert c.contains(key(0))
        held.release()
        for i in range(400, 800):
            c.put(key(i), value(i, 4096))
        assert not c.contains(key(0))  # evictable once released


def test_clock_keeps_recently_used_entries(name):
    with ShmCache.open(name, 2 * MB, max_entries=512) as c:
        n = 16 * 1024 // 4
        for i in range(40):
            c.put(key(i), value(i, n))
        hot = [3, 7, 11]
        for _ in range(30):  # touch the hot set while streaming new entries through
            for h in hot:
                e = c.get(key(h))
                if e is None:
                    c.put(key(h), value(h, n))
                else:
                    e.release()
            for i in range(1000 + _ * 10, 1010 + _ * 10):
                c.put(key(i), value(i, n))
        assert all(c.contains(key(h)) for h in hot)


def test_oversized_entry_rejected_and_bad_inputs(name):
    with ShmCache.open(name, 2 * MB, max_entries=64) as c:
        assert not c.put(key(1), np.zeros(4 * MB, np.uint8))
        assert c.stats()["rejected"] == 1
        with pytest.raises(ValueError, match="128-bit"):
            c.put(b"short", np.zeros(4))
        with pytest.raises(ValueError, match="unsupported dtype"):
            c.put(key(2), np.zeros(4, np.complex64))


def test_size_that_does_not_fit_is_a_clear_error(name):
    free = os.statvfs("/dev/shm")
    with pytest.raises(ShmCacheError, match="does not fit in /dev/shm"):
        ShmCache.open(name, free.f_bavail * free.f_frsize + 1024 * MB)
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(ValueError, match="too small"):
        ShmCache.open(name, 4096)


def _flip_first_byte(c: ShmCache, k: bytes) -> None:
    """Corrupts an entry behind the cache's back (a stray write into the segment)."""
    i = c._index.find(*__import__("shm_cache.store", fromlist=["_key_parts"])._key_parts(k))
    off = c._data_offset + int(c._slots["offset"][i])
    c._buf[off] = (c._buf[off] + 1) % 256


def test_corrupted_bytes_are_never_served_when_verified(name):
    with ShmCache.open(name, 4 * MB, max_entries=64, verify_sample_rate=0.0) as c:
        c.put(key(1), value(1, 1024))
        _flip_first_byte(c, key(1))
        assert c.get(key(1), verify=True) is None
        st = c.stats()
        assert st["corrupt_dropped"] == 1 and not c.contains(key(1)) and st["evictions"] == 0
        assert (st["hits"], st["misses"], st["entries"], st["bytes_used"]) == (0, 1, 0, 0)
        c.put(key(2), value(2, 1024))
        _flip_first_byte(c, key(2))
        with c.get(key(2)) as e:  # freshly written and no recovery since: not re-hashed (rate 0)
            assert e is not None
    with ShmCache.open(name, 4 * MB, verify_sample_rate=1.0) as c:  # a process sampling every read
        assert c.get(key(2)) is None and c.stats()["corrupt_dropped"] == 2


def test_after_a_recovery_every_entry_is_verified_on_its_first_read(name):
    with ShmCache.open(name, 8 * MB, max_entries=256, verify_sample_rate=0.0) as c:
        for i in range(20):
            assert c.put(key(i), value(i, 256), meta=f"m{i}".encode())
        _flip_first_byte(c, key(3))
        c._hdr["dirty"] = 1  # as if a process had died inside the lock
        assert c.get(key(0)).array is not None  # the lock holder recovers, then verifies what it reads
        st = c.stats()
        assert st["recoveries"] == 1 and st["verifications"] == 1
        assert c.get(key(3)) is None and c.stats()["corrupt_dropped"] == 1  # first read after it: checked
        for i in range(20):
            if i != 3:
                with c.get(key(i)) as e:
                    np.testing.assert_array_equal(e.array, value(i, 256))
                    assert e.meta == f"m{i}".encode()
        assert c.stats()["verifications"] == 20
        for i in range(20):  # verified since the recovery: no second hash
            if i != 3:
                c.get(key(i)).release()
        assert c.stats()["verifications"] == 20


# --------------------------------------------------------------------------- key index
def test_index_stays_exact_under_churn_with_tombstones_and_bounded_probes(name):
    """Thousands of puts through a small slot table: every eviction leaves a tombstone, the table is rebuilt
    when they pile up; every live key is found in at most MAX_PROBE buckets, every evicted one is a miss."""

    with ShmCache.open(name, 4 * MB, max_entries=512) as c:
        live_keys = {}
        for i in range(6000):
            assert c.put(key(i), value(i, 16 * (1 + i % 5)))
            if i % 500 == 499:
                assert c._index.verify(np.flatnonzero(c._state != 0))
        st = c.stats()
        assert st["evictions"] > 5000 and st["rejected"] == 0 and st["entries"] <= 512
        assert st["index_tombstones"] <= c._index.capacity // 4
        for i in range(6000):
            e = c.get(key(i))
            if e is not None:
                live_keys[i] = e.array.size
                np.testing.assert_array_equal(e.array, value(i, e.array.size))
                e.release()
        assert len(live_keys) == c.stats()["entries"] > 0
        assert set(int(k) for k in c._key_lo[c._state == 2]) == set(live_keys)
        t = c._index.table
        assert (t >= 0).sum() == len(live_keys)


def test_slot_table_full_evicts_by_slots_not_only_by_bytes(name):
    with ShmCache.open(name, 8 * MB, max_entries=16) as c:  # bytes for thousands of entries, 16 slots
        for i in range(200):
            assert c.put(key(i), value(i, 64))
        st = c.stats()
        assert st["entries"] == 16 and st["evictions"] == 184 and st["rejected"] == 0
        assert c.contains(key(199)) and not c.contains(key(0))


def _index_scribbler(name: str, started) -> None:
    """Dies inside the lock halfway through rewriting the key index (every other bucket overwritten)."""
    c = ShmCache.open(name, 16 * MB, max_entries=1024)
    with c._critical():
        c._index.table[::2] = -2  # tombstones where live buckets were
        c._index.table[1::4] = 7  # and wrong slot numbers
        started.set()
        time.sleep(60)


def test_process_killed_mid_index_update_recovery_rebuilds_the_index(name):
    with ShmCache.open(name, 16 * MB, max_entries=1024) as c:
        for i in range(600):
            c.put(key(i), value(i, 64))
        ctx = mp.get_context("spawn")
        started = ctx.Event()
        p = ctx.Process(target=_index_scribbler, args=(name, started))
        p.start()
        assert started.wait(60)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        for i in range(600):  # the next lock holder recovers: every entry found again, intact
            with c.get(key(i)) as e:
                np.testing.assert_array_equal(e.array, value(i, 64))
        assert c.get(key(600)) is None
        st = c.stats()
        assert st["recoveries"] == 1 and st["entries"] == 600 and st["corrupt_dropped"] == 0
        assert c._index.verify(np.flatnonzero(c._state != 0))


def test_recovery_drops_slots_with_overlapping_bytes(name):
    with ShmCache.open(name, 8 * MB, max_entries=64, verify_sample_rate=0.0) as c:
        for i in range(3):
            c.put(key(i), value(i, 256))
        slots = [c._index.find(i, 0) for i in range(3)]
        c._slots["offset"][slots[2]] = c._slots["offset"][slots[1]]  # a torn record: bytes over another's
        c._hdr["dirty"] = 1
        st = c.stats()  # recovers
        assert st["corrupt_dropped"] == 1 and st["entries"] == 2
        with c.get(key(0)) as e:
            np.testing.assert_array_equal(e.array, value(0, 256))


def test_metadata_blob_travels_with_its_entry(name):
    with ShmCache.open(name, 2 * MB, max_entries=256) as c:
        assert c.put(key(1), value(1, 64), (2, 4, 4), meta=b'{"timestamps_s": [0.0, 1.0]}')
        assert c.put(key(2), value(2, 64))
        with c.get(key(1)) as e:
            assert e.meta == b'{"timestamps_s": [0.0, 1.0]}' and e.grid_thw == (2, 4, 4)
            np.testing.assert_array_equal(e.array, value(1, 64))
        with c.get(key(2)) as e:
            assert e.meta is None
        assert c.stats()["bytes_used"] == 2 * 64 * 4 + len(b'{"timestamps_s": [0.0, 1.0]}')
        with pytest.raises(ValueError, match="metadata"):
            c.put(key(3), value(3, 4), meta=b"x" * (2 * MB))


# --------------------------------------------------------------------------- multi-process stress
def _stress_worker(name: str, seed: int, ops: int, out: mp.Queue) -> None:
    rng = np.random.default_rng(seed)
    c = ShmCache.open(name, 64 * MB, max_entries=4096)
    gets = hits = puts = torn = 0
    for _ in range(ops):
        k = int(rng.integers(0, 600))
        n_floats = int(rng.integers(1, 64)) * 16 * (1 + k % 7)  # 64 B .. 28 KiB, varying per put
        if rng.random() < 0.6:
            gets += 1
            e = c.get(key(k), verify=False)  # no help from the cache's own checksum: check the bytes ourselves
            if e is not None:
                hits += 1
                if not np.array_equal(e.array.reshape(-1), value(k, e.array.size).reshape(-1)):
                    torn += 1
                e.release()
        else:
            puts += 1
            c.put(key(k), value(k, n_floats), grid_thw=(1, 2, 2))
    out.put((gets, hits, puts, torn))
    c.close()


def test_stress_four_processes_no_torn_reads_consistent_stats(name):
    ShmCache.open(name, 64 * MB, max_entries=4096).close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_stress_worker, args=(name, s, 25_000, out)) for s in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    gets = sum(r[0] for r in results)
    hits = sum(r[1] for r in results)
    assert sum(r[0] + r[2] for r in results) == 100_000
    assert sum(r[3] for r in results) == 0, "torn reads"
    assert hits > 10_000  # the check above really ran
    with ShmCache.open(name, 64 * MB, max_entries=4096) as c:
        st = c.stats()
        s = c._slots
        ready = c._state == 2
        assert st["hits"] == hits and st["hits"] + st["misses"] == gets
        assert st["bytes_used"] == int(s["length"][ready].sum())
        assert st["entries"] == int(ready.sum()) == st["inserts"] - st["evictions"]
        assert st["pinned"] == 0 and st["writing"] == 0 and st["corrupt_dropped"] == 0
        assert c._index.verify(np.flatnonzero(c._state != 0))  # the key index holds exactly the live slots
        # every entry left is intact
        for i in np.flatnonzero(ready):
            k = int(c._key_lo[i])
            with c.get(key(k)) as e:
                np.testing.assert_array_equal(e.array.reshape(-1), value(k, e.array.size).reshape(-1))


# --------------------------------------------------------------------------- SIGKILL
def _slow_writer(name: str, k: int) -> None:
    c = ShmCache.open(name, 512 * MB, max_entries=64)
    big = value(k, 100 * MB // 4)  # 100 MB: the copy takes long enough to be killed in it
    while True:
        c.put(key(k), big)
        k += 1


def _lock_holder(name: str, started) -> None:
    c = ShmCache.open(name, 512 * MB, max_entries=64)
    with c._critical() as h:  # dies holding the lock with the dirty flag set
        h["hits"] += 1000
        started.set()
        time.sleep(60)


def test_writer_killed_mid_put_leaves_no_partial_entry_and_no_deadlock(name):
    with ShmCache.open(name, 512 * MB, max_entries=64) as c:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_slow_writer, args=(name, 100))
        p.start()
        deadline = time.monotonic() + 60
        while c.stats()["writing"] == 0:
            assert time.monotonic() < deadline, "writer never started a put"
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        dead = np.flatnonzero(c._state == WRITING)
        assert len(dead) == 1  # the half-written entry is there but invisible
        k = int(c._key_lo[dead[0]])
        assert c.get(key(k)) is None  # readers never see it
        for i in range(100, k):  # finished ones are intact
            e = c.get(key(i))
            if e is not None:
                assert zlib.crc32(e.array.tobytes()) == zlib.crc32(value(i, 100 * MB // 4).tobytes())
                e.release()
        # the others go on: new puts reuse the dead writer's bytes
        for i in range(5):
            assert c.put(key(1000 + i), value(i, 60 * MB // 4))
        assert c.stats()["writing"] == 0  # the dead writer's slot was reclaimed


def test_process_killed_holding_the_lock_triggers_recovery(name):
    with ShmCache.open(name, 512 * MB, max_entries=64) as c:
        c.put(key(1), value(1, 1024))
        ctx = mp.get_context("spawn")
        started = ctx.Event()
        p = ctx.Process(target=_lock_holder, args=(name, started))
        p.start()
        assert started.wait(60)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        t0 = time.monotonic()
        with c.get(key(1)) as e:  # no deadlock: the kernel released the dead holder's flock
            np.testing.assert_array_equal(e.array, value(1, 1024))
        assert time.monotonic() - t0 < 5
        assert c.stats()["recoveries"] == 1


def test_bench_shm_index_reports_every_size_without_grades():
    import argparse
    import json

    from mimo_epd.bench import shm_index

    p = argparse.ArgumentParser()
    shm_index.add_arguments(p)
    out = shm_index.main(p.parse_args(["--sizes", "300,3000", "--lookups", "400"]))
    assert '"goal' not in json.dumps(out)
    assert set(out["results"]) == {"300", "3000"}
    for n, r in out["results"].items():
        assert r["entries"] == int(n) and r["checked_hits"] == 400 and r["checked_misses"] == 400
        assert r["probes_max"] <= 64 and all(r[k] > 0 for k in ("contains_hit_us", "get_hit_us", "get_miss_us"))
