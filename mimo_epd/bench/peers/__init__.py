"""Peer baselines for the benchmarks: what a user gets from public tools on the same weights and inputs.

One module per peer: `hf_encoder` (the Qwen2.5-VL model-card image path served per request or with a
dynamic batcher), `hf_engine` (transformers continuous batching and static batching), `qwen_vl_video`
(qwen-vl-utils `fetch_video` with each reader backend). `proc` measures processes (CPU seconds, RSS).
"""
