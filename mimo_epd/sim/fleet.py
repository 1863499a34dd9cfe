"""N simulated workers behind a router, on one virtual clock.

Each worker is an `llm_backend.sim.SimWorker` (the engine's own scheduler and SWA radix cache). Each worker's
cache is hooked by the real `KVEventPublisher`, and its block changes are applied to a real `MemoryIndex` the
moment they happen (the live router sees them one long-poll round trip later). At each arrival the router does
what `mimo_epd.router.llm.LLMRouter.pick` does: hash the prompt into blocks, read each worker's block states
from the index, predict reusable tokens (`predict_tokens`), build one `Candidate` per worker with its queued and
running tokens, and let the real policy object rank them; the request goes to the first.

Events are processed in time order: step ends first, then arrivals at the same instant; a worker that is idle
and has work starts a step at once. Lengths given to the policies are real tokens (units x unit).
"""

from __future__ import annotations

import heapq

from llm_backend.kv.events import KVEventPublisher, event_block_size
from llm_backend.kv.tiers import MemoryKVStore
from llm_backend.sim.cost import CostModel
from llm_backend.sim.engine import SimWorker, WorkerConfig
from llm_backend.sim.metrics import summarize
from llm_backend.sim.trace import SimRequest
from mimo_epd.router.index import MemoryIndex, block_hashes, predict_tokens
from mimo_epd.router.policies import Candidate, PolicyConfig, RequestView, make_policy


class _LivePublisher(KVEventPublisher):
    """The real publisher (its mirror and log are kept), also handing each batch of changes to the fleet's index
    at once: the index applies (hash, state) pairs idempotently, so it ends up exactly where a poller would."""

    def __init__(self, cache, block: int, worker: str, index: MemoryIndex):
        super().__init__(cache, block, max_log=1024)
        self.worker, self.index = worker, index

    def _publish(self, changes):
        if changes:
            self.index.apply(self.worker, False, [h for h, _ in changes], [s for _, s in changes])
        super()._publish(changes)


class Fleet:
    def __init__(
        self,
        cost: CostModel,
        config: WorkerConfig,
        workers: int,
        policy: str,
        policy_config: PolicyConfig | None = None,
        block: int = 16,
        store_bytes: int = 0,
    ):
        self.unit = config.unit
        self.index = MemoryIndex()
        # the shared KV tier (L3): one bounded in-process store every worker reads and writes (0 = none)
        self.store = MemoryKVStore(store_bytes) if store_bytes > 0 else None
        self.workers = [SimWorker(cost, config, f"w{i}", store=self.store) for i in range(workers)]
        self.publishers = [
            _LivePublisher(w.cache, event_block_size(w.full_pool.page_size, block), w.name, self.index)
            for w in self.workers
        ]
        self.block = self.publishers[0].block  # in units
        self.policy = make_policy(policy, policy_config)
        self.picks = [0] * workers
        self.finished: list = []  # every worker's finished requests after `run`

    def route(self, spec: SimRequest) -> int:
        names = [w.name for w in self.workers]
        B, U = self.block, self.unit
        hashes = block_hashes(spec.prompt, B)
        states = self.index.states(hashes, names)
        cands = []
        for w in self.workers:
            pred = predict_tokens(states.get(w.name, []), B, len(spec.prompt)) * U
            load = w.load()
            cands.append(
                Candidate(
                    w.name,
                    min(pred, max(0, spec.prompt_len - 1)),
                    load["queued_tokens"],
                    load["running_tokens"],
                    load["waiting"] + load["running"],
                )
            )
        view = RequestView(spec.prompt_len, B * U, tuple(hashes))
        order = self.policy.rank(view, cands)
        self.policy.observe(view, order[0])
        k = names.index(order[0])
        self.picks[k] += 1
        return k

    def run(self, requests: list[SimRequest]) -> dict:
        arrivals = sorted(requests, key=lambda r: (r.arrival, r.index))
        ends: list[tuple[float, int]] = []  # (step end, worker)
        i = 0
        while i < len(arrivals) or ends:
            if ends and (i >= len(arrivals) or ends[0][0] <= arrivals[i].arrival):
                t, k = heapq.heappop(ends)
                w = self.workers[k]
                w.end_step()
                touched = [k]
            else:
                t = arrivals[i].arrival
                touched = []
                while i < len(arrivals) and arrivals[i].arrival <= t:  # every arrival of this instant first
                    k = self.route(arrivals[i])
                    self.workers[k].submit(arrivals[i], arrivals[i].arrival)
                    touched.append(k)
                    i += 1
            for k in dict.fromkeys(touched):
                w = self.workers[k]
                if not w.stepping and w.has_work():
                    end = w.start_step(t)
                    if end is not None:
                        heapq.heappush(ends, (end, k))
        finished = self.finished = [f for w in self.workers for f in w.finished]
        res = summarize(
            finished,
            [w.queue_samples for w in self.workers],
            [w.stats() for w in self.workers],
            sum(len(w.rejected) for w in self.workers),
        )
        res["picks"] = self.picks
        res["index_blocks"] = [self.index.blocks(w.name) for w in self.workers]
        return res


def run_fleet(
    cost: CostModel,
    config: WorkerConfig,
    workers: int,
    policy: str,
    requests: list[SimRequest],
    policy_config: PolicyConfig | None = None,
    store_bytes: int = 0,
) -> dict:
    """One run on fresh workers (the requests are only read)."""
    return Fleet(cost, config, workers, policy, policy_config, store_bytes=store_bytes).run(requests)
