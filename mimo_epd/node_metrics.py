"""One Prometheus view of a whole node: `serve --metrics-port PORT`, and the node's HTTP API's /metrics.

Each process keeps its own registry (they are separate processes) and serves it on its own port: encoder i on
PORT + 1 + i (with --metrics-port; a free port otherwise), each LLM worker on its HTTP port, the LLM router on a
loopback port. Every scrape of either endpoint fetches them all concurrently and merges them family by family,
each sample labelled with its process (`encoder-<i>`, `llm-<i>`, `router`).
`mimo_epd_scrape_up{process}` says which processes answered (an encoder being restarted is 0, not an
error). Why not prometheus_client's multiprocess mode: it needs a shared directory and per-process
files, and the encoders' gauges (queue depth, workers) would need a merge policy each; one label per
process keeps every series exactly as the process reported it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from mimo_epd.common.metrics_http import MetricsServer

log = logging.getLogger(__name__)


def merge(texts: dict[str, str | None]) -> bytes:
    """Prometheus text of several processes ({process: text, or None when it did not answer}) -> one
    exposition with a `process` label on every sample."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import GaugeMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    up = GaugeMetricFamily("mimo_epd_scrape_up", "1 when the process answered this scrape", labels=["process"])
    for process, text in texts.items():
        up.add_metric([process], 0.0 if text is None else 1.0)
        for fam in text_string_to_metric_families(text or ""):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples += [
                Sample(s.name, {"process": process, **s.labels}, s.value, s.timestamp, s.exemplar) for s in fam.samples
            ]

    class _Merged:
        def collect(self):
            return [up, *families.values()]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


class NodeMetrics:
    """The merged metrics of the processes `targets()` -> {process: "host:port" of its /metrics}: `body()` for any
    endpoint that serves them (the node's HTTP API), `start(host, port)` to serve them on their own port."""

    def __init__(self, targets: Callable[[], dict[str, str]], timeout_s: float = 2.0):
        self.targets, self.timeout_s = targets, timeout_s
        self._server = MetricsServer(self.body, "the node's metrics", "--metrics-port")
        self._session = None

    async def _scrape(self, address: str) -> str | None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        from mimo_epd.common.auth import upstream_authorization

        key = upstream_authorization(None)  # the node's internal key: workers with --api-key want it on /metrics
        try:
            async with self._session.get(
                f"http://{address}/metrics", headers={"Authorization": key} if key else {}
            ) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def body(self) -> bytes:
        targets = self.targets()
        texts = await asyncio.gather(*(self._scrape(a) for a in targets.values()))
        return merge(dict(zip(targets, texts)))

    async def start(self, host: str, port: int) -> int:
        """Starts serving; returns the port. A port in use raises OSError naming it."""
        try:
            return await self._server.start(host, port)
        except BaseException:
            await self.close()  # the scrape session too
            raise

    async def close(self) -> None:
        await self._server.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
