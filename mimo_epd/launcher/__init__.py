"""`mimo-epd serve`: one node's encoders, LLM workers and routers.

- `node.py`: the node in three steps (start, front, shutdown) and `serve --join`;
- `config.py`: `NodeConfig`, the node's flags, and the LLM workers' flags passed through as `--llm-*`;
- `children.py`: one child server process (`ChildProcess`) and the one `Supervisor` that restarts them;
- `segments.py`: the node's shared-memory cache segment name and the removal of stale ones.
"""

from .children import MALLOC_ARENAS, ChildProcess, Supervisor, worker_env
from .config import NodeConfig
from .node import Node, serve_node
from .segments import SEGMENT_PREFIX, remove_stale_segments, segment_name

__all__ = [
    "MALLOC_ARENAS",
    "ChildProcess",
    "Supervisor",
    "worker_env",
    "NodeConfig",
    "Node",
    "serve_node",
    "SEGMENT_PREFIX",
    "remove_stale_segments",
    "segment_name",
]
