"""Errors that map to a gRPC status and name the item they concern."""
from __future__ import annotations

import grpc


class ItemError(Exception):
    """A failure of one media item. `str()` is the message clients see: "item 3: <reason>"."""

    def __init__(self, code: grpc.StatusCode, reason: str, index: int | None = None):
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.index = index

    def at(self, index: int) -> "ItemError":
        self.index = index
        return self

    def __str__(self) -> str:
        return f"item {self.index}: {self.reason}" if self.index is not None else self.reason


class DecodeError(Exception):
    """Raised in decode worker processes (plain, picklable); `kind` picks the status."""

    def __init__(self, reason: str, kind: str = "invalid"):
        super().__init__(reason, kind)
        self.reason = reason
        self.kind = kind  # "invalid" | "too_large"

    def __str__(self) -> str:
        return self.reason


def invalid(reason: str) -> ItemError:
    return ItemError(grpc.StatusCode.INVALID_ARGUMENT, reason)


def denied(reason: str) -> ItemError:
    return ItemError(grpc.StatusCode.PERMISSION_DENIED, reason)
