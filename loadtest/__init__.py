"""Locust users for the gRPC API and trace replay. Lands with the encoder throughput issue."""
