"""LLM routing policies: which worker serves a request, best first (formulas and sources in docs/routing.md).

Every policy takes the same small typed view — the request (`RequestView`: its tokens, in blocks) and one
`Candidate` per live worker (predicted reusable tokens from the page-hash index, queued and running tokens) —
and returns every candidate's worker in the order to try them (the first is the pick, the rest are retries).
Policies are pure functions of that view plus, for `round_robin` / ties and `cache_aware`'s approximate trees,
their own small state updated only through `observe(request, worker)`; the same sequence of calls gives the
same answers, so a simulator can run them as they are.

- `affinity` (default): a request that some worker's cache holds more than `new_threshold` of (a returning
  session) is scored: match_weight x prefix_match_fraction - load_weight x normalized_load
  - queued_prefill_weight x normalized_prefill, where normalized_load = (queued + running tokens) / the largest such
  load among the candidates and normalized_prefill = (the request's uncached tokens on that worker + its
  queued prompt tokens) / the largest such figure: the prefill the request would wait behind and run, which is
  what its TTFT is made of (kv_cost's prefill term, normalized like the load). A request no cache holds (a new
  session) goes to the worker this router has sent the fewest distinct blocks (`RoutedBlocks`), then the least
  loaded (unless this router's own record says it sent the prompt's prefix somewhere: the index has not caught up
  yet, and that record's match is scored instead): sessions come back, so spreading their first turns by footprint rather than by the load of the moment
  evens the load to come (SGLang's gateway places its cold requests by the same signal; docs/routing.md has the
  measurement that made this the rule).
- `round_robin`: the next worker in turn.
- `least_load`: the fewest queued + running tokens.
- `cache_aware` (SGLang's gateway): load = requests in flight on the worker (SGLang counts the requests it sent
  that have not finished, not tokens); if the loads are imbalanced (max - min > balance_abs and
  max > balance_rel x min), the least loaded; else, if the best match fraction in the router's own approximate
  tree of what it routed exceeds cache_threshold, that worker; else the worker with the smallest tree.
- `kv_cost` (Dynamo's KV router): cost = prefill_weight x prefill blocks (the request's uncached blocks on that
  worker + its queued prefill blocks) + decode blocks (its running tokens in blocks); the lowest wins.

Ties are broken by a rotating offset (so idle workers share the first requests) and then by name.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mimo_epd.common.flags import flag


@dataclass(frozen=True)
class RequestView:
    num_tokens: int
    block_size: int = 16
    block_hashes: tuple[int, ...] = ()  # chained hashes of the complete blocks (llm_backend.kv.events)


@dataclass(frozen=True)
class Candidate:
    worker: str
    matched_tokens: int = 0  # tokens this worker would reuse (the index's prediction)
    queued_tokens: int = 0
    running_tokens: int = 0
    in_flight: int = 0  # requests sent to this worker and not finished (cache_aware's load)

    @property
    def load(self) -> int:
        return self.queued_tokens + self.running_tokens


@dataclass
class PolicyConfig:
    """The policies' knobs; each is a flag of `serve` and `router` (embedded in LLMRouterConfig)."""

    match_weight: float = flag(2.0, "affinity: weight of the prefix match fraction", name="affinity_match_weight")
    load_weight: float = flag(1.0, "affinity: weight of the normalized load", name="affinity_load_weight")
    queued_prefill_weight: float = flag(
        0.0,
        "affinity: weight of the normalized queued + own uncached prefill tokens",
        name="affinity_queued_prefill_weight",
    )
    new_threshold: float = flag(
        0.1,
        "affinity: a request no worker's cache holds more than this fraction of is a new session, placed on the "
        "worker sent the fewest distinct blocks (-1 = never: scored like any other)",
        name="affinity_new_session_threshold",
    )
    balance_abs: int = flag(
        64, "cache_aware: load gap in tokens that counts as imbalance", name="cache_aware_balance_abs"
    )
    balance_rel: float = flag(1.5, "cache_aware: load ratio that counts as imbalance", name="cache_aware_balance_rel")
    cache_threshold: float = flag(
        0.3, "cache_aware: match fraction above which the cache decides", name="cache_aware_threshold"
    )
    tree_blocks: int = flag(
        1 << 16,
        "cache_aware and affinity: blocks remembered per worker of what this router sent it (oldest forgotten first)",
        name="cache_aware_tree_blocks",
    )
    prefill_weight: float = flag(
        1.0, "kv_cost: weight of prefill blocks against decode blocks", name="kv_cost_prefill_weight"
    )


class Policy:
    name = ""

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self._turn = 0

    def rank(self, request: RequestView, candidates: list[Candidate]) -> list[str]:
        if not candidates:
            return []
        keys = self._keys(request, candidates)
        n = len(candidates)
        order = sorted(range(n), key=lambda i: (keys[i], (i - self._turn) % n, candidates[i].worker))
        self._turn += 1
        return [candidates[i].worker for i in order]

    def _keys(self, request: RequestView, candidates: list[Candidate]) -> list[float]:
        """Lower is better; equal keys are broken by the rotation."""
        raise NotImplementedError

    def observe(self, request: RequestView, worker: str) -> None:
        """The request was sent to `worker`."""


