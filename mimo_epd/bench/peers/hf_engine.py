"""Peer LLM engines: transformers on the same weights (`llm_backend.models.transformers_twin`), two ways a user
would batch offline requests with it.

- `continuous`: transformers' continuous batching with its paged KV cache (the manager behind
  `generate_batch`), each request with its own `max_new_tokens`, EOS disabled, greedy, timestamps recorded;
- `static`: `generate` over static batches of `batch` requests sorted by prompt length (so a batch pads
  little), left-padded; `min_new_tokens = max_new_tokens =` the batch's longest requested output and EOS
  disabled (each request keeps its own number of tokens). TTFT is when its batch produced its first token;
  end-to-end when its batch returned.

Each returns (stats, outputs in request order). `PeerFailed` carries the peer's own error when it cannot run.
Times are seconds from the moment every request has arrived (`t0`).
"""

from __future__ import annotations

import logging
import time

import torch

from mimo_epd.common.stats import percentile


class PeerFailed(RuntimeError):
    """The peer raised or reported an error for this workload; the message is the peer's own."""


def pct_ms(xs, q) -> float:
    return percentile([x * 1000 for x in xs], q, 2)


def summarize(wall: float, out_tokens: int, ttft: list[float], e2e: list[float]) -> dict:
    return {
        "seconds": round(wall, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "ttft_p50_ms": pct_ms(ttft, 50),
        "ttft_p90_ms": pct_ms(ttft, 90),
        "e2e_p50_ms": pct_ms(e2e, 50),
        "e2e_p90_ms": pct_ms(e2e, 90),
    }


def static(hf, reqs: list[tuple[list[int], int]], batch: int) -> tuple[dict, list[list[int]]]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):  # called once per generated position, right after its forward
        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
    outputs: list = [None] * len(reqs)
    ttft, e2e = [0.0] * len(reqs), [0.0] * len(reqs)
    t0 = time.perf_counter()
    for b in range(0, len(order), batch):
        rows = order[b : b + batch]
        width = max(len(reqs[i][0]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for j, i in enumerate(rows):  # left padding, as decoder-only generation needs
            p = reqs[i][0]
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        steps = max(reqs[i][1] for i in rows)
        first = FirstToken()
        with torch.inference_mode():
            gen = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([first]),
            )
        done = time.perf_counter()
        for j, i in enumerate(rows):
            outputs[i] = gen[j, width : width + reqs[i][1]].tolist()
            ttft[i], e2e[i] = first.at - t0, done - t0
    wall = time.perf_counter() - t0
    stats = summarize(wall, sum(n for _, n in reqs), ttft, e2e)
    stats.update(batch_size=batch, order="sorted by prompt length")
    return stats, outputs


def continuous(hf, reqs: list[tuple[list[int], int]], timeout_s: float = 3600) -> tuple[dict, list[list[int]]]:
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in reqs))
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    level = cb_log.level
    cb_log.setLevel(logging.CRITICAL)  # its failures come back as result.error, reported by us
    results: dict = {}
    try:
        manager = hf.init_continuous_batching(generation_config=gc)
        manager.start()
        try:
            t0 = time.perf_counter()
            for i, (p, n) in enumerate(reqs):
                manager.add_request(
                    list(p), request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1, record_timestamps=True
                )
            deadline = t0 + timeout_s
            while len(results) < len(reqs) and time.perf_counter() < deadline:
                r = manager.get_result(timeout=0.05)
                if r is not None and r.is_finished():
                    results[r.request_id] = (r, time.perf_counter())
                elif r is None and not manager.is_running():
                    break
            wall = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=5)
            manager.destroy()
    except Exception as e:  # noqa: BLE001 - the peer's own exception is the report
        raise PeerFailed(f"{type(e).__name__}: {e}") from e
    finally:
        cb_log.setLevel(level)
    errors = [r.error for r, _ in results.values() if r.error]
    if errors:
        raise PeerFailed(errors[0])
    if len(results) < len(reqs):
        raise PeerFailed(f"only {len(results)} of {len(reqs)} requests finished (generation thread stopped)")
    outputs, ttft, e2e = [], [], []
    for i in range(len(reqs)):
        r, done = results[f"r{i}"]
        outputs.append(list(r.generated_tokens))
        ttft.append((r.timestamps[0] if r.timestamps else done) - t0)
        e2e.append(done - t0)
    short = [i for i, (o, (_, n)) in enumerate(zip(outputs, reqs)) if len(o) != n]
    if short:
        raise PeerFailed(f"request {short[0]} generated {len(outputs[short[0]])} tokens, not {reqs[short[0]][1]}")
    stats = summarize(wall, sum(len(o) for o in outputs), ttft, e2e)
    stats.update(paged_cache=True, api="init_continuous_batching / add_request (what generate_batch runs)")
    return stats, outputs
