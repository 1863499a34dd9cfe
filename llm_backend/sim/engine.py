"""One simulated LLM worker on a virtual clock: the engine's own Scheduler, SWARadixCache, SlotPool and RequestKV
(imported, unchanged), with `SimRunner` in place of the model runner.

`SimWorker` is driven by whoever owns the clock (a single-worker loop, `simulate`, or the fleet in
mimo_epd/sim): `submit(spec, now)` queues a request, `start_step(now)` asks the scheduler for the next step and
returns when it ends (or None when there is nothing to run), `end_step()` books the step's results at that time.
The scheduler's `clock` is the virtual time, so TTFT, wait penalties and admission times are all virtual.

Sizes are given in real tokens and divided by `unit` (runner.py explains units): pools, page, chunk, window
(rounded up), length buckets and the wait penalty (tokens per second). With unit 1 the worker is the live
engine's scheduling exactly (`mimo-epd sim validate` checks the cached tokens per request).

With `host_full_tokens` / `host_swa_tokens` or a shared `store`, the worker runs the engine's own `TieredRadixCache`
below its pools (bookkeeping mode) and each step's loads are priced by `links` (tiers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.interfaces import Ticket
from ..engine.request import PromptTooLong, Request, SamplingParams
from ..engine.scheduler import build_scheduler
from ..kv import fit_checkpoint_interval
from ..kv.build import KVLayout, build_kv
from .cost import CostModel
from .runner import SimRunner, output_units
from .tiers import LoadTotals, TierLinks
from .trace import SimRequest


@dataclass
class WorkerConfig:
    full_tokens: int = 16384  # KV pool sizes in real tokens
    swa_tokens: int = 4096
    page_size: int = 1
    chunk_size: int = 512
    max_running: int = 16
    max_prefill_tokens: int = 0  # prefill tokens per step (real tokens; 0 = no cap), as the engine's flag
    prefill_order: str = "fewest_left"  # who takes that budget first, as the engine's --prefill-order
    prefix_cache: bool = True
    release_interval: int = 16
    fcfs: bool = False
    wait_penalty: float = 2048.0  # tokens per second waited
    length_buckets: tuple[int, ...] = (65536, 262144)
    unit: int = 1
    host_full_tokens: int = 0  # host KV tier (real tokens of full-layer KV; 0 = off) and its SWA window slots
    host_swa_tokens: int = 0
    swa_backfill: bool = False  # the engine's --swa-backfill
    swa_checkpoint_interval: int = 512  # the engine's --swa-checkpoint-interval (real tokens; fitted to pages, 0 = off)
    links: TierLinks = field(default_factory=TierLinks)


@dataclass
class Finished:
    """What a finished request reports (times in virtual seconds, lengths in real tokens)."""

    index: int
    worker: str
    arrival: float
    first_token: float
    finish: float
    prompt_len: int
    cached_tokens: int
    output_len: int
    reason: str
    meta: dict = field(default_factory=dict)


def _no_wake() -> None:
    return None


def worker_layout(cost: CostModel, config: WorkerConfig, store=None) -> KVLayout:
    """The KV bookkeeping a worker of `config` builds (sizes in units): its pools, the model's window, the SWA
    checkpoint interval as the engine fits it, and the tiers below the pools when configured."""
    c, U = config, config.unit
    window, page = -(-cost.shape.window // U), max(1, c.page_size // U)
    return KVLayout(
        c.full_tokens // U,
        c.swa_tokens // U,
        page,
        window,
        # as the engine fits its default: a page multiple above the window (in units)
        checkpoint_interval=fit_checkpoint_interval(-(-c.swa_checkpoint_interval // U), window, page),
        # the tiers below it (bookkeeping mode: they count a unit as a token)
        host_full_tokens=c.host_full_tokens // U,
        host_swa_tokens=c.host_swa_tokens // U,
        store=store,
        store_write="insert",
        swa_backfill=c.swa_backfill,
        token_bytes=(cost.shape.kv_bytes_full * U, cost.shape.kv_bytes_swa * U),
    )


class SimWorker:
    def __init__(
        self,
        cost: CostModel,
        config: WorkerConfig,
        name: str = "w0",
        store=None,
        runner=None,
        role=None,
        layout: KVLayout | None = None,
    ):
        """`runner`: a SimRunner subclass to use instead (speculative decoding: sim/speculation.py). `role`: the
        engine's scheduler role (`SchedulerRole`; the decode role in the P/D simulator, mimo_epd/sim/pd.py).
        `layout`: the KV bookkeeping to build instead of `worker_layout(cost, config, store)` (a benchmark's own
        pools, window or tiers; sizes in units); `config` still gives the scheduler's settings."""
        c, U = config, config.unit
        self.name, self.config, self.unit = name, config, U
        kv = build_kv(layout or worker_layout(cost, config, store))
        self.full_pool, self.swa_pool, self.cache, self.tiers = kv.full_pool, kv.swa_pool, kv.cache, kv.tiers
        self.now = 0.0
        self.runner = runner or SimRunner(cost, U)
        parts = dict(
            chunk_size=max(1, c.chunk_size // U),
            max_running=c.max_running,
            enable_prefix_cache=c.prefix_cache,
            release_interval=c.release_interval,
            fcfs=c.fcfs,
            wait_penalty=c.wait_penalty / U,
            length_buckets=tuple(b // U for b in c.length_buckets),
            clock=lambda: self.now,
            max_prefill_tokens=c.max_prefill_tokens // U,
            prefill_order=c.prefill_order,
            drafter=self.runner,
        )
        # news from a simulated peer needs no waking: the simulator's clock steps the worker
        self.scheduler = build_scheduler(role, kv, _no_wake, **parts)
        self.loads = LoadTotals()
        self.finished: list[Finished] = []
        self.rejected: list[tuple[int, str]] = []
        self.queue_samples: list[tuple[float, int, int]] = []  # (time, waiting, running) at each step start
        self._ids = 0
        self._step: tuple | None = None
        self._bytes_seen = (0, 0)
        self.busy_until: float | None = None

    # ----------------------------------------------------------------------------------- requests
    def submit(self, spec: SimRequest, now: float, ticket: Ticket | None = None) -> Request | None:
        """Queues `spec`, arrived at virtual time `now`; None (and a `rejected` entry) when it can never fit.
        `ticket`: what the worker's role needs of it (the decode role's PDTicket)."""
        self.now = max(self.now, now)
        params = SamplingParams(max_tokens=output_units(spec.output_len, self.unit), ignore_eos=True)
        r = Request(self._ids, list(spec.prompt), params, now, on_finish=self._on_finish)
        self._ids += 1
        try:
            self.scheduler.check_fits(len(r.prompt))
        except PromptTooLong as e:
            self.rejected.append((spec.index, str(e)))
            return None
        self.runner.register(r.id, spec)
        self.scheduler.add(r, ticket)
        return r

    def _on_finish(self, r: Request) -> None:
        st = self.runner.states.get(r.id)
        if st is None:
            return
        spec = st.spec
        self.runner.forget(r.id)
        self.finished.append(
            Finished(
                spec.index,
                self.name,
                r.arrival,
                r.first_token_at if r.output else self.now,
                self.now,
                spec.prompt_len,
                min(spec.prompt_len, r.cached_tokens * self.unit),
                st.generated,
                r.finish_reason,
                spec.meta,
            )
        )

    # ----------------------------------------------------------------------------------- steps
    def start_step(self, now: float) -> float | None:
        """Schedules the next step at `now`; returns its end time (None: nothing to run)."""
        self.now = max(self.now, now)
        s = self.scheduler
        self.queue_samples.append((self.now, len(s.waiting), len(s.running)))
        segments = s.schedule()
        if not segments:
            self.busy_until = None
            return None
        results = self.runner.execute(segments)
        self._step = (segments, results)
        seconds = self.runner.last_seconds
        if self.tiers is not None:
            seconds = self._price_loads(seconds)
        self.busy_until = self.now + seconds
        return self.busy_until

    def _price_loads(self, compute_s: float) -> float:
        """This step's admissions queued host / store copies (the tiered match): their bytes, priced by the links."""
        t = self.tiers
        load = t.start_load()  # bookkeeping mode takes the queued copies (nothing to copy); data mode copies them
        if load is not None:
            load.finish()
        host, store = t.tier_stats.bytes_h2d, t.tier_stats.bytes_s2d
        dh, ds = host - self._bytes_seen[0], store - self._bytes_seen[1]
        self._bytes_seen = (host, store)
        if not dh and not ds:
            return compute_s
        links = self.config.links
        load_s = links.load_seconds(dh, ds)
        step_s = links.step_seconds(compute_s, load_s)
        self.loads.add(dh, ds, load_s, compute_s, step_s)
        self.runner.busy_s += step_s - compute_s
        return step_s

    def end_step(self) -> None:
        segments, results = self._step
        self._step = None
        self.now = self.busy_until
        self.scheduler.complete(segments, results)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def drain(self) -> None:
        """Steps until nothing is left to run (what has been submitted finished, or waits for room that never
        comes)."""
        while self.has_work():
            if self.start_step(self.now) is None:
                return
            self.end_step()

    @property
    def stepping(self) -> bool:
        """Between start_step and end_step."""
        return self._step is not None

    def load(self) -> dict:
        """Queued and running tokens (real), as a live worker reports them (llm_backend.kv.events.engine_load)."""
        s, U = self.scheduler, self.unit
        return {
            "queued_tokens": sum(len(r.prompt) for r in s.waiting) * U,
            "running_tokens": sum(len(r.prompt) + len(r.output) for r in s.running) * U,
            "waiting": len(s.waiting),
            "running": len(s.running),
        }

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "steps": self.runner.steps,
            "busy_s": round(self.runner.busy_s, 3),
            "preemptions": s.preemptions,
            "prefix_hit_tokens": self.cache.stats.hit_tokens * self.unit,
            "rejected": len(self.rejected),
            **(self._tier_stats() if self.tiers is not None else {}),
        }

    def _tier_stats(self) -> dict:
        t, U = self.tiers.tier_stats, self.unit
        return {
            "hit_tokens_by_tier": {"device": t.hit_device * U, "host": t.hit_host * U, "store": t.hit_store * U},
            "tier_loads": self.loads.as_dict(),
        }


def simulate(worker: SimWorker, requests: list[SimRequest]) -> SimWorker:
    """Runs `requests` through one worker until every one finished: arrivals up to the current time are queued
    before each step starts, and arrivals during a step wait for its end (as the live loop does)."""
    arrivals = sorted(requests, key=lambda r: (r.arrival, r.index))
    inf = float("inf")
    i, t = 0, 0.0
    while True:
        while i < len(arrivals) and arrivals[i].arrival <= t:
            worker.submit(arrivals[i], arrivals[i].arrival)  # its true arrival: TTFT counts the wait for the step
            i += 1
        end = worker.start_step(t) if worker.has_work() else None
        if end is not None:
            t = end
            worker.end_step()
            continue
        nxt = arrivals[i].arrival if i < len(arrivals) else inf
        if nxt == inf:
            return worker
        t = max(t, nxt)
