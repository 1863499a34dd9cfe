"""Prometheus metrics of one encoder (`--metrics-port`): per-stage latency histograms, busy time per
stage (for utilisation), queue depths, batch sizes, request rate and errors by status."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EncoderMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("encoder_requests", "Encode requests received", registry=r)
        self.items = Counter("encoder_items", "items received", registry=r)
        self.errors = Counter("encoder_errors", "failed requests by gRPC status", ["code"], registry=r)
        self.cache = Counter("encoder_cache_lookups", "embedding cache lookups", ["result"], registry=r)
        self.stage_seconds = Histogram(
            "encoder_stage_seconds", "time an item spent in a stage", ["stage"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "encoder_request_seconds", "Encode latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.busy = Counter(
            "encoder_stage_busy_seconds", "seconds a stage's workers spent working", ["stage"], registry=r
        )
        self.workers = Gauge("encoder_stage_workers", "parallel workers of a stage", ["stage"], registry=r)
        self.worker_seconds = Gauge(
            "encoder_stage_worker_seconds",
            "a stage's workers integrated over time (busy seconds / its change = utilisation, also while the "
            "worker count changes)",
            ["stage"],
            registry=r,
        )
        self.queue_depth = Gauge("encoder_queue_depth", "items waiting in a stage's input queue", ["queue"], registry=r)
        self.pending = Gauge("encoder_pending_items", "items admitted and not yet answered", registry=r)
        self.batch_items = Histogram(
            "encoder_batch_items", "items per vision forward", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.batch_patches = Histogram(
            "encoder_batch_patches",
            "vision patches per forward",
            buckets=(256, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
            registry=r,
        )
        self.forward_threads = Gauge(
            "encoder_forward_threads", "torch intra-op threads of each forward worker (0 = torch's default)", registry=r
        )
        self.batch_budget = Gauge("encoder_batch_budget_tokens", "the batcher's current token budget", registry=r)
        self.reply_bytes = Counter(
            "encoder_reply_bytes", "embedding bytes sent inside gRPC replies (transport grpc)", registry=r
        )
        self.decode_fallbacks = Counter("encoder_decode_pickled", "decoded images too large for a shm slot", registry=r)

    def watch_cluster(self, cache) -> None:
        """Exports the fleet cache's counters (`cache`: a cluster_cache.ClusterEmbeddingCache) as
        `encoder_cluster_cache_total{event}` (hits, misses, corrupt, errors, writes, write_drops, bytes_read,
        bytes_written, lease_waits_served: encodes saved by the lease, lease_waits_encoded) and
        `encoder_cluster_cache_connected` (1 while its store client is connected)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        class _Cluster:
            def collect(self):
                m = CounterMetricFamily("encoder_cluster_cache", "the fleet embedding cache's events", labels=["event"])
                for event, n in cache.counts.items():
                    m.add_metric([event], n)
                yield m
                yield GaugeMetricFamily(
                    "encoder_cluster_cache_connected",
                    "1 while the embedding store is connected",
                    value=float(cache.connected),
                )

        self.registry.register(_Cluster())

    def watch_transfer(self, sender) -> None:
        """Exports the embedding sender's counters (`sender`: transfer.EmbeddingSender) as
        `encoder_transfer_total{event}` (held, sent, released, expired, no_room, failed: items),
        `encoder_transfer_bytes_total{transport="mooncake"}`, `encoder_transfer_seconds_total{transport="mooncake"}`
        and `encoder_transfer_held_bytes`; the bytes sent in gRPC replies count under transport="grpc"."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        class _Transfer:
            def collect(self):
                m = CounterMetricFamily("encoder_transfer", "held embedding rows by event", labels=["event"])
                for event in ("held", "sent", "released", "expired", "no_room", "failed"):
                    m.add_metric([event], sender.counts[event])
                yield m
                b = CounterMetricFamily("encoder_transfer_bytes", "embedding bytes sent", labels=["transport"])
                b.add_metric(["mooncake"], sender.counts["bytes"])
                yield b
                t = CounterMetricFamily("encoder_transfer_seconds", "seconds spent sending", labels=["transport"])
                t.add_metric(["mooncake"], sender.counts["seconds"])
                yield t
                yield GaugeMetricFamily(
                    "encoder_transfer_held_bytes", "staging bytes held for a Transfer", value=sender.held_bytes
                )

        self.registry.register(_Transfer())

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:  # say which port: "Address already in use" alone does not
            raise OSError(f"cannot serve metrics on {host}:{port} (--metrics-port): {e.strerror}") from None
