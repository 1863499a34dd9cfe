"""Errors that map to a gRPC status and name the item they concern."""

from __future__ import annotations

import errno

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


# errno values that say the client's input was wrong (a path, a name), not that the server is in trouble.
_ERRNO_STATUS = {
    errno.ENOENT: grpc.StatusCode.NOT_FOUND,
    errno.ENOTDIR: grpc.StatusCode.NOT_FOUND,
    errno.EACCES: grpc.StatusCode.PERMISSION_DENIED,
    errno.EPERM: grpc.StatusCode.PERMISSION_DENIED,
    errno.ENAMETOOLONG: grpc.StatusCode.INVALID_ARGUMENT,
    errno.ELOOP: grpc.StatusCode.INVALID_ARGUMENT,
    errno.EISDIR: grpc.StatusCode.INVALID_ARGUMENT,
    errno.EINVAL: grpc.StatusCode.INVALID_ARGUMENT,
    errno.EILSEQ: grpc.StatusCode.INVALID_ARGUMENT,
}


def from_client_input(exc: BaseException) -> ItemError | None:
    """The status for an OSError / ValueError a stage raised while handling an item, or None.

    Client input reaches the standard library (paths, names, bytes), which reports bad input as
    ValueError (a NUL byte, bad encoding) or OSError (a name too long, no such file): those are the
    client's errors, never INTERNAL. An OSError with another errno (EIO, EMFILE, ENOSPC) is the
    server's trouble: UNAVAILABLE, retry."""
    if isinstance(exc, OSError):
        code = _ERRNO_STATUS.get(exc.errno or 0, grpc.StatusCode.UNAVAILABLE)
        reason = exc.strerror or str(exc)
        return ItemError(code, f"{reason}" + (f": {exc.filename}" if exc.filename else ""))
    if isinstance(exc, ValueError):  # UnicodeError included
        return ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid item: {exc}")
    return None
