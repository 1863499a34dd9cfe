"""Decoding in worker processes: transport (shared-memory slots) and the processes' lifecycle.

What a decode process does with one image (probe, draft, backend, optional resize/patchify) is
`decoders.job.decode_item`; this module only moves bytes and pixels and keeps the processes alive.

Image decoding holds the GIL and is the encoder's main CPU cost, so it runs in a pool of processes.
Neither the file nor the pixels travel pickled through a pipe (a 4K frame is 25 MB: pickle, two kernel
copies, unpickle): the server owns one shared-memory arena of fixed-size slots; before dispatching a
job it takes a free slot and writes the file's bytes into it, the worker reads them, writes the pixels
over them and returns only the shape, and the server copies the pixels out and frees the slot. An image
bigger than a slot comes back pickled (counted in `fallbacks`).

A decode process that dies (the OOM killer, a crash in a codec library) is replaced and the images it
held are decoded again, once (see `DecodePool`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import mmap
import multiprocessing
import os
import uuid

import numpy as np

from mimo_epd.common.malloc import keep_freed_memory
from mimo_epd.common.parent import exit_with_parent  # re-exported: video/decode.py takes it from here

from .decoders import DECODERS, check_decoder_name
from .decoders.base import Decoded, Stage
from .decoders.job import DecodeOptions, decode_item, decode_on_device, decodes_on_device

__all__ = [
    "DECODERS",
    "Decoded",
    "DecodeOptions",
    "DecodePool",
    "Stage",
    "decode_job",
    "decode_on_device",
    "decodes_on_device",
    "exit_with_parent",
    "ignore_sigint",
    "remove_stale_arenas",
]
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- worker side
_ARENA: mmap.mmap | None = None
_SLOT_BYTES = 0


def ignore_sigint() -> None:
    """Ctrl-C sends SIGINT to the whole process group: a worker would die in the middle of its queue read with a
    KeyboardInterrupt traceback (and break the pool under the server's graceful drain). The server process
    handles SIGINT and shuts its workers down itself."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_init(arena_path: str | None, slot_bytes: int, max_image_pixels: int) -> None:
    global _ARENA, _SLOT_BYTES
    from PIL import Image

    ignore_sigint()
    exit_with_parent()
    keep_freed_memory()  # every item allocates the same few MB: reuse them instead of faulting fresh pages in
    Image.MAX_IMAGE_PIXELS = max_image_pixels
    if arena_path:
        try:
            fd = os.open(arena_path, os.O_RDWR)
        except OSError:  # the server's /proc entry is not readable here: pixels come back pickled
            log.warning(
                "decode worker %d cannot open the shared arena %s: pixels travel pickled", os.getpid(), arena_path
            )
            return
        _ARENA = mmap.mmap(fd, os.fstat(fd).st_size)
        os.close(fd)
        _SLOT_BYTES = slot_bytes


def _started(hold_s: float) -> tuple[int, bool]:
    """Keeps a worker busy briefly, so that the pool starts every worker (it spawns on demand); says whether
    this worker mapped the shared arena."""
    import time

    time.sleep(hold_s)
    return os.getpid(), _ARENA is not None


def decode_job(data: bytes | None, opts: DecodeOptions, slot: int, size: int = 0) -> tuple:
    """Runs in a worker. `data` None: the item's `size` bytes are in `slot` (read before the pixels overwrite
    them). Returns ("slot", shape, meta) or ("array", pixels, meta), meta = (source_size, draft_scale, stage)."""
    if data is None:
        if _ARENA is None:  # cannot happen: once a worker reports no arena, the pool sends every item pickled
            raise RuntimeError("decode worker without the shared arena was handed an item through it")
        data = _ARENA[slot * _SLOT_BYTES : slot * _SLOT_BYTES + size]
    d = decode_item(data, opts)
    pixels = d.pixels
    meta = (d.source_size, d.draft_scale, d.stage)
    n = pixels.nbytes
    if _ARENA is not None and 0 <= slot and n <= _SLOT_BYTES:
        dst = np.frombuffer(_ARENA, np.uint8, n, slot * _SLOT_BYTES)
        dst[:] = np.ascontiguousarray(pixels).reshape(-1)
        return ("slot", pixels.shape, meta)
    return ("array", np.ascontiguousarray(pixels), meta)


# ------------------------------------------------------------------------------- server side
ARENA_PREFIX = "mimo-epd-decode-"


def remove_stale_arenas(shm_dir: str = "/dev/shm", min_age_s: float = 60.0) -> list[str]:
    """Removes the decode arenas of servers that died before unlinking theirs (a name now lives only between its
    creation and the next line, but earlier versions kept it until every worker had mapped it). A name carries
    its server's pid; an arena whose pid is alive is left alone, and so is one younger than `min_age_s` (a
    server in another pid namespace may be between those two lines). Returns the names removed."""
    import time

    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        pid = name[len(ARENA_PREFIX) :].split("-", 1)[0] if name.startswith(ARENA_PREFIX) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or someone else's process: not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_mtime > time.time() - min_age_s:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.warning(
            "removed %d decode arenas left in %s by servers that died while starting: %s",
            len(removed),
            shm_dir,
            removed,
        )
    return removed


