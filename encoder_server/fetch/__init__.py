"""Stage 1: getting an item's bytes (`client.py`) under the URL policy (`url_policy.py`), URL fetches
scheduled fairly across hosts (`scheduler.py`)."""

from .client import Fetcher, FetchLimits, MediaSource, parse_data_uri
from .scheduler import FairFetchScheduler
from .url_policy import PolicyResolver, UrlPolicy, parse_networks, url_host

__all__ = [
    "FetchLimits",
    "Fetcher",
    "MediaSource",
    "parse_data_uri",
    "FairFetchScheduler",
    "PolicyResolver",
    "UrlPolicy",
    "parse_networks",
    "url_host",
]
