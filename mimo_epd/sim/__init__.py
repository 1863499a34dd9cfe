"""The fleet simulator: N simulated workers (llm_backend.sim) behind the real routing policies and page-hash
index (mimo_epd.router), fed by each worker's real KV events. It lives here because llm_backend must not
import mimo_epd.router. See docs/simulator.md."""

from .fleet import Fleet, run_fleet
from .traces import mooncake_requests

__all__ = ["Fleet", "run_fleet", "mooncake_requests"]
