"""Kept importable: the worker's gRPC service moved to `llm_backend.server` (see its package doc)."""

from .server.core import placeholder_ids  # noqa: F401
from .server.grpc_service import SERVICE_NAME, GeneratorService  # noqa: F401
from .server.worker import serve_llm  # noqa: F401