class RoundRobin(Policy):
    name = "round_robin"

    def _keys(self, request, candidates):
        return [0.0] * len(candidates)


class LeastLoad(Policy):
    name = "least_load"

    def _keys(self, request, candidates):
        return [float(c.load) for c in candidates]


class RoutedBlocks:
    """What a router sent where: per worker, the block hashes of the prompts routed to it, LRU-bounded to `limit`
    blocks per worker. Updated when a request is routed, so a burst of requests sees its own earlier picks (the
    index learns of a prompt's blocks only once the worker has computed them)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.trees: dict[str, OrderedDict[int, None]] = {}

    def add(self, worker: str, hashes) -> None:
        tree = self.trees.setdefault(worker, OrderedDict())
        for h in hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.limit:
            tree.popitem(last=False)

    def match(self, worker: str, hashes) -> int:
        """Leading blocks of `hashes` routed to `worker` before."""
        tree = self.trees.get(worker)
        n = 0
        if tree:
            for h in hashes:
                if h not in tree:
                    break
                n += 1
        return n

    def size(self, worker: str) -> int:
        return len(self.trees.get(worker, ()))

    def forget(self, worker: str) -> None:
        self.trees.pop(worker, None)


class Affinity(Policy):
    name = "affinity"

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__(config)
        self.routed = RoutedBlocks(self.config.tree_blocks)

    def _keys(self, request, candidates):
        top = max(c.load for c in candidates)
        cfg = self.config
        matched = [c.matched_tokens for c in candidates]
        if cfg.new_threshold >= 0 and max(matched) <= cfg.new_threshold * request.num_tokens:
            # The index knows no worker holding it. If this router sent its prefix somewhere, the index has not
            # caught up yet (a worker publishes a prompt's blocks only once it cached them, a feed a poll later,
            # and an entry of a relay that stalls past its TTL expires): its own memory predicts the match.
            sent = [self.routed.match(c.worker, request.block_hashes) * request.block_size for c in candidates]
            if max(sent) <= cfg.new_threshold * request.num_tokens:
                # a new session: fewest distinct blocks sent, then the least loaded (keys compare
                # lexicographically through the size's integer part: the load term stays below 1)
                return [self.routed.size(c.worker) + (c.load / top if top else 0.0) * 0.5 for c in candidates]
            matched = [min(request.num_tokens, n) for n in sent]
        prefill = [max(0, request.num_tokens - m) + c.queued_tokens for c, m in zip(candidates, matched)]
        top_prefill = max(prefill)
        n = request.num_tokens
        return [
            -(
                cfg.match_weight * (min(1.0, m / n) if n else 0.0)
                - cfg.load_weight * (c.load / top if top else 0.0)
                - cfg.queued_prefill_weight * (pf / top_prefill if top_prefill else 0.0)
            )
            for c, m, pf in zip(candidates, matched, prefill)
        ]

    def observe(self, request, worker):
        self.routed.add(worker, request.block_hashes)

    def forget(self, worker: str) -> None:
        self.routed.forget(worker)


class KVCost(Policy):
    name = "kv_cost"

    def _keys(self, request, candidates):
        B = max(1, request.block_size)
        out = []
        for c in candidates:
            prefill = (max(0, request.num_tokens - c.matched_tokens) + c.queued_tokens) / B
            out.append(self.config.prefill_weight * prefill + c.running_tokens / B)
        return out


class CacheAware(Policy):
    """SGLang's cache_aware over the router's own record of what it sent where (block hashes, LRU-bounded)."""

    name = "cache_aware"

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__(config)
        self.routed = RoutedBlocks(self.config.tree_blocks)

    def approx_match(self, request: RequestView, worker: str) -> int:
        return min(request.num_tokens, self.routed.match(worker, request.block_hashes) * request.block_size)

    def rank(self, request, candidates):
        if not candidates:
            return []
        cfg = self.config
        loads = [c.in_flight for c in candidates]
        hi, lo = max(loads), min(loads)
        n = len(candidates)
        rot = lambda i: ((i - self._turn) % n, candidates[i].worker)  # noqa: E731
        if hi - lo > cfg.balance_abs and hi > cfg.balance_rel * lo:
            order = sorted(range(n), key=lambda i: (loads[i], *rot(i)))
        else:
            frac = [
                self.approx_match(request, c.worker) / request.num_tokens if request.num_tokens else 0.0
                for c in candidates
            ]
            if max(frac) > cfg.cache_threshold:
                order = sorted(range(n), key=lambda i: (-frac[i], loads[i], *rot(i)))
            else:
                size = [self.routed.size(c.worker) for c in candidates]
                order = sorted(range(n), key=lambda i: (size[i], loads[i], *rot(i)))
        self._turn += 1
        return [candidates[i].worker for i in order]

    def observe(self, request, worker):
        self.routed.add(worker, request.block_hashes)

    def forget(self, worker: str) -> None:
        self.routed.forget(worker)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Affinity, RoundRobin, LeastLoad, CacheAware, KVCost)}


def make_policy(name: str, config: PolicyConfig | None = None) -> Policy:
    try:
        return POLICIES[name](config)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}") from None
