"""gRPC channel options for the routers' channels to workers and encoders.

gRPC's default reconnect backoff (1 s initial, x1.6, up to 120 s, with jitter) means a channel to a worker that
was restarted keeps failing fast for 7-18 s after the worker serves again (found by the chaos runs). A router's
peers are on the same network and restart in seconds, so the routers reconnect quickly instead: 100 ms first,
at most 1 s between attempts (`--reconnect-*` are not flags: these peers are always near).
"""

from __future__ import annotations

INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1000


def channel_options(max_message_mb: int = 256) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_mb << 20),
        ("grpc.max_send_message_length", max_message_mb << 20),
        ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.min_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]