class DecodePool:
    """Runs `decode_job` in `workers` processes (or in a thread when workers == 0).

    A decode process that dies (the OOM killer, a crash in a codec library) breaks a `ProcessPoolExecutor`
    for good: every later job fails with `BrokenProcessPool`. So the pool replaces its executor when that
    happens (fresh processes, the same arena) and runs the jobs that were in flight again, once each."""

    def __init__(self, workers: int, opts: DecodeOptions, slot_bytes: int = 32 << 20, inflight: int = 2):
        self.workers = workers
        self.opts = opts
        self.slot_bytes = slot_bytes
        self.inflight = inflight
        self.fallbacks = 0
        self.respawns = 0  # how many times dead decode processes were replaced
        self._executor: concurrent.futures.Executor | None = None
        self._generation = 0  # bumped on each replacement, so concurrent failures replace the executor once
        self._replacing: asyncio.Lock | None = None
        self._arena: mmap.mmap | None = None
        self._arena_fd: int | None = None
        self._pickled = False  # True once a worker could not map the arena: bytes and pixels travel pickled
        self._free: asyncio.Queue[int] | None = None
        check_decoder_name(opts.decoder)
        if opts.decoder == "dali":
            from .decoders import dali

            dali.check_available()
        self.on_device = decodes_on_device(opts)
        if self.on_device and opts.resize:
            raise ValueError(
                f"--decoder {opts.decoder} decodes on {opts.device}: resize there too (--resize-in device or auto)"
            )

    async def start(self) -> None:
        if self.on_device:  # one thread drives the GPU decoder; the decode processes are not needed
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "gpu-decode")
            log.info(
                "decoding JPEGs on %s with %s (nvJPEG); --decode-workers unused", self.opts.device, self.opts.decoder
            )
            return
        if self.workers <= 0:
            return
        n_slots = self.max_inflight
        remove_stale_arenas()
        path = f"/dev/shm/{ARENA_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        # The name is removed at once, so nothing is left in /dev/shm however this process ends (SIGKILL
        # included). The server keeps the descriptor open for as long as the pool lives: every worker, the
        # first ones and any that replace a dead one, maps the arena through /proc/<server pid>/fd/<fd>.
        os.unlink(path)
        try:
            os.ftruncate(fd, n_slots * self.slot_bytes)
            self._arena = mmap.mmap(fd, n_slots * self.slot_bytes)
        except BaseException:
            os.close(fd)
            raise
        self._arena_fd = fd
        self._free = asyncio.Queue()
        for i in range(n_slots):
            self._free.put_nowait(i)
        self._replacing = asyncio.Lock()
        self._executor = self._new_executor()
        await self._start_all()

    async def _start_all(self) -> None:
        """Starts every worker now (the executor spawns them on demand): each call holds its worker a while, so
        the next call lands on another one; a worker slow to spawn (a loaded machine) gets longer holds."""
        loop = asyncio.get_running_loop()
        seen: set[int] = set()
        for hold in (0.2, 0.5, 1.0, 2.0, 4.0):
            for pid, mapped in await asyncio.gather(
                *(loop.run_in_executor(self._executor, _started, hold) for _ in range(self.workers))
            ):
                seen.add(pid)
                if not mapped and not self._pickled:
                    self._pickled = True  # a worker without the arena cannot read a slot: send items pickled
                    log.warning("decode worker %d could not map the shared arena: items travel pickled", pid)
            if len(seen) >= self.workers:
                return
        log.warning("only %d of %d decode workers started in time; the rest start on demand", len(seen), self.workers)

    def _new_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(f"/proc/{os.getpid()}/fd/{self._arena_fd}", self.slot_bytes, self.opts.max_pixels),
        )

    async def _replace_executor(self, generation: int) -> None:
        """Replaces a broken executor (once, however many jobs saw it break). The old one's surviving
        workers are joined first (the executor terminates them when it breaks): one of them could otherwise
        still be writing pixels into a slot that the retried job is about to reuse."""
        async with self._replacing:
            if generation != self._generation or self._executor is None:
                return  # another job already replaced it, or the pool is stopping
            old = self._executor
            await asyncio.to_thread(old.shutdown, wait=True, cancel_futures=True)
            if self._executor is not old:  # stopped meanwhile
                return
            self._executor = self._new_executor()
            self._generation += 1
            self.respawns += 1
            try:
                await self._start_all()
            except concurrent.futures.process.BrokenProcessPool:
                pass  # killed again while starting: the retry meets it and replaces it once more
            log.warning(
                "a decode process died; replaced the decode processes (%d so far) and retrying the "
                "images that were in flight",
                self.respawns,
            )

    @property
    def max_inflight(self) -> int:
        """How many `decode` calls the pipeline should keep running (one slot each): `inflight` per process,
        so each process has its next image queued while it decodes one; one when decoding in a thread."""
        return self.workers * self.inflight if self.workers > 0 and not self.on_device else 1

    def worker_pids(self) -> list[int]:
        """The pids of the live decode processes (empty when decoding in a thread or on the device)."""
        procs = getattr(self._executor, "_processes", None) or {}
        return sorted(pid for pid, p in dict(procs).items() if p.is_alive())

    def stop(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        # The arena's descriptor stays open with the mapping: a worker still starting may need its /proc path,
        # and both go when this process exits.

    async def run(self, fn, *args):
        """Runs a picklable `fn(*args)` in a decode process (in a thread with `--decode-workers 0` or a
        device decoder): how other media kinds (audio) decode in the same processes as images. A job whose
        process died runs once more, on fresh processes."""
        loop = asyncio.get_running_loop()
        if self._executor is None or self.on_device:
            return await asyncio.to_thread(fn, *args)
        for attempt in (1, 2):
            executor, generation = self._executor, self._generation
            if executor is None:
                raise concurrent.futures.process.BrokenProcessPool("the decode pool is stopped")
            try:
                return await loop.run_in_executor(executor, fn, *args)
            except concurrent.futures.process.BrokenProcessPool:
                await self._replace_executor(generation)
                if attempt == 2:
                    raise

    async def decode(self, data: bytes) -> Decoded:
        if self.on_device:
            return await asyncio.get_running_loop().run_in_executor(self._executor, decode_on_device, data, self.opts)
        if self._executor is None:
            kind, payload, meta = await asyncio.to_thread(decode_job, data, self.opts, -1)
            return Decoded(payload, *meta)
        slot = await self._free.get()
        try:
            for attempt in (1, 2):  # a job whose process died is run once more, on fresh processes
                executor, generation = self._executor, self._generation
                if executor is None:
                    raise concurrent.futures.process.BrokenProcessPool("the decode pool is stopped")
                job, size, job_slot = data, 0, -1 if self._pickled else slot
                if (
                    len(data) <= self.slot_bytes and not self._pickled
                ):  # the bytes go in through the slot too, not pickled through a pipe
                    # (written again on a retry: the dead process may have begun writing pixels over them)
                    size = len(data)
                    self._arena[slot * self.slot_bytes : slot * self.slot_bytes + size] = data
                    job = None
                try:
                    kind, payload, meta = await asyncio.get_running_loop().run_in_executor(
                        executor, decode_job, job, self.opts, job_slot, size
                    )
                    break
                except concurrent.futures.process.BrokenProcessPool:
                    await self._replace_executor(generation)
                    if attempt == 2:
                        raise
            if kind == "slot":
                n = int(np.prod(payload))
                pixels = np.frombuffer(self._arena, np.uint8, n, slot * self.slot_bytes).reshape(payload).copy()
            else:
                self.fallbacks += 1
                pixels = payload
        finally:
            self._free.put_nowait(slot)
        return Decoded(pixels, *meta)
