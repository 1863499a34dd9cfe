"""The scheduler: which requests run in the next step, with how many tokens each, and their KV bookkeeping.

Read top to bottom, one step is:
1. drop aborted requests (the KV they own alone is freed, prefilled prompt chunks stay in the prefix cache;
   all of it is cached when they were stopped by a stop string);
2. admit waiting requests while fewer than `max_running` run: length buckets take turns, and inside a bucket
   the fewest uncached tokens win, minus `wait_penalty` tokens per second waited (or first come first served).
   Scoring never touches the cache (`peek_prefix_length`: no split, no LRU refresh), and each waiting request's
   uncached count is a memo refreshed a bounded number of times per step, so a pick stays cheap with thousands
   waiting. Admission takes the prefix match (locks it) and needs room for the first chunk in both pools;
3. give every running request its next segment, oldest first: a prefill chunk (at most `chunk_size`) or one
   decode token. With a prefill budget per step (`max_prefill_tokens`) the budget is shared first, in
   `prefill_order`: `fewest_left` (default) gives it to the prompts with the fewest tokens left to prefill,
   minus `wait_penalty` tokens per second waited (the wait queue's own rule, applied to admitted prompts:
   without it a prompt admitted behind a 1M-token one waits for that whole prefill, whatever the wait queue
   decided); `oldest` (and FCFS) in admission order. Slots are still reserved oldest first. When a pool runs dry the cache is evicted first (`make_room`), then the *youngest* running
   request is preempted (KV freed, recomputed later). The oldest running request therefore always progresses,
   and one that cannot grow even alone finishes ("length" with what it has, or a resource error): preemption
   makes progress by construction, it never spins;
4. after the runner: checkpoint prompt chunks into the tree (shareable at once), release SWA slots that left
   the window, append sampled tokens, finish requests at a stop token, EOS, max_tokens or the pool's capacity.

Speculative decoding plugs in through `draft_tokens(request)`: a decode segment then also reserves slots for that
many draft positions after the last token (`Segment.drafts`; the runner fills them and verifies them in the same
forward). Drafts never take slots that would preempt anyone (without room the segment decodes one token), and
they count against the step's prefill budget. After the runner, the tokens the target accepted are appended one
by one (a stop token, EOS or max_tokens inside the run ends it exactly there) and the KV of the rejected draft
positions is rolled back (`RequestKV.truncate`), so drafts never reach the tree, the KV events or the tiers.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

from ..kv import PoolExhausted, RequestKV, SlotPool, SWARadixCache
from ..kv.build import KVParts
from ..kv.swa_radix_cache import Node
from .interfaces import Drafter, NoDrafter, SchedulerRole, Ticket
from .request import MEDIA_NEEDED, PromptTooLong, Request
from .sampler import Sampled

log = logging.getLogger(__name__)

# Waiting requests whose uncached-token memo is refreshed per step (the oldest memos first).
REFRESH_PER_STEP = 64
# How the step's prefill budget is shared among running prompts (`_budget_order`).
PREFILL_ORDERS = ("fewest_left", "oldest")
# The token id a draft position holds in the request's KV until the runner verified it.
DRAFT_PLACEHOLDER = -1


class Segment(NamedTuple):
    """One request's share of a step: tokens [start, start + n) are computed; the last `drafts` of them are
    draft positions after the request's last token (speculative decoding), filled in by the runner."""

    request: Request
    start: int
    n: int
    drafts: int = 0

    @property
    def samples(self) -> bool:
        """Whether the segment reaches the end of the sequence, so a token is sampled from its last position."""
        return self.start + self.n - self.drafts == len(self.request.tokens)

    @property
    def all_logits(self) -> bool:
        """Prompt logprobs need the logits of every prompt position."""
        return self.request.params.prompt_logprobs and self.start < len(self.request.prompt)


class SegmentResult(NamedTuple):
    sampled: Sampled | None  # None when the segment ends inside the prompt
    prompt_logprobs: list[float | None]  # of each next prompt token in the segment (None: a media row)
    error: str = ""  # this request failed (e.g. non-finite logits); the others go on
    accepted: tuple[Sampled, ...] = ()  # draft tokens the target accepted, before `sampled` (speculative decoding)
    prompt_top: tuple[list[tuple[int, float]], ...] = ()  # prompt_logprobs with top_logprobs: each position's top k


