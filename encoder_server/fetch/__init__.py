"""Stage 1: getting an item's bytes (`client.py`) under the URL policy (`url_policy.py`)."""
from .client import FetchLimits, Fetcher, MediaSource, parse_data_uri
from .url_policy import PolicyResolver, UrlPolicy, parse_networks

__all__ = ["FetchLimits", "Fetcher", "MediaSource", "parse_data_uri", "PolicyResolver", "UrlPolicy", "parse_networks"]
