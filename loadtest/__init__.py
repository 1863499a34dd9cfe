"""Locust load tests of the gRPC and HTTP APIs: `locustfile.py` (users), `run.py` (`mimo-epd loadtest ...`)."""
