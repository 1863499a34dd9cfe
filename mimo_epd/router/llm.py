"""The LLM router: picks a worker per request by KV affinity (or another policy), for gRPC Generate and HTTP.

Per request: tokenize the prompt like the worker does (the same model's tokenizer), hash its blocks
(llm_backend.kv.events.block_hashes), read from the state (state.py) each live worker's state of those blocks
and its load, predict each worker's reusable prefix (index.predict_tokens), and let the policy (policies.py)
order the workers. The request goes to the first; if that call fails before any token was streamed
(UNAVAILABLE, RESOURCE_EXHAUSTED), to the next, and so on. A worker whose call failed with UNAVAILABLE is
skipped until its KV-event feed answers again.

Where the workers come from: `workers=[...]` (static addresses; this router then runs a WorkerFeed per worker
into its state), or the state's registry (`--router-state redis://...`: whatever `serve` / `serve --join`
nodes registered; their own feeds write the index). Load = the worker's reported queued + running tokens, or
this router's own in-flight count for it when that is higher (it has not been reported yet).

When the state is unreachable (Redis down) the router keeps serving: it routes by load only (its own counts)
on the last workers it knew, logs it once, sets `router_state_degraded` to 1, probes the state every second
and returns to KV-affinity routing when it answers.

The HTTP front (mimo_epd/router/http_front.py) makes the same decisions through the same calls:

    choices = await router.pick(prompt_token_ids)      # ordered: try choices[0], then the next on failure
    flight = router.started(choice, len(prompt_token_ids), front="http"); ...; router.finished(flight)
    router.report(choice, cached_tokens, position)      # what the worker said it reused vs. the prediction

A pick first waits (at most `--index-sync-ms`) for the index to hold what the workers have already answered
(router/sync.py: each response names its worker's KV-event position), so an agent's immediate next turn is
routed on its previous one.

Metrics (mimo_epd/router/metrics.py): requests per worker, retries, the prediction error, the degraded flag, the
index size per worker. A worker marked down is re-checked through its gRPC health service every 100 ms on the
router's own channel (which reconnects quickly, router/channels.py) and routed to again as soon as it says
SERVING, or as soon as its KV-event feed answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import grpc

from mimo_epd.common.auth import client_interceptors
from mimo_epd.common.omni_prompt import OmniTokens, first_media_at
from mimo_epd.common.shutdown import await_chain
from mimo_epd.v1 import generator_pb2_grpc

from .channels import channel_options
from .config import LLMRouterConfig
from .discovery import EncoderSet, WorkerFeed, member_id
from .index import block_hashes, predict_tokens
from .metrics import RouterMetrics
from .policies import Candidate, RequestView, make_policy
from .records import encoder_load
from .state import LOAD_FIELDS, MemoryState, StateUnavailable, open_state
from .sync import IndexSync

log = logging.getLogger(__name__)

RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
CLOSE_WAIT_S = 5.0  # close(): how long the background tasks get to stop once cancelled


def _float(text) -> float:
    try:
        return float(text or 0.0)
    except ValueError:
        return 0.0


@dataclass
class WorkerView:
    id: str
    address: str
    http_address: str = ""
    block_size: int = 16
    load: dict = field(default_factory=dict)
    local_queued: int = 0
    local_running: int = 0
    registered: bool = False  # seen in the registry at the last refresh
    registered_at: float = 0.0  # when it was last seen there (monotonic)
    role: str = "both"  # both, prefill or decode (docs/pd.md): only prefill workers are never sent Generate
    load_at: float = 0.0  # wall time the worker took `load` (its feed reply's time_s, its registration's `updated`)
    # This router's requests to it that finished lately: (wall time, queued tokens, running tokens) each.
    done: deque = field(default_factory=lambda: deque(maxlen=4096))

    def set_load(self, load: dict, at: float) -> None:
        self.load, self.load_at = load, at
        while self.done and self.done[0][0] < at:
            self.done.popleft()

    def current_load(self) -> tuple[int, int, int]:
        """(queued tokens, running tokens, requests) as the worker last said, less this router's own requests that
        finished after it said so (a snapshot taken while the previous turn ran would otherwise push an agent's
        next turn, sent the moment the answer arrives, off its cache), and never below this router's own counts.
        Snapshot and finish times are wall clocks of two machines: a skew misdates only the last moments' flights."""
        q, r = int(self.load.get("queued_tokens", 0)), int(self.load.get("running_tokens", 0))
        n = int(self.load.get("waiting", 0)) + int(self.load.get("running", 0))
        for t, dq, dr in self.done:
            if t >= self.load_at:
                q, r, n = q - dq, r - dr, n - 1
        return max(q, self.local_queued, 0), max(r, self.local_running, 0), max(n, 0)


