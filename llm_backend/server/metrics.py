"""Prometheus metrics of one LLM worker, served on its HTTP port at `/metrics`.

Histograms: time to first token, inter-token latency, end-to-end latency (from the request's arrival
at the worker, media encoding included). Counters: prompt / cached / generated tokens, finished
requests by finish reason, requests refused for overload. Gauges read `engine.stats()` at scrape time:
running and waiting requests, used and total slots of both KV pools, prefix-cache hit tokens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _EngineGauges:
    """Reads the engine's own counters when scraped (no polling thread, never stale)."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        s = self.stats()
        gauges = [
            ("llm_requests_running", "requests running in the engine", "running"),
            ("llm_requests_waiting", "requests waiting for admission", "waiting"),
            ("llm_kv_full_used_slots", "used slots of the full-attention KV pool", "full_used"),
            ("llm_kv_full_total_slots", "slots of the full-attention KV pool", "full_total"),
            ("llm_kv_swa_used_slots", "used slots of the sliding-window KV pool", "swa_used"),
            ("llm_kv_swa_total_slots", "slots of the sliding-window KV pool", "swa_total"),
            (
                "llm_kv_full_request_slots",
                "full-pool slots held by requests (not the prefix cache)",
                "full_request_slots",
            ),
            ("llm_kv_swa_request_slots", "SWA-pool slots held by requests (not the prefix cache)", "swa_request_slots"),
            ("llm_tensor_parallel_size", "ranks of this worker's model-parallel replica", "tensor_parallel_size"),
            ("llm_tp_replica_up", "1 while every rank of the model-parallel replica serves", "tp_replica_up"),
            (
                "llm_data_parallel_size",
                "DP ranks sharing this worker's experts (data-parallel attention)",
                "data_parallel_size",
            ),
            ("llm_data_parallel_rank", "this worker's DP rank", "data_parallel_rank"),
            ("llm_dp_up", "1 while every DP rank of the group serves", "dp_up"),
        ]
        for name, doc, key in gauges:
            if key in s:
                yield GaugeMetricFamily(name, doc, value=float(s[key]))
        if "ep_tokens_per_rank" in s:
            c = CounterMetricFamily(
                "llm_ep_routed_tokens",
                "expert parallelism: token-expert pairs routed to each rank's experts",
                labels=["rank"],
            )
            for r, v in enumerate(s["ep_tokens_per_rank"]):
                c.add_metric([str(r)], float(v))
            yield c
        for name, doc, key in (
            ("llm_tp_collectives", "collectives rank 0 made (all-reduces, all-gathers)", "tp_collectives"),
            (
                "llm_tp_collective_seconds",
                "seconds rank 0 spent in collectives (waiting for peers included)",
                "tp_collective_s",
            ),
            ("llm_tp_collective_bytes", "bytes rank 0 contributed to collectives", "tp_collective_bytes"),
            ("llm_dp_rounds", "MoE rounds with this DP rank's tokens in them", "dp_rounds"),
            (
                "llm_dp_shadow_rounds",
                "MoE rounds this DP rank answered with no tokens (the others' forwards)",
                "dp_shadow_rounds",
            ),
            (
                "llm_dp_collective_seconds",
                "seconds this DP rank spent in the DP group's collectives",
                "dp_collective_s",
            ),
            ("llm_dp_steps", "engine steps run in lockstep with the other DP ranks", "dp_steps"),
        ):
            if key in s:
                yield CounterMetricFamily(name, doc, value=float(s[key]))
        if "prefix_hit_tokens" in s:
            yield CounterMetricFamily(
                "llm_prefix_cache_hit_tokens",
                "prompt tokens served from the prefix cache",
                value=float(s["prefix_hit_tokens"]),
            )
        if "preemptions" in s:
            yield CounterMetricFamily(
                "llm_preemptions", "requests preempted (KV freed, recomputed later)", value=float(s["preemptions"])
            )
        yield from _speculation(s)
        for key in sorted(k for k in s if k.startswith("pd_")):  # prefill/decode disaggregation (llm_backend.pd)
            yield GaugeMetricFamily(
                f"llm_{key}", f"prefill/decode disaggregation: {key[3:].replace('_', ' ')}", value=float(s[key])
            )


