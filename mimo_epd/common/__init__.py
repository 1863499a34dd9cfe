"""The shared base every server may import: content keys, gRPC server setup, flag helpers, layers.

Nothing here imports the servers (`encoder_server`, `llm_backend`) or the CLI, launcher, router or benchmarks."""
