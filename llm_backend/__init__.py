"""LLM backend for the hybrid-SWA / MoE model (MiMo-V2-Flash).

- `models/`: the model (parity with transformers) and its loader;
- `kv/`: slot pools, the SWA-aware radix prefix cache, a running request's KV;
- `engine.py`: the offline engine, `LLM(...).generate(prompts, SamplingParams(...))`.
"""
from .engine import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