def _speculation(s: dict):
    """Speculative decoding (engine/speculative.py): verify steps, drafts, acceptance by draft position."""
    if "spec_verify_steps" not in s:
        return
    yield CounterMetricFamily(
        "llm_spec_verify_steps", "decode steps that verified drafts", value=float(s["spec_verify_steps"])
    )
    yield CounterMetricFamily(
        "llm_spec_draft_tokens", "draft tokens verified by the target", value=float(s["spec_drafted_tokens"])
    )
    yield CounterMetricFamily(
        "llm_spec_accepted_tokens", "draft tokens the target accepted", value=float(s["spec_accepted_tokens"])
    )
    yield GaugeMetricFamily(
        "llm_spec_mean_accept_length",
        "tokens per verify step (accepted drafts + the target's own token), since start",
        value=float(s["spec_mean_accept_length"]),
    )
    g = GaugeMetricFamily(
        "llm_spec_acceptance_rate", "accepted / drafted at each draft position, since start", labels=["position"]
    )
    for i, a in enumerate(s["spec_acceptance_by_position"]):
        g.add_metric([str(i + 1)], float(a))
    yield g


class LLMMetrics:
    def __init__(self, stats=None):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "llm_time_to_first_token_seconds", "arrival to first token", buckets=TOKEN_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "llm_inter_token_latency_seconds",
            "time between consecutive tokens of a request",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llm_e2e_request_latency_seconds", "arrival to the last token", buckets=E2E_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("llm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "llm_cached_tokens", "prompt tokens of finished requests found in the prefix cache", registry=r
        )
        self.generated_tokens = Counter("llm_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("llm_requests_finished", "finished requests by finish reason", ["reason"], registry=r)
        self.rejected = Counter(
            "llm_requests_rejected", "requests refused because too many were waiting (429)", registry=r
        )
        self.http_requests = Counter(
            "llm_http_requests",
            "HTTP API requests by endpoint (its route) and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.http_seconds = Histogram(
            "llm_http_request_seconds",
            "HTTP API requests: arrival to the answer's last byte (streams included), by endpoint",
            ["endpoint"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.media_bytes = Counter(
            "llm_media_bytes", "media embedding bytes received from encoders, by transport", ["transport"], registry=r
        )
        self.media_seconds = Counter(
            "llm_media_transfer_seconds",
            "seconds spent moving media rows over the transfer engine (the Transfer calls)",
            ["transport"],
            registry=r,
        )
        self.media_fallbacks = Counter(
            "llm_media_transfer_fallbacks",
            "replies whose rows came again as bytes after the transfer engine could not take them, by reason",
            ["reason"],
            registry=r,
        )
        self.media_skipped = Counter(
            "llm_media_encodes_skipped",
            "media items not sent to the encoder: their KV was in the prefix cache (--media-memo-items)",
            registry=r,
        )
        self.media_skip_misses = Counter(
            "llm_media_skip_misses",
            "requests sent without media rows whose cache entry was gone at admission, encoded after all",
            registry=r,
        )
        if stats is not None:
            self.watch(stats)

    def watch(self, stats) -> None:
        """Adds the gauges read from `stats()` (engine.stats()) at every scrape."""
        self.registry.register(_EngineGauges(stats))

    def on_finish(self, final) -> None:
        self.e2e.observe(final.e2e_s)
        self.prompt_tokens.inc(final.prompt_tokens)
        self.cached_tokens.inc(final.cached_tokens)
        self.generated_tokens.inc(final.completion_tokens)
        self.finished.labels(final.finish_reason).inc()

    def on_http(self, endpoint: str, status: int, seconds: float) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()
        self.http_seconds.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
