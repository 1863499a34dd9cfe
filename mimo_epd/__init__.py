"""mimo-epd: Encoder / Prefill / Decode serving for hybrid-SWA / MoE multimodal models.

This package holds the CLI, the node launcher, the routers (encoder hash ring, LLM router and policies), the
shared base (`common`), the fleet simulator, the benchmarks and the data files shipped with the product. The
encoder service lives in `encoder_server`, the LLM backend in `llm_backend`, the node-local embedding store in
`shm_cache`.
"""

__version__ = "0.1.0"
