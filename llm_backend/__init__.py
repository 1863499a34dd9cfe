"""LLM backend for the hybrid-SWA / MoE model (MiMo-V2-Flash).

- `models/`: the model (parity with transformers) and its loader;
- `kv/`: slot pools, the SWA-aware radix prefix cache, a running request's KV;
- `engine/`: scheduler, model runner, and the offline engine `LLM(...).generate(prompts, SamplingParams(...))`;
- `config.py`: every worker flag (`LLMConfig`); `tokenizer.py`: tokenizers.
"""
from .engine import LLM, PromptTooLong, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "PromptTooLong"]
