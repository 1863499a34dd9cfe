"""The encoder's staged pipeline, read top to bottom:

    request ──▶ admission (--max-pending) ──▶ check (modality, content_hash: cache?) ──hit──▶ answer
                ──▶ acquire: URLs through the fair fetch scheduler (--fetch-concurrency, --fetch-per-host);
                    inline bytes, data: URIs, paths at once ──▶ content key ──▶ cache? ──hit──▶ answer
                                 │ miss, first of identical in-flight items (the rest attach to it)
                                 ▼
                [decode_q] decode workers (process pool, pixels back through shm; JPEG draft; optional resize)
                ──▶ [preprocess_q] preprocess threads (resize/normalize/patchify on --device)
                ──▶ Batcher (token budget and wait following the queue) ──▶ vision forward (1-2 workers,
                    threads from the tuner) ──▶ answer + cache
                videos: acquire ──▶ video path (parallel decode, tower calls on the same forward threads)

Modules: `jobs` (the request/result/job types and `Next`, where a stage sends a job), `admission`
(capacity and de-duplication of identical items in flight), `stages` (one function per stage, each
returning a `Next`), `video_path`, `tuner` (the forward's workers x threads on a CPU), `lanes` (where a forward
worker runs: thread, CUDA device and stream), `core` (the wiring).

Every optimisation has a switch (see config.py): `--no-pipeline` serialises requests, `--no-batching`
runs one item per forward, `--decode-workers 0` decodes in a thread, `--no-jpeg-draft`, `--resize-in`.
With all of them off this is the naive server the benchmark compares against.
"""

from .core import EncodePipeline
from .jobs import ItemRequest, ItemResult, Job, Next

__all__ = ["EncodePipeline", "ItemRequest", "ItemResult", "Job", "Next"]
