"""Node-local shared-memory embedding store shared by every encoder process of a node.

A library with no torch dependency (numpy, the standard library and xxhash only); see `store.py` for the
layout, the locking, integrity checks and what happens when a process is killed mid-operation, and
`index.py` for the key index.
"""

from .store import Entry, ShmCache, ShmCacheError, metadata_bytes, pid_alive

__all__ = ["ShmCache", "Entry", "ShmCacheError", "metadata_bytes", "pid_alive"]
