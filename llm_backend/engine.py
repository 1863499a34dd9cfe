"""A small offline engine over the dual KV pools and the SWA-aware radix cache (the vLLM-like API:
`LLM(...).generate(prompts, SamplingParams(...))`).

Each step serves every running request once: a prefill chunk (at most `chunk_size` tokens) or one decode
token. Admission takes the waiting request with the fewest uncached tokens, with a penalty that grows
with waiting time so nothing starves (`--fcfs` order by flag). A request's KV lives in two pools: the
full pool (every token, for full-attention layers) and the SWA pool (only the last W tokens plus the
current chunk and the release interval). When a pool runs out, the cache is evicted first (SWA and full
separately, LRU), then the youngest running request is preempted (its KV freed, recomputed later).

Every step is one forward over all running requests (`forward_batch`: GEMMs over all their tokens at
once; attention over the paged pools through `PagedBatch`: Triton kernels on CUDA, torch on the CPU).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from .kv import PoolExhausted, RequestKV, SlotPool, SWARadixCache
from .models import load_llm
from .paged_attention import KVPools, PagedBatch

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ API types
@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # logprob of each chosen token
    prompt_logprobs: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    usage: Usage
    finish_reason: str


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, through the `tokenizers` library."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(model: str):
    """`tiny` uses bytes; a checkpoint directory its `tokenizer.json` (bytes when it has none)."""
    import os

    path = os.path.join(model, "tokenizer.json") if model != "tiny" else ""
    return HFTokenizer(path) if path and os.path.isfile(path) else ByteTokenizer()


class ByteTokenizer:
    """The tiny model's tokenizer: one token per UTF-8 byte; 256 = BOS, 257 = EOS."""

    bos_token_id, eos_token_id = 256, 257

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------ requests
@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    kv: RequestKV | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str = ""
    generator: torch.Generator | None = None
    media: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt position -> embedding row
    on_token: object = None  # callable(request, token_id, logprob | None), from the engine thread
    on_finish: object = None  # callable(request)
    aborted: bool = False
    first_token_at: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class LLM:
    def __init__(self, model: str = "tiny", device: str = "cpu", dtype: torch.dtype = torch.float32,
                 kv_cache_tokens: int = 16384, swa_cache_tokens: int = 4096, page_size: int = 1,
                 chunk_size: int = 512, enable_prefix_cache: bool = True, release_interval: int = 16,
                 max_running: int = 16, fcfs: bool = False, wait_penalty_tokens_per_s: float = 2048.0,
                 length_buckets: tuple[int, ...] = (65536, 262144)):
        self.model = load_llm(model, device, dtype) if isinstance(model, str) else model
        cfg = self.model.config
        self.tokenizer = load_tokenizer(model) if isinstance(model, str) else ByteTokenizer()
        self.full_pool = SlotPool("full", kv_cache_tokens, page_size)
        self.swa_pool = SlotPool("swa", swa_cache_tokens)
        self.cache = SWARadixCache(self.full_pool, self.swa_pool, cfg.window, page_size)
        p = next(self.model.parameters())
        self.pools = KVPools(cfg, self.full_pool.size, swa_cache_tokens, p.dtype, p.device)
        self.chunk_size, self.enable_prefix_cache = chunk_size, enable_prefix_cache
        self.release_interval, self.max_running = release_interval, max_running
        self.fcfs, self.wait_penalty = fcfs, wait_penalty_tokens_per_s
        self.length_buckets = tuple(sorted(length_buckets))
        self._next_bucket = 0
        self.admitted: list[int] = []  # request ids in admission order (observability, tests)
        self._ids = itertools.count()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self.preemptions = 0
        self.peak_swa_per_request = 0

    # ----------------------------------------------------------------------------------- public
    def generate(self, prompts: list[str] | str | None = None, sampling_params: SamplingParams | None = None,
                 prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params.validate()
        if prompt_token_ids is None:
            if prompts is None:
                raise ValueError("give prompts or prompt_token_ids")
            prompt_token_ids = [self.tokenizer.encode(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
        reqs = [self.add_request(ids, params) for ids in prompt_token_ids]
        while any(not r.finish_reason for r in reqs):
            self.step()
        return [self.output(r) for r in reqs]

    def add_request(self, prompt_ids: list[int], params: SamplingParams, media: dict[int, torch.Tensor] | None = None,
                    on_token=None, on_finish=None) -> Request:
        """Queues a request. `media` maps prompt positions to embedding rows (their token ids are
        placeholders >= vocab_size derived from the media's content key, so equal media share prefixes)."""
        params.validate()
        vocab = self.model.config.vocab_size
        media = media or {}
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        for p, t in enumerate(prompt_ids):
            if not (0 <= t < vocab or (p in media and t >= vocab)):
                raise ValueError(f"prompt token {p} = {t} is outside the vocabulary [0, {vocab})")
        r = Request(next(self._ids), list(prompt_ids), params, time.monotonic(), media=media,
                    on_token=on_token, on_finish=on_finish)
        if params.seed is not None:
            r.generator = torch.Generator(device=self.pools.k[0].device).manual_seed(params.seed)
        with self._lock:
            self.waiting.append(r)
            self._wake.notify()
        return r

    def abort(self, r: Request) -> None:
        """Stops a request; its KV is freed at the next step (nothing it computed is cached)."""
        r.aborted = True
        with self._lock:
            self._wake.notify()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run_forever(self, stop) -> None:
        """The serving loop (one thread): steps while there is work, sleeps otherwise."""
        while not stop.is_set():
            with self._lock:
                if not self.has_work():
                    self._wake.wait(0.1)
                    continue
            self.step()

    # ----------------------------------------------------------------------------------- scheduling
    def _priority(self, r: Request, now: float) -> float:
        if self.fcfs:
            return r.arrival
        uncached = len(r.tokens) - (self.cache.match_prefix(r.tokens).length if self.enable_prefix_cache else 0)
        return uncached - self.wait_penalty * (now - r.arrival)

    def step(self) -> None:
        """One round: drop aborted requests, admit waiting ones, run one chunk/token of every running one."""
        now = time.monotonic()
        with self._lock:
            for r in [r for r in self.waiting if r.aborted]:
                self.waiting.remove(r)
                self._finish(r, "abort")
            for r in [r for r in self.running if r.aborted]:
                self.running.remove(r)
                self._finish(r, "abort")
            while self.waiting and len(self.running) < self.max_running:
                r = self._pick(now)
                if not self._admit(r):
                    break
                self.waiting.remove(r)
                self.running.append(r)
                self.admitted.append(r.id)
            if self.waiting and not self.running:
                r = self.waiting.pop(0)
                self._finish(r, "error: the request does not fit in the KV pools; raise kv_cache_tokens / swa_cache_tokens")
            running = list(self.running)
        # One forward for every running request: a prefill chunk or a decode token each. The oldest get
        # slots first; when the pools run dry, the request that could not be served and every younger one
        # are preempted (their KV freed, recomputed later).
        batch = []
        for k, r in enumerate(running):
            try:
                batch.append(self._prepare(r))
            except PoolExhausted:
                with self._lock:
                    for victim in running[k:]:
                        self._preempt(victim)
                        self.running.remove(victim)
                        self.waiting.append(victim)
                break
        if not batch:
            return
        paged = PagedBatch(self.pools, [(r.kv.full, r.kv.swa, start, n) for r, start, n, *_ in batch])
        logits = self.model.forward_batch([(ids, pos, None, emb) for _, _, _, ids, pos, emb, _ in batch],
                                          [mode for *_, mode in batch], paged)
        for (r, start, n, *_), lg in zip(batch, logits):
            self._finish_step(r, start, n, lg)
            if r.finish_reason:
                with self._lock:
                    self.running.remove(r)
                self._finish(r, r.finish_reason)

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if r.kv is not None and reason == "abort":
            log.info("request %d aborted: freeing %d full and %d SWA slots it owned", r.id,
                     r.kv.own_full_slots(), r.kv.own_swa_live())
        if r.kv is not None:
            r.kv.finish(cache_result=self.enable_prefix_cache and reason in ("stop", "length"))
            r.kv = None
        if r.on_finish:
            r.on_finish(r)

    def _bucket(self, r: Request) -> int:
        n = len(r.tokens)
        return next((i for i, bound in enumerate(self.length_buckets) if n < bound), len(self.length_buckets))

    def _pick(self, now: float) -> Request:
        """The next request to admit: length buckets take turns (so one bucket's requests never block
        another's), and inside a bucket the fewest uncached tokens win, minus a wait-time penalty."""
        buckets: dict[int, list[Request]] = {}
        for r in self.waiting:
            buckets.setdefault(self._bucket(r), []).append(r)
        order = sorted(buckets)
        start = next((i for i, b in enumerate(order) if b >= self._next_bucket), 0)
        chosen = order[start]
        self._next_bucket = chosen + 1 if chosen + 1 <= max(order) else 0
        return min(buckets[chosen], key=lambda r: self._priority(r, now))

    def _admit(self, r: Request) -> bool:
        tokens = r.tokens
        # Match at most len-1 tokens: the last one is always computed, its logits give the next token.
        # Prompt logprobs need every prompt position computed, so such requests match nothing.
        use_cache = self.enable_prefix_cache and not r.params.prompt_logprobs
        kv = RequestKV(self.cache, tokens[:-1] if use_cache else [], self.release_interval)
        first = min(self.chunk_size, len(tokens) - kv.cached_tokens)
        if not self.cache.make_room(first + self.full_pool.page_size, first):
            kv.finish(cache_result=False)
            return False
        r.kv = kv
        if not r.output:  # a preempted request keeps its first admission's figure
            r.cached_tokens = kv.cached_tokens
        return True

    def _preempt(self, r: Request) -> None:
        self.preemptions += 1
        r.kv.finish(cache_result=False)
        r.kv = None

    # ----------------------------------------------------------------------------------- one step
    def _prepare(self, r: Request):
        """Reserves slots for r's next chunk (prefill) or token (decode) and builds its forward segment."""
        kv, tokens = r.kv, r.tokens
        start = len(kv.tokens)
        n = min(self.chunk_size, len(tokens) - start)
        if not self.cache.make_room(n + self.full_pool.page_size, n):  # a new page at most beyond n
            raise PoolExhausted("KV pools are full")
        new = tokens[start:start + n]
        kv.extend(new)
        device = self.pools.k[0].device
        ids = torch.tensor(new, device=device)
        embeds = None
        if r.media and any(p in r.media for p in range(start, start + n)):
            vocab = self.model.config.vocab_size
            embeds = self.model.model.embed_tokens(ids.clamp(max=vocab - 1))
            for j in range(n):
                row = r.media.get(start + j)
                if row is not None:
                    embeds[j] = row.to(embeds.dtype)
        mode = "all" if start < len(r.prompt) and r.params.prompt_logprobs else "last"
        return r, start, n, ids, torch.arange(start, start + n, device=device), embeds, mode

    def _finish_step(self, r: Request, start: int, n: int, logits: torch.Tensor) -> None:
        kv, tokens = r.kv, r.tokens
        if start < len(r.prompt) and r.params.prompt_logprobs:
            lp = torch.log_softmax(logits, dim=-1)
            for j in range(n):
                if start + j + 1 < len(r.prompt):
                    r.prompt_logprobs.append(float(lp[j, tokens[start + j + 1]]))
        if self.enable_prefix_cache and start + n <= len(r.prompt):
            kv.checkpoint()  # prompt chunks go into the tree at once: shareable while this request runs
        else:
            kv.release_out_of_window()  # after every chunk
        if start + n == len(tokens):
            self._sample(r, logits[-1])
            kv.step()  # every `release_interval` decode steps
        self.peak_swa_per_request = max(self.peak_swa_per_request, kv.own_swa_live())

    def _sample(self, r: Request, logits: torch.Tensor) -> None:
        p = r.params
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if p.temperature == 0:
            tok = int(torch.argmax(logits))
        else:
            scores = logits.float() / p.temperature
            if p.top_k:
                kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if p.top_p < 1:
                sp, si = torch.sort(probs, descending=True)
                keep = torch.cumsum(sp, 0) - sp < p.top_p
                probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
                probs = probs / probs.sum()
            tok = int(torch.multinomial(probs, 1, generator=r.generator))
        r.output.append(tok)
        if p.logprobs:
            r.logprobs.append(float(logprobs[tok]))
        if len(r.output) == 1:
            r.first_token_at = time.monotonic()
        if r.on_token:
            r.on_token(r, tok, float(logprobs[tok]) if p.logprobs else None)
        if tok in p.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.output) >= p.max_tokens:
            r.finish_reason = "length"

    def output(self, r: Request) -> RequestOutput:
        p = r.params
        return RequestOutput(
            request_id=r.id, prompt_token_ids=r.prompt, output_token_ids=r.output,
            text=self.tokenizer.decode(r.output), logprobs=r.logprobs if p.logprobs else None,
            prompt_logprobs=([None] + r.prompt_logprobs) if p.prompt_logprobs else None,
            usage=Usage(len(r.prompt), r.cached_tokens, len(r.output)), finish_reason=r.finish_reason)