class Scheduler:
    def __init__(
        self,
        cache: SWARadixCache,
        full_pool: SlotPool,
        swa_pool: SlotPool,
        *,
        chunk_size: int,
        max_running: int,
        enable_prefix_cache: bool,
        release_interval: int,
        fcfs: bool,
        wait_penalty: float,
        length_buckets: tuple[int, ...],
        clock=time.monotonic,
        max_prefill_tokens: int = 0,
        prefill_order: str = "fewest_left",
        drafter: Drafter | None = None,
    ):
        self.cache, self.full_pool, self.swa_pool = cache, full_pool, swa_pool
        self.chunk_size, self.max_running = chunk_size, max_running
        self.enable_prefix_cache, self.release_interval = enable_prefix_cache, release_interval
        self.fcfs, self.wait_penalty = fcfs, wait_penalty
        self.length_buckets = tuple(sorted(length_buckets))
        self.clock = clock
        # Prefill tokens per step (0 = no cap). Decode tokens always run; prefill chunks take the budget oldest
        # first, so a step never carries several long chunks at once and short requests' decodes are not held
        # behind multi-second steps (the simulator found the uncapped policy thrashing on long-context mixes).
        self.max_prefill_tokens = max_prefill_tokens
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, got {prefill_order!r}")
        self.prefill_order = prefill_order
        # Speculative decoding (engine/interfaces.py, `Drafter`): draft positions per decoding request, the call
        # before requests' KV enters the prefix cache (all of a step's at once), and the end of a request.
        self.drafter: Drafter = drafter or NoDrafter()
        self.drafted_tokens = self.accepted_tokens = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order: the oldest first
        self.admitted: list[int] = []  # request ids in admission order (observability, tests)
        self.preemptions = 0
        self.peak_swa_per_request = 0
        self.prompt_tokens = self.generated_tokens = 0
        self._next_bucket = 0
        self._uncached: dict[int, tuple[int, int]] = {}  # request id -> (uncached tokens, step it was computed)
        # This step's admission room (`_fits`): free full slots less what running prompts still need, taken at the
        # step's first admission; the evictable slots, walked only when the free ones are not enough; the full slots
        # the prompts admitted this step will need.
        self._free_room: int | None = None
        self._evictable: int | None = None
        self._admitted_need = 0
        self._in_hand: Request | None = None  # the waiting request being admitted (failed if admission raises)
        # Preempted requests without media rows (`media_span`): the cache node their prefix matched stays locked
        # while they wait, so their re-admission finds the media's KV again (they could not compute it).
        self._pins: dict[int, Node] = {}
        self._steps = 0
        # The longest sequence the full pool can hold alone (the SWA pool needs only a window per sequence).
        self.max_seq_len = full_pool.size

    def metrics(self) -> dict:
        """A subclass's counters for engine.stats() (and /metrics); none here."""
        return {}

    def load_views(self) -> tuple[list[Request], list[Request]]:
        """(requests not started, requests holding KV) as the routers' load counts them. A request that has
        finished is not counted even while it is still in `running`: its KV events are published from inside the
        step that finishes it, and a router reading the load with them must not see it as still running (it would
        steer the session's next turn away from the worker that holds its prefix)."""
        return [r for r in self.waiting if not r.done], [r for r in self.running if not r.done]

    # ----------------------------------------------------------------------------------- queue
    def check_fits(self, prompt_len: int) -> None:
        if prompt_len + 1 > self.max_seq_len:
            raise PromptTooLong(
                f"the prompt has {prompt_len} tokens; with its first output token it can never fit "
                f"the KV pools, which hold at most {self.max_seq_len} tokens per sequence "
                "(--kv-cache-tokens)"
            )

    def add(self, r: Request, ticket: Ticket | None = None) -> None:
        """Queues r. `ticket`: a role's own data about it (pd/); the plain scheduler takes none."""
        if ticket is not None:
            raise ValueError(f"this worker's scheduler takes no {type(ticket).__name__}")
        self.check_fits(len(r.prompt))
        self.waiting.append(r)
        self._memo(r)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def in_hand(self) -> list[Request]:
        """The waiting request whose admission was under way, if any (so a failure there cannot repeat forever)."""
        return [self._in_hand] if self._in_hand is not None and self._in_hand in self.waiting else []

    # ----------------------------------------------------------------------------------- one step
    def schedule(self) -> list[Segment]:
        """Steps 1-3 of the module docstring; returns the segments of the next forward."""
        self._steps += 1
        for r in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(r)
            self.finish(r, r.aborted)
        for r in [r for r in self.running if r.aborted]:
            self.running.remove(r)
            self.finish(r, r.aborted)
        self._refresh_memos()
        now = self.clock()
        blocked = None
        self._free_room = self._evictable = None  # taken at the first admission of this step
        self._admitted_need = 0
        while self.waiting and len(self.running) < self.max_running:
            r = self._pick(now)
            self._in_hand = r
            admitted = self._admit(r)
            self._in_hand = None
            if admitted is None:  # its media rows are needed: the worker encodes them and submits it again
                self.waiting.remove(r)
                self.finish(
                    r, "error", f"the prefix cache no longer holds its first {r.media_span} positions", MEDIA_NEEDED
                )
                continue
            if not admitted:
                blocked = r
                break
            self.waiting.remove(r)
            self.running.append(r)
            self.admitted.append(r.id)
            r.admitted_at = now
        if blocked is not None and not self.running:
            # Nothing runs and the best waiting request did not fit: the pools can never take it as they are
            # configured (add() refused prompts over the full pool; this is the SWA pool or page rounding).
            r = blocked
            self.waiting.remove(r)
            self.finish(
                r,
                "error",
                f"the request does not fit in the KV pools (full {self.full_pool.size}, SWA "
                f"{self.swa_pool.size} tokens); raise --kv-cache-tokens / --swa-cache-tokens",
                "resource_exhausted",
            )
        segments = []
        shares = self._budget_shares(now)
        for r in list(self.running):
            if r not in self.running:  # preempted while an older request made room
                continue
            assert r.kv is not None
            todo = len(r.tokens) - len(r.kv.tokens)
            if todo > 1 and shares is not None:  # a prefill chunk: its share of the step's budget
                if shares.get(r.id, 0) <= 0:
                    continue
                seg = self._segment(r, shares[r.id])
            else:
                if shares is not None:
                    drafts = shares.get(r.id, 0)
                else:
                    drafts = self.drafter.draft_tokens(r) if todo == 1 and not r.aborted else 0
                seg = self._segment(r, drafts=drafts)
            if seg is not None:
                segments.append(seg)
        return segments

    def _budget_shares(self, now: float) -> dict[int, int] | None:
        """Prefill tokens (or draft positions) each running request takes from the step's budget, in the budget's
        order (`prefill_order`); None without a cap. Reservation itself stays oldest first (`schedule`)."""
        if not self.max_prefill_tokens:
            return None
        left = self.max_prefill_tokens
        shares: dict[int, int] = {}
        for r in self._budget_order(now):
            assert r.kv is not None
            todo = len(r.tokens) - len(r.kv.tokens)
            if todo > 1:
                n = max(0, min(self.chunk_size, todo, left))
            else:
                d = self.drafter.draft_tokens(r) if todo == 1 and not r.aborted else 0
                n = d if d <= left else 0  # all of a request's drafts or none (its chain writes every MTP layer once)
            shares[r.id] = n
            left -= n
        return shares

    def _budget_order(self, now: float) -> list[Request]:
        """`oldest` (and FCFS): admission order. `fewest_left`: decoding requests (their drafts) first, then the
        prompts with the fewest tokens left to prefill, minus `wait_penalty` tokens per second since arrival,
        so a short prompt admitted behind a 1M-token one is not held for the whole of its prefill, and a long
        one still progresses as it ages."""
        if self.fcfs or self.prefill_order == "oldest":
            return list(self.running)

        def left(r: Request) -> int:
            assert r.kv is not None
            return len(r.tokens) - len(r.kv.tokens)

        decoding = [r for r in self.running if left(r) <= 1]
        prefilling = [r for r in self.running if left(r) > 1]
        prefilling.sort(key=lambda r: left(r) - self.wait_penalty * (now - r.arrival))
        return decoding + prefilling

    def _segment(self, r: Request, limit: int | None = None, drafts: int = 0) -> Segment | None:
        """Reserves slots for r's next chunk or token (at most `limit` tokens), preempting younger requests if
        needed; `drafts` more positions after its last token only if they fit without preempting anyone."""
        kv = r.kv
        assert kv is not None, "a running request has its KV"
        if drafts:
            start = len(kv.tokens)
            n = len(r.tokens) - start + drafts
            if self.cache.make_room(n + self.full_pool.page_size, n):
                try:
                    kv.extend(r.tokens[start:] + [DRAFT_PLACEHOLDER] * drafts)
                    return Segment(r, start, n, drafts)
                except PoolExhausted:
                    pass
        while True:
            start = len(kv.tokens)
            n = min(limit or self.chunk_size, len(r.tokens) - start)
            if self.cache.make_room(n + self.full_pool.page_size, n):  # a new page at most beyond n
                try:
                    kv.extend(r.tokens[start : start + n])
                    return Segment(r, start, n)
                except PoolExhausted:
                    pass
            younger = self.running[self.running.index(r) + 1 :]
            if younger:
                victim = younger[-1]
                self._preempt(victim)
                continue
            # r is the youngest left and cannot grow: with everything younger freed and the cache evicted it
            # never will (older requests only grow). It ends with what it has.
            self.running.remove(r)
            if self.running:  # older requests hold the pools: r waits for them and is recomputed later
                self.preemptions += 1
                self._release(r)
                self.waiting.insert(0, r)
            elif r.output:
                self.finish(r, "length")
            else:
                self.finish(
                    r,
                    "error",
                    f"the sequence of {len(r.tokens)} tokens cannot grow: the KV pools "
                    f"(full {self.full_pool.size}, SWA {self.swa_pool.size} tokens) are full "
                    "even with nothing else running",
                    "resource_exhausted",
                )
            return None

    def complete(self, segments: list[Segment], results: list[SegmentResult]) -> None:
        """Step 4: bookkeeping after the runner ran `segments`."""
        ended: list[Request] = []
        for seg, res in zip(segments, results):
            r = seg.request
            if r.done:
                continue
            if res.error:
                self.running.remove(r)
                self.finish(r, "error", res.error, "internal")
                continue
            r.prompt_logprobs.extend(res.prompt_logprobs)
            r.prompt_top_logprobs.extend(res.prompt_top)
            kv = r.kv
            assert kv is not None, "a running request has its KV"
            prompt_chunk = self.enable_prefix_cache and seg.start + seg.n <= len(r.prompt)
            if prompt_chunk and self.drafter.before_cache([r])[0]:
                kv.checkpoint()  # prompt chunks go into the tree at once: shareable while this request runs
            if res.sampled is not None:
                self._take_tokens(r, seg, res)
            if not prompt_chunk:  # after the rejected drafts are rolled back: the window is the kept tokens'
                kv.release_out_of_window()
            self.peak_swa_per_request = max(self.peak_swa_per_request, kv.own_swa_live())
            if r.finish_reason == "" and r.aborted == "" and self._stopped(r):
                self.running.remove(r)
                ended.append(r)
        may_cache = self.drafter.before_cache(ended) if self.enable_prefix_cache and ended else [False] * len(ended)
        for r, ok in zip(ended, may_cache):
            self.finish(r, self._stopped(r), may_cache=ok)

    def _take_tokens(self, r: Request, seg: Segment, res: SegmentResult) -> None:
        """Appends the segment's accepted drafts and its sampled token, up to the first that ends the request; the
        KV of rejected draft positions (and of accepted ones past a stop) is rolled back."""
        kv = r.kv
        assert kv is not None and res.sampled is not None
        if seg.drafts:
            computed = seg.start + seg.n - seg.drafts  # the request's own tokens, before the draft positions
            kv.truncate(computed + len(res.accepted), [s.token for s in res.accepted])
            self.drafted_tokens += seg.drafts
            self.accepted_tokens += len(res.accepted)
            r.stats.drafted_tokens += seg.drafts
            r.stats.accepted_tokens += len(res.accepted)
        for s in (*res.accepted, res.sampled):
            self._append(r, s)
            kv.step()  # every `release_interval` decode steps
            if r.aborted or self._stopped(r):
                break
        if len(kv.tokens) > len(r.tokens) - 1:  # stopped inside the accepted run
            kv.truncate(len(r.tokens) - 1)

    def _append(self, r: Request, s: Sampled) -> None:
        r.append_token(s.token)
        if r.constraint is not None:
            r.constraint.accept(s.token)  # the grammar follows every appended token
        self.generated_tokens += 1
        if r.params.logprobs:
            r.logprobs.append(s.logprob)
        if r.params.top_logprobs:
            r.top_logprobs.append(s.top)
        if len(r.output) == 1:
            r.first_token_at = self.clock()
        if r.on_token:
            r.on_token(r, s.token, s.logprob if r.params.logprobs else None)

    def _stopped(self, r: Request) -> str:
        if r.output and r.output[-1] in r.stop_ids:
            return "stop"
        if r.constraint is not None and r.constraint.terminated:
            return "stop"  # the grammar ended with a stop token (one ignore_eos keeps from the stop ids)
        if len(r.output) >= r.params.max_tokens or len(r.tokens) >= self.max_seq_len:
            return "length"
        return ""

    def finish(self, r: Request, reason: str, error: str = "", code: str = "", may_cache: bool | None = None) -> None:
        """Ends r; `may_cache`: the before-cache call already made for it (complete() makes one for a step's)."""
        if r.done:
            return
        r.finish_reason, r.error, r.error_code = reason, error, code
        if r.kv is not None and reason == "abort":
            log.info(
                "request %d aborted: freeing %d full and %d SWA slots it owned",
                r.id,
                r.kv.own_full_slots(),
                r.kv.own_swa_live(),
            )
        if reason == "error":
            log.warning("request %d failed: %s", r.id, error)
        if r.kv is not None:
            cache_result = self.enable_prefix_cache and reason in ("stop", "length")
            if cache_result and may_cache is None:
                may_cache = self.drafter.before_cache([r])[0]
            r.kv.finish(cache_result=cache_result and bool(may_cache))
            r.kv = None
        self.drafter.release(r)  # speculation's per-request state (its kept hidden rows) goes with the KV
        self._unpin(r)
        self._uncached.pop(r.id, None)
        if r.on_finish:
            r.on_finish(r)

    # ----------------------------------------------------------------------------------- admission
    def _memo(self, r: Request) -> int:
        """Uncached tokens of a waiting request, read-only (no split, no LRU refresh)."""
        hit = self.cache.peek_prefix_length(r.tokens[:-1]) if self.enable_prefix_cache else 0
        self._uncached[r.id] = (len(r.tokens) - hit, self._steps)
        return len(r.tokens) - hit

    def _refresh_memos(self) -> None:
        if self.fcfs or not self.waiting:
            return
        stale = sorted(self.waiting, key=lambda r: self._uncached.get(r.id, (0, -1))[1])[:REFRESH_PER_STEP]
        for r in stale:
            self._memo(r)

    def _priority(self, r: Request, now: float) -> float:
        if self.fcfs:
            return r.arrival
        uncached = self._uncached[r.id][0] if r.id in self._uncached else self._memo(r)
        return uncached - self.wait_penalty * (now - r.arrival)

    def _bucket(self, r: Request) -> int:
        n = len(r.tokens)
        return next((i for i, bound in enumerate(self.length_buckets) if n < bound), len(self.length_buckets))

    def _pick(self, now: float) -> Request:
        """The next request to admit: length buckets take turns (so one bucket's requests never block another's),
        and inside a bucket the fewest uncached tokens win, minus a wait-time penalty."""
        buckets: dict[int, list[Request]] = {}
        for r in self.waiting:
            buckets.setdefault(self._bucket(r), []).append(r)
        order = sorted(buckets)
        start = next((i for i, b in enumerate(order) if b >= self._next_bucket), 0)
        chosen = order[start]
        self._next_bucket = chosen + 1 if chosen + 1 <= max(order) else 0
        return min(buckets[chosen], key=lambda r: self._priority(r, now))

    def _admit(self, r: Request) -> bool | None:
        """Takes r's KV (True), or leaves it waiting (False: no room), or None: r lacks media rows (`media_span`)
        that the cache no longer holds, and cannot run here as it is."""
        tokens = r.tokens
        # Match at most len-1 tokens: the last one is always computed, its logits give the next token.
        # Prompt logprobs need every prompt position computed, so such requests match nothing.
        use_cache = self.enable_prefix_cache and not r.params.prompt_logprobs
        kv = RequestKV(self.cache, tokens[:-1] if use_cache else [], self.release_interval)
        if kv.cached_tokens < r.media_span:
            kv.finish(cache_result=False)
            return None
        uncached = len(tokens) - kv.cached_tokens
        first = min(self.chunk_size, uncached)
        # The whole uncached prompt must fit in what running prompts leave over (free + evictable full slots),
        # not just its first chunk: admitting prompts whose sum cannot fit only makes them preempt each other.
        need = uncached + self.full_pool.page_size
        if (self.running and not self._fits(need)) or not self.cache.make_room(first + self.full_pool.page_size, first):
            kv.finish(cache_result=False)
            return False
        self._admitted_need += need
        r.kv = kv
        self._unpin(r)  # its own match holds the prefix now
        if not r.output:  # a preempted request keeps its first admission's figure
            r.cached_tokens = kv.cached_tokens
            self.prompt_tokens += len(r.prompt)
        return True

    def _fits(self, need: int) -> bool:
        """Whether a prompt needing `need` more full slots fits what this step leaves: free + evictable full slots,
        less what running prompts still need and what the prompts admitted this step will. Free and pending are taken
        once a step; the evictable slots (a walk over the tree) only when the free ones are not enough, so a step
        whose prompts fit in free slots does no work proportional to the cache."""
        if self._free_room is None:
            pending = sum(
                len(q.prompt) - len(q.kv.tokens)
                for q in self.running
                if q.kv is not None and len(q.kv.tokens) < len(q.prompt)
            )
            self._free_room = self.full_pool.available() - pending
        if need + self._admitted_need <= self._free_room:
            return True
        if self._evictable is None:
            self._evictable = self.cache.full_evictable()
        return need + self._admitted_need <= self._free_room + self._evictable

    def _unpin(self, r: Request) -> None:
        node = self._pins.pop(r.id, None)
        if node is not None:
            self.cache.unlock(node)

    def _release(self, r: Request) -> None:
        assert r.kv is not None
        if r.media_span and r.id not in self._pins:  # keep what it cannot compute until it is admitted again
            self.cache.lock(r.kv.match.node)
            self._pins[r.id] = r.kv.match.node
        r.kv.finish(cache_result=False)
        r.kv = None
        self._memo(r)

    def _preempt(self, r: Request) -> None:
        """Frees r's KV and puts it back at the head of the queue; it is recomputed when admitted again."""
        self.preemptions += 1
        self.running.remove(r)
        self._release(r)
        self.waiting.insert(0, r)


def build_scheduler(role: SchedulerRole | None, kv: KVParts, wake: Callable[[], None], **parts) -> Scheduler:
    """The plain scheduler on `kv`'s pools and cache, or the one a worker role builds (pd/); `parts` are the plain
    scheduler's keyword arguments. The engine and the simulator's worker build theirs here."""
    if role is None:
        return Scheduler(kv.cache, kv.full_pool, kv.swa_pool, **parts)
    return role.scheduler(kv.cache, kv.full_pool, kv.swa_pool, wake, **parts)
