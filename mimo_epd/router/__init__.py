"""Routers: the encoder hash ring and router (`encoder.py`); the LLM routing policies, the page-hash index and
their shared state live beside them as they land."""

from .encoder import EncoderRouter, RouterConfig, routing_key
from .hash_ring import HashRing

__all__ = ["EncoderRouter", "RouterConfig", "routing_key", "HashRing"]
