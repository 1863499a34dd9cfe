"""The LLM router's Prometheus metrics (its own registry, one per router).

- `router_requests_total{worker,front}`: requests sent to each worker (retries count on the worker they went to;
  front = grpc | http);
- `router_retries_total`, `router_failed_total`: requests moved to the next worker, requests that failed;
- `router_prediction_error_tokens`: reported cached tokens minus the index's prediction, per request (negative:
  the worker reused less than predicted; no `_sum`, as for any histogram with negative buckets), and its two
  signs summed apart: `router_prediction_over_tokens_total` (reused beyond the prediction),
  `router_prediction_under_tokens_total` (predicted but not reused);
  `router_predicted_tokens_total` / `router_cached_tokens_total`;
- `router_state_degraded`: 1 while the state (Redis) is unreachable and routing is by load only;
- `router_index_blocks{worker}`: blocks the index holds for each worker; `router_live_workers`;
- `router_index_sync_waits_total`, `router_index_sync_seconds_total`, `router_index_sync_timeouts_total`: picks
  that waited for the index to reach a worker's last answer (router/sync.py), the time spent, and the waits that
  ran out (`--index-sync-ms`); `router_feed_resyncs_total`: full snapshots a feed asked for because the state
  had dropped its worker's entries.

`mimo-epd router --metrics-port P` serves them on P; `serve --metrics-port P` merges them into the node's one
endpoint (label `process="router"`, mimo_epd/node_metrics.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mimo_epd.common.metrics_http import MetricsServer

# Signed token errors: exact predictions land in the 0 bucket; one block (16 tokens) off either way is common.
ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096, float("inf"))


class RouterMetrics:
    def __init__(self, router):
        self.router = router
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter("router_requests", "requests sent to each LLM worker", ["worker", "front"], registry=r)
        self.retries = Counter("router_retries", "requests moved to the next worker after a failure", registry=r)
        self.pd_paths = Counter(
            "router_pd_prefills",
            "decode workers' requests by where they were prefilled: remote (a prefill worker) or local (conditional "
            "disaggregation: no prefill worker, or every prefill queue over --pd-max-prefill-queue)",
            ["path"],
            registry=r,
        )
        self.failed = Counter("router_failed", "requests that no worker could serve", registry=r)
        self.error = Histogram(
            "router_prediction_error_tokens",
            "reported cached tokens minus the predicted reusable tokens, per request",
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        # the histogram has negative buckets, so prometheus_client exports no _sum for it: the two signs apart
        self.over = Counter("router_prediction_over_tokens", "cached tokens reported beyond the prediction", registry=r)
        self.under = Counter("router_prediction_under_tokens", "predicted tokens the worker did not reuse", registry=r)
        self.predicted = Counter("router_predicted_tokens", "predicted reusable prompt tokens", registry=r)
        self.cached = Counter("router_cached_tokens", "cached prompt tokens the workers reported", registry=r)
        self.degraded = Gauge(
            "router_state_degraded", "1 while the router state is unreachable (routing by load only)", registry=r
        )
        self.degraded.set_function(lambda: float(bool(router.degraded)))
        self.live = Gauge("router_live_workers", "LLM workers this router routes to now", registry=r)
        self.live.set_function(lambda: float(len(router.live())))
        self.bad_records = Gauge(
            "router_bad_records",
            "records read from the router state that failed its checks, skipped",
            ["what"],
            registry=r,
        )
        for what in ("member", "kv"):
            self.bad_records.labels(what).set_function(lambda what=what: float(router.state.bad.counts[what]))
        self.discovery_errors = Gauge(
            "router_discovery_errors", "registry reads that failed unexpectedly (the loop goes on)", registry=r
        )
        self.discovery_errors.set_function(lambda: float(router.discovery_errors))
        self.discovery_alive = Gauge("router_discovery_alive", "1 while the discovery loop runs", registry=r)
        self.discovery_alive.set_function(lambda: float(router.discovery_alive()))
        if router.encoders is not None:  # the Encode API's ring (bounded loads: router/encoder.py)
            ring = router.encoders.router
            self.diversions = Gauge(
                "router_encoder_diversions",
                "media items sent past their ring owner because it held more than --encoder-load-factor times the "
                "mean of this router's items in flight",
                registry=r,
            )
            self.diversions.set_function(lambda: float(ring.diversions))
        self.index_blocks: dict[str, int] = {}  # refreshed by the router's discovery loop
        r.register(_IndexCollector(self))
        self._server = MetricsServer(self._body, "the router's metrics")

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def _body(self) -> bytes:
        return self.render()

    async def start(self, host: str, port: int) -> int:
        """Serves /metrics on host:port (0 = a free port); returns the port."""
        return await self._server.start(host, port)

    async def close(self) -> None:
        await self._server.close()


class _IndexCollector:
    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def collect(self):
        g = GaugeMetricFamily(
            "router_index_blocks", "blocks the page-hash index holds for each LLM worker", labels=["worker"]
        )
        for w, n in sorted(self.metrics.index_blocks.items()):
            g.add_metric([w], float(n))
        yield g
        router = self.metrics.router
        st = router.sync.stats
        yield CounterMetricFamily("router_index_sync_waits", "picks that waited for the index", value=st["waits"])
        yield CounterMetricFamily(
            "router_index_sync_seconds", "seconds picks waited for the index", value=st["wait_seconds"]
        )
        yield CounterMetricFamily(
            "router_index_sync_timeouts", "index waits that ran out (--index-sync-ms)", value=st["timeouts"]
        )
        yield CounterMetricFamily(
            "router_prefill_fallbacks",
            "requests a prefill worker generated itself because no worker that decodes was live",
            value=router.stats["prefill_fallbacks"],
        )
        yield CounterMetricFamily(
            "router_worker_waits",
            "requests that found no live LLM worker and waited for one (--worker-wait-s)",
            value=router.stats["worker_waits"],
        )
        yield CounterMetricFamily(
            "router_feed_resyncs",
            "full snapshots feeds asked for because the state had dropped their worker's entries",
            value=sum(f.resyncs for f in router.feeds.values()),
        )
