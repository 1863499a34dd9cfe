"""LLM backend for the hybrid-SWA / MoE model (MiMo-V2-Flash): model, dual KV pools, SWA-aware radix
prefix cache, scheduler, Triton kernels and the Generate service. Lands with the LLM backend issue;
nothing here is importable API yet."""
