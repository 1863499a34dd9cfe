"""Node-local shared-memory embedding store shared by every encoder process of a node.

A library with no torch dependency (numpy and the standard library only); see `store.py` for the
layout, the locking and what happens when a process is killed mid-operation.
"""
from .store import Entry, ShmCache, ShmCacheError, pid_alive

__all__ = ["ShmCache", "Entry", "ShmCacheError", "pid_alive"]
