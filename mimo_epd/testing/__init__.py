"""Fixtures the CLI exposes (`make-test-video`, load tests, benchmarks): a local media server with photo-like
JPEGs and a realistic test-video generator, a redis-server, and server subprocesses (`servers.py`). Nothing in the
servers imports this."""
