"""LLM backend for the hybrid-SWA / MoE model (MiMo-V2-Flash).

- `models/`: the model (parity with transformers) and its loader;
- `kv/`: slot pools, the SWA-aware radix prefix cache, a running request's KV;
- `engine/`: scheduler, model runner, and the offline engine `LLM(...).generate(prompts, SamplingParams(...))`;
  `engine/interfaces.py` holds the seams every feature below plugs into;
- `kernels/`: Triton kernels (attention, MoE, block FP8) with their torch twins; `paged_attention.py`: the pools;
- `agentic/`: tools, reasoning, structured output (the engine's `Constraint`);
- `pd/`: the prefill and decode roles (engine-side); `server/`: gRPC, HTTP, the P/D control channel, the worker;
- `sim/`: the engine on a virtual clock;
- `config.py`: every worker flag (`LLMConfig`); `tokenizer.py`: tokenizers.

`from llm_backend import LLM, SamplingParams` imports the engine (and torch) on first use only: the routers and
the CLI's --help import torch-free parts of this package (kv.events' block hashes, the tokenizer, LLMConfig).
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "PromptTooLong"]


def __getattr__(name):
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'llm_backend' has no attribute {name!r}")