@dataclass
class Choice:
    worker: str  # member id
    address: str  # gRPC
    http_address: str
    predicted_tokens: int
    rank: int
    hashes: tuple[int, ...] = ()  # the prompt's block hashes (remembered for this worker when it answers)
    role: str = "both"


@dataclass
class _Flight:
    choice: Choice
    prompt_tokens: int
    generated: int = 0
    streaming: bool = False


class LLMRouter(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, config: LLMRouterConfig, state=None, tokenizer=None, encoders=None):
        config.validate()
        self.config = config
        self.state = state if state is not None else open_state(config.router_state)
        self.policy = make_policy(config.policy, config.weights)
        if tokenizer is None:
            from llm_backend.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(config.model, config.tokenizer)
        self.tokenizer = tokenizer
        self.omni = OmniTokens.from_model(config.model)  # MiMo's omni prompt: media placeholders in the text
        self.workers: dict[str, WorkerView] = {}
        self.feeds: dict[str, WorkerFeed] = {}
        self.down: dict[str, float] = {}
        self.flights: dict[str, list[_Flight]] = {}
        self.degraded = False
        # Until then, members missing from the registry stay: a Redis that comes back empty is refilled by the
        # next heartbeats, and dropping every worker meanwhile would fail requests with "tried none".
        self._keep_members_until = 0.0
        self.encoders = EncoderSet(encoders) if encoders is not None else None
        self.router_id = member_id("router", uuid.uuid4().hex[:16])  # its record: the encoder loads it shares
        self.stats = {
            "requests": 0,
            "retries": 0,
            "failed": 0,
            "degraded_picks": 0,
            "picks": {},
            "predictions": 0,
            "predicted_tokens": 0,
            "cached_tokens": 0,
            "abs_error_tokens": 0,
            "exact_predictions": 0,
            "pd_remote": 0,
            "pd_local": 0,
            "pd_retries": 0,
            "pd_prefill_failures_reported": 0,
            "prefill_fallbacks": 0,
            "worker_waits": 0,
        }
        self._tasks: list[asyncio.Task] = []
        self.discovery_errors = 0  # registry reads that failed other than by an unreachable state
        self._closing = False
        self.on_loop_death = None  # callback(loop name): set by the process (health NOT_SERVING)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._rechecks: dict[str, asyncio.Task] = {}
        self._recent: dict[str, OrderedDict[int, float]] = {}  # worker -> block hash -> remembered until
        # read-your-writes (sync.py)
        self.sync = IndexSync(self.state, self.feeds, config.index_sync_ms, config.member_ttl_s)
        self.metrics = RouterMetrics(self)
        self.on_change = None  # callback(live worker ids)
        for spec in filter(None, (s.strip() for s in config.workers.split(","))):
            grpc_addr, _, http = spec.partition("/")
            self.add_worker(grpc_addr, http)

    # ------------------------------------------------------------------------------------------ members
    def add_worker(self, address: str, http_address: str = "") -> None:
        """A worker this router watches itself (a KV-event feed into its state)."""
        wid = member_id("llm", address)
        self.workers[wid] = WorkerView(wid, address, http_address)
        fields_ = {"http_address": http_address} if http_address else {}
        self.feeds[wid] = WorkerFeed(
            self.state, address, fields_, self.config.member_ttl_s, self.config.poll_wait_ms, on_reply=self._on_feed
        )

    def _on_feed(self, feed: WorkerFeed, reply) -> None:
        w = self.workers.get(feed.id)
        if w is not None:
            w.block_size = reply.block_size or w.block_size
            w.role = reply.role or "both"
            w.set_load({k: getattr(reply.load, k) for k in LOAD_FIELDS}, reply.time_s or time.time())
        if self.down.pop(feed.id, None) is not None:
            log.info("LLM worker %s is back", feed.address)

    async def start(self, wait_s: float = 5.0) -> None:
        """Starts the feeds and the registry reads; waits (up to `wait_s`) until some worker is live."""
        for f in self.feeds.values():
            f.start()
        task = asyncio.get_running_loop().create_task(self._discovery_loop(), name="discovery")
        task.add_done_callback(self._loop_ended)
        self._tasks.append(task)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(self.live()) < max(1, len(self.feeds)):
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self._closing = True
        tasks = [*self._tasks, *self._rechecks.values()]
        for t in tasks:
            t.cancel()
        if tasks:  # a task stuck in a client's own cleanup (redis-py closing a socket) is abandoned, named, not awaited
            _, stuck = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            for t in stuck:
                log.warning(
                    "router close: the %s task did not stop in %g s; abandoned (%s)",
                    t.get_name(),
                    CLOSE_WAIT_S,
                    await_chain(t),
                )
        await asyncio.gather(*(f.stop() for f in self.feeds.values()), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._channels.values()), return_exceptions=True)
        if self.encoders is not None:  # its shared encoder loads go with it (else they expire in one TTL)
            try:
                await asyncio.wait_for(self.state.unregister(self.router_id), 1.0)
            except (StateUnavailable, TimeoutError):
                pass
        await self.state.close()

    async def refresh(self) -> None:
        """Reads the registry: workers (with load and block size) and, when asked, encoders."""
        members = await self.state.members()
        llm = {m: f for m, f in members.items() if f.get("kind") == "llm"}
        for w in self.workers.values():
            w.registered = w.id in llm
            if w.registered:
                w.registered_at = time.monotonic()
        for wid, f in llm.items():
            w = self.workers.get(wid)
            if w is None and self.feeds:
                continue  # a router given --workers routes over those only
            if w is None:
                w = self.workers[wid] = WorkerView(wid, f.get("address", wid.split("/", 1)[-1]))
                log.info("LLM worker %s joined (node %s)", w.address, f.get("node", "?"))
            w.registered = True
            w.registered_at = time.monotonic()
            w.http_address = f.get("http_address", w.http_address)
            w.block_size = int(f.get("block_size") or w.block_size or 16)
            w.role = f.get("role") or w.role
            w.set_load({k: int(f.get(k) or 0) for k in LOAD_FIELDS}, _float(f.get("updated")) or time.time())
        keep = time.monotonic() < self._keep_members_until
        if not self.feeds and not keep:  # discovered workers leave when their registration expires
            for wid in [w for w in self.workers if w not in llm]:
                log.info("LLM worker %s left (its registration expired)", self.workers[wid].address)
                del self.workers[wid]
        if self.encoders is not None:
            enc = {f["address"] for f in members.values() if f.get("kind") == "encoder" and f.get("address")}
            if enc:
                self.encoders.sync(enc | self.encoders.router.endpoints if keep else enc)
            await self._share_encoder_load(members)

    async def _share_encoder_load(self, members: dict[str, dict]) -> None:
        """Publishes this router's items in flight per encoder (its registry record, one TTL) and gives the
        encoder router the other routers' sum, so every router's bounded loads count every router's items."""
        router = self.encoders.router
        mine = {e: n for e, n in router.inflight.items() if n > 0}
        fields = {"kind": "router", "encoder_load": json.dumps(mine)}
        await self.state.register(self.router_id, fields, self.config.member_ttl_s)
        others: Counter[str] = Counter()
        for mid, f in members.items():
            if f.get("kind") == "router" and mid != self.router_id:
                others.update(encoder_load(f.get("encoder_load", "{}")))
        router.set_remote_load(others)

    async def _discovery_loop(self) -> None:
        while True:
            try:
                if self.degraded and await self.state.ping():
                    self.degraded = False
                    self._keep_members_until = time.monotonic() + self.config.member_ttl_s
                    log.warning("router state %s answers again: KV-affinity routing resumed", self.config.router_state)
                if not self.degraded:
                    await self.refresh()
                    await self._index_sizes()
            except StateUnavailable as e:
                self._degrade(e)
            except Exception:  # a bug or a record records.py let through: logged, counted, the loop lives on
                self.discovery_errors += 1
                log.exception("router discovery: reading the registry failed; retrying")
            await asyncio.sleep(self.config.discovery_interval_s if not self.degraded else 1.0)

    async def _index_sizes(self) -> None:
        """Blocks per worker in the index, for `router_index_blocks` (an HLEN per worker with Redis)."""
        ids = list(self.workers)
        if isinstance(self.state, MemoryState):
            sizes = {w: self.state.index.blocks(w) for w in ids}
        elif hasattr(self.state, "r") and ids:
            pipe = self.state.r.pipeline(transaction=False)
            for w in ids:
                pipe.hlen(self.state._kv(w))
            sizes = dict(zip(ids, await self.state._run(pipe.execute())))
        else:
            sizes = {}
        self.metrics.index_blocks = {self.workers[w].address: int(n) for w, n in sizes.items() if w in self.workers}

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A background loop that ends before close() is an error, never silent: logged, and `on_loop_death`
        (the process sets its health NOT_SERVING) is called."""
        if task.cancelled() and self._closing:
            return
        err = None if task.cancelled() else task.exception()
        log.error("router: the %s loop ended (%r); this router no longer follows the registry", task.get_name(), err)
        if self.on_loop_death is not None:
            self.on_loop_death(task.get_name())

    def discovery_alive(self) -> bool:
        """Whether the registry reads still run (they end only with the router)."""
        return any(t.get_name() == "discovery" and not t.done() for t in self._tasks)

    def _degrade(self, err) -> None:
        if not self.degraded:
            log.warning("router state unavailable (%s): routing by load only until it answers", err)
        self.degraded = True

    def live(self) -> list[WorkerView]:
        now = time.monotonic()
        out = []
        for wid, w in sorted(self.workers.items()):
            until = self.down.get(wid)
            if until is not None and until > now:
                continue
            feed = self.feeds.get(wid)
            # Another relay writes this worker (feed.ok is None): it is live while registered, and for one TTL after
            # its last registration, which spans a relay handover (the old lease and entries expire before the
            # next relay's first write; a dead worker is caught by the retry and mark_down meanwhile).
            if (
                feed is not None
                and not self.degraded
                and not (
                    feed.ok or (feed.ok is None and (w.registered or now - w.registered_at < self.config.member_ttl_s))
                )
            ):
                continue
            out.append(w)
        return out

    # ------------------------------------------------------------------------------------------ picking
    async def first_pick(self, prompt_token_ids) -> list[Choice]:
        """`pick`, and when no worker is live, picks again until one is or `--worker-wait-s` passes: a worker that
        restarts, or whose heartbeat came late under load (its registration expired for a moment), costs the
        request a short wait, not an error (`worker_waits`)."""
        choices = await self.pick(prompt_token_ids)
        if choices or self.config.worker_wait_s <= 0:
            return choices
        self.stats["worker_waits"] += 1
        deadline = time.monotonic() + self.config.worker_wait_s
        while not choices and time.monotonic() < deadline:
            await asyncio.sleep(min(0.1, self.config.discovery_interval_s))
            if not self.degraded and not self._closing:
                try:
                    await self.refresh()
                except StateUnavailable as e:
                    self._degrade(e)
            choices = await self.pick(prompt_token_ids)
        return choices

    async def pick(
        self, prompt_token_ids, exclude: set[str] = frozenset(), roles: tuple[str, ...] = ("both", "decode")
    ) -> list[Choice]:
        """Every live worker of `roles`, best first, with the tokens each is predicted to reuse (prefill workers
        are picked separately, for a decode worker's request: `pick_prefill`). When no worker that decodes is live
        (a P/D node whose decode workers are all down or restarting), the prefill workers take the request
        themselves, colocated: slower, not an error (`prefill_fallbacks`)."""
        workers = [w for w in self.live() if w.id not in exclude and w.role in roles]
        if not workers and "decode" in roles:
            workers = [w for w in self.live() if w.id not in exclude and w.role == "prefill"]
            if workers:
                self.stats["prefill_fallbacks"] += 1
        if not workers:
            return []
        tokens = list(prompt_token_ids)
        B = workers[0].block_size or 16
        hashes = block_hashes(tokens, B)
        states: dict[str, list[int]] = {}
        if not self.degraded:
            try:
                await self.sync.wait([w.id for w in workers])  # the index has what they answered, or the wait ended
                self._take_synced_loads(workers)
                states = await self.state.lookup(hashes, [w.id for w in workers])
            except StateUnavailable as e:
                self._degrade(e)
        if self.degraded:
            self.stats["degraded_picks"] += 1
        predicted = {w.id: predict_tokens(states.get(w.id, []), B, len(tokens)) for w in workers}
        if not self.degraded:  # what this router saw answered, not in the index yet
            cap = max(0, (len(tokens) - 1) // B)
            for w in workers:
                predicted[w.id] = max(predicted[w.id], self._recent_match(w.id, hashes[:cap]) * B)
        cands = []
        for w in workers:
            q, r, n = w.current_load() if not self.degraded else (w.local_queued, w.local_running, 0)
            cands.append(Candidate(w.id, predicted[w.id], q, r, max(n, len(self.flights.get(w.id, ())))))
        view = RequestView(len(tokens), B, tuple(hashes))
        order = self.policy.rank(view, cands)
        self.policy.observe(view, order[0])
        by_id = {w.id: w for w in workers}
        return [
            Choice(wid, by_id[wid].address, by_id[wid].http_address, predicted[wid], i, tuple(hashes), by_id[wid].role)
            for i, wid in enumerate(order)
        ]

    async def pick_prefill(self, tokens, exclude: set[str] = frozenset()) -> str:
        """The prefill worker of a decode worker's request: KV affinity over the prefill workers' own KV events (the
        policy), or "local" (prefill on the decode worker: conditional disaggregation) when there is none, or when
        every prefill worker has more than `--pd-max-prefill-queue` prompt tokens queued."""
        choices = await self.pick(tokens, exclude, roles=("prefill",))
        limit = self.config.pd_max_prefill_queue
        queued = {c.worker: self._queued(c.worker) for c in choices}
        if not choices or (limit >= 0 and all(q > limit for q in queued.values())):
            self.stats["pd_local"] += 1
            self.metrics.pd_paths.labels("local").inc()
            return "local"
        self.stats["pd_remote"] += 1
        self.metrics.pd_paths.labels("remote").inc()
        return choices[0].address

    def _take_synced_loads(self, workers) -> None:
        """The loads read with the positions the index sync waited on (another router's feeds wrote them), where
        newer than this router's view: the load after the answers it waited for, not a registry read's."""
        for w in workers:
            load = self.sync.loads.pop(w.id, None)
            if load is not None and load["updated"] > w.load_at:
                w.set_load({k: load[k] for k in LOAD_FIELDS}, load["updated"])

    def _queued(self, wid: str) -> int:
        w = self.workers[wid]
        return w.current_load()[0] if not self.degraded else w.local_queued

    # A worker publishes a request's blocks when it caches them, and the feed brings them a poll later: a client
    # that sends its next turn as soon as the answer arrives is routed before the index knows. So the router
    # also remembers, for one member TTL, the blocks of the prompts each worker has just answered (its own,
    # local knowledge; the index stays the feeds' alone) and predicts the longer of the two matches.
    def _remember(self, choice: Choice) -> None:
        if not choice.hashes:
            return
        recent = self._recent.setdefault(choice.worker, OrderedDict())
        now = time.monotonic()
        until = now + self.config.member_ttl_s
        for h in choice.hashes:
            recent[h] = until
            recent.move_to_end(h)
        while recent and (next(iter(recent.values())) < now or len(recent) > 65536):
            recent.popitem(last=False)

    def _recent_match(self, wid: str, hashes) -> int:
        recent = self._recent.get(wid)
        if not recent:
            return 0
        now, n = time.monotonic(), 0
        for h in hashes:
            if recent.get(h, 0.0) < now:
                break
            n += 1
        return n

    def started(self, choice: Choice, prompt_tokens: int, front: str = "grpc") -> _Flight:
        f = _Flight(choice, prompt_tokens)
        self.flights.setdefault(choice.worker, []).append(f)
        self.stats["picks"][choice.worker] = self.stats["picks"].get(choice.worker, 0) + 1
        self.metrics.requests.labels(choice.address, front).inc()
        self._recount(choice.worker)
        return f

    def progressed(self, flight: _Flight, tokens: int = 1) -> None:
        flight.streaming = True
        flight.generated += tokens
        self._recount(flight.choice.worker)

    def finished(self, flight: _Flight) -> None:
        lst = self.flights.get(flight.choice.worker, [])
        if flight in lst:
            lst.remove(flight)
            w = self.workers.get(flight.choice.worker)
            if w is not None:  # its footprint, as _recount counted it, leaves the worker's last snapshot too
                queued = 0 if flight.streaming else flight.prompt_tokens - flight.choice.predicted_tokens
                running = flight.prompt_tokens + flight.generated if flight.streaming else 0
                w.done.append((time.time(), queued, running))
        self._recount(flight.choice.worker)

    def _recount(self, wid: str) -> None:
        w = self.workers.get(wid)
        if w is None:
            return
        fl = self.flights.get(wid, [])
        w.local_queued = sum(f.prompt_tokens - f.choice.predicted_tokens for f in fl if not f.streaming)
        w.local_running = sum(f.prompt_tokens + f.generated for f in fl if f.streaming)

    def report(self, choice: Choice, cached_tokens: int, kv_events_position: str = "") -> None:
        """A worker's answer: its cached tokens against the prediction, and where its KV-event log stood then."""
        self.sync.expect(choice.worker, kv_events_position)
        s = self.stats
        s["predictions"] += 1
        s["predicted_tokens"] += choice.predicted_tokens
        s["cached_tokens"] += cached_tokens
        s["abs_error_tokens"] += abs(cached_tokens - choice.predicted_tokens)
        s["exact_predictions"] += int(cached_tokens == choice.predicted_tokens)
        self._remember(choice)
        m = self.metrics
        m.error.observe(cached_tokens - choice.predicted_tokens)
        m.over.inc(max(0, cached_tokens - choice.predicted_tokens))
        m.under.inc(max(0, choice.predicted_tokens - cached_tokens))
        m.predicted.inc(choice.predicted_tokens)
        m.cached.inc(cached_tokens)

    def retried(self) -> None:
        self.stats["retries"] += 1
        self.metrics.retries.inc()

    def failed(self) -> None:
        self.stats["failed"] += 1
        self.metrics.failed.inc()

    def mark_down(self, choice: Choice, why: str) -> None:
        if self.down.get(choice.worker, 0) < time.monotonic():
            log.warning("LLM worker %s failed (%s): skipped until it answers again", choice.address, why)
        self.down[choice.worker] = time.monotonic() + self.config.down_s
        feed = self.feeds.get(choice.worker)
        if feed is not None:
            feed.ok = False
        task = self._rechecks.get(choice.worker)
        if task is None or task.done():
            self._rechecks[choice.worker] = asyncio.get_running_loop().create_task(
                self._recheck(choice.worker, choice.address)
            )

    async def _recheck(self, wid: str, address: str) -> None:
        """Routes to a worker that failed again as soon as its health service says SERVING (its feed may take a
        poll longer, and a discovered worker has no feed here): polled every 100 ms on the Generate channel, so
        that channel is connected again too."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel(address))
        while wid in self.down and wid in self.workers:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    self.down.pop(wid, None)
                    feed = self.feeds.get(wid)
                    if feed is not None and feed.ok is False:
                        feed.ok = True  # its next poll (a full snapshot for a new process) follows
                    log.info("LLM worker %s serves again", address)
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)

    def http_upstream(self) -> str | None:
        """The HTTP address of the live worker with the fewest tokens in flight from this router (for a front
        that forwards whole HTTP requests; one that tokenizes should call `pick`)."""
        live = [w for w in self.live() if w.http_address]
        if not live:
            return None
        return min(
            live, key=lambda w: (w.local_queued + w.local_running, len(self.flights.get(w.id, ())), w.id)
        ).http_address

    def summary(self) -> dict:
        s = dict(self.stats)
        n = max(1, s["predictions"])
        s["mean_abs_prediction_error_tokens"] = s["abs_error_tokens"] / n
        s["degraded"] = self.degraded
        s["policy"] = self.config.policy
        s["live_workers"] = [w.address for w in self.live()]
        return s

    # ------------------------------------------------------------------------------------------ gRPC Generate
    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:  # quick reconnects: a restarted worker is routed to within ~1 s of serving again
            ch = self._channels[address] = grpc.aio.insecure_channel(
                address, options=channel_options(256), interceptors=client_interceptors()
            )
        return ch

    def _stub(self, address: str):
        return generator_pb2_grpc.GeneratorStub(self._channel(address))

    def _prefill_failed(self, address: str) -> None:
        """A prefill worker a decode worker gave up on (it then prefilled the request itself): marked down here
        too, so the next requests are not sent through it while it is dead or hung."""
        pchoice = Choice(member_id("llm", address), address, "", 0, 0, role="prefill")
        if pchoice.worker in self.workers:
            self.mark_down(pchoice, "a decode worker's KV transfer from it failed")
        self.stats["pd_prefill_failures_reported"] += 1

    def _retry_prefill(self, choice: Choice, request, flight: _Flight, e, failed: set[str]) -> bool:
        """Whether a decode worker's failed transfer is retried on another prefill worker: once, and only when no
        token was streamed (after one, the client gets the error: never a truncated answer marked complete)."""
        addr = request.prefill_address
        if choice.role != "decode" or flight.streaming or failed or addr in ("", "local"):
            return False
        if e.code() != grpc.StatusCode.UNAVAILABLE or "KV transfer failed" not in (e.details() or ""):
            return False
        failed.add(member_id("llm", addr))
        pchoice = Choice(member_id("llm", addr), addr, "", 0, 0, role="prefill")
        if pchoice.worker in self.workers:
            self.mark_down(pchoice, e.details() or "transfer failed")
        self.stats["pd_retries"] += 1
        self.retried()
        log.info("retrying a request on decode worker %s with another prefill worker after: %s", choice.address, e)
        return True

    async def Generate(self, request, context):
        self.stats["requests"] += 1
        if request.prompt_token_ids:
            tokens = list(request.prompt_token_ids)
        else:
            tokens = self.tokenizer.encode(request.prompt)
        if request.media:  # the placeholder ids come from the encoder's content keys: only the ids before them
            at = first_media_at(request.prompt) if self.omni is not None and not request.prompt_token_ids else -1
            tokens = self.tokenizer.encode(request.prompt[:at]) if at >= 0 else tokens[:1]
        tried: list[str] = []
        choices = await self.first_pick(tokens)
        failed_prefill: set[str] = set()
        while choices:
            choice = choices[0]
            tried.append(choice.address)
            if choice.role == "decode":  # the decode worker asks this prefill worker (or prefills itself)
                request.prefill_address = await self.pick_prefill(tokens, failed_prefill)
            flight = self.started(choice, len(tokens))
            call = self._stub(choice.address).Generate(request, timeout=context.time_remaining())
            try:
                async for msg in call:
                    if msg.HasField("delta"):
                        self.progressed(flight, max(1, len(msg.delta.token_ids)))
                    elif msg.HasField("final"):
                        self.report(choice, msg.final.cached_tokens, msg.final.kv_events_position)
                        await self.sync.shared()  # another router may get the client's next turn at once
                        if msg.final.prefill_failed_address:  # the decode worker prefilled it after a failed transfer
                            self._prefill_failed(msg.final.prefill_failed_address)
                    yield msg
                return
            except grpc.aio.AioRpcError as e:
                if self._retry_prefill(choice, request, flight, e, failed_prefill):
                    continue  # the same decode worker, another prefill worker: once
                if flight.streaming or e.code() not in RETRY_CODES:
                    self.failed()
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        self.mark_down(choice, e.details() or e.code().name)
                    await context.abort(e.code(), e.details())
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.mark_down(choice, e.details() or e.code().name)
                self.retried()
                log.info("retrying a request on the next worker after %s from %s", e.code().name, choice.address)
            finally:
                self.finished(flight)
                call.cancel()
            choices = await self.pick(tokens, exclude={member_id("llm", a) for a in tried})
        self.failed()
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"no live LLM worker could take the request (tried {', '.join(tried) or 'none'})",
        )
