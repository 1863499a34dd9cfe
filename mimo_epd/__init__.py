"""mimo-epd: Encoder / Prefill / Decode serving for hybrid-SWA / MoE multimodal models.

This package holds the CLI, content keys and (as they land) the hash ring, routers and benchmarks.
The encoder service lives in `encoder_server`, the LLM backend in `llm_backend`, the node-local
embedding store in `shm_cache`.
"""

__version__ = "0.1.0"
