"""The one /metrics server (mimo_epd/common/metrics_http.py): serves the body, names the address, the flag and the
reason when it cannot serve, refuses a second start, and closes cleanly."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from mimo_epd.common.metrics_http import MetricsServer


def test_serves_and_names_what_it_cannot_bind():
    async def body():
        return b"demo_total 1.0\n"

    async def main():
        a = MetricsServer(body, "the router's metrics")
        port = await a.start("127.0.0.1", 0)
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
        assert text == b"demo_total 1.0\n"
        with pytest.raises(RuntimeError, match="already serving"):
            await a.start("127.0.0.1", 0)
        b = MetricsServer(body, "the node's metrics", "--metrics-port")
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port} \(--metrics-port\): Address already in use"):
            await b.start("127.0.0.1", port)
        with pytest.raises(OSError, match="no-such-host.invalid:0 .*: (Name or service not known|.+)"):
            await b.start("no-such-host.invalid", 0)
        await b.close()  # closing what never started is a no-op
        await a.close()
        await a.close()

    asyncio.run(main())
