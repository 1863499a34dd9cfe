"""Locust load tests for the gRPC API: `locustfile.py` (users), `run.py` (`mimo-epd loadtest ...`)."""
