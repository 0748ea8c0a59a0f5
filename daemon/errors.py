"""Errors every part of the daemon raises, each tied to one gRPC status code.

The servicer maps them to statuses in one place (control/servicer.py); the
worker does the same on its side. `exc_type` names the Python exception a user
would have seen had the code run in-process (RuntimeError for a shape error),
so the client can raise that same type.
"""

from __future__ import annotations

import grpc

# Trailing-metadata key carrying `exc_type` to the client.
EXC_TYPE_KEY = "nnd-exception-type"
# Initial-metadata key a worker sends once a request has the model (it runs, no longer waits).
STARTED_KEY = "nnd-started"
# Longest status message sent, in bytes as gRPC percent-encodes them. gRPC
# clients refuse metadata over 8 KiB (a status message is metadata) and report
# RESOURCE_EXHAUSTED instead of the real status, so an error quoting a huge
# client string (a module path, a model name) must be cut.
MAX_MESSAGE_BYTES = 4096


class NndError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, exc_type: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.exc_type = exc_type


class InvalidArgument(NndError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(NndError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(NndError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(NndError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(NndError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(NndError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Cancelled(NndError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(NndError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(NndError):
    code = grpc.StatusCode.PERMISSION_DENIED


def abort(context: grpc.ServicerContext, err: NndError) -> None:
    """End an RPC with `err`'s status, message and exception type."""
    if err.exc_type:
        context.set_trailing_metadata(((EXC_TYPE_KEY, err.exc_type[:100]),))
    context.abort(err.code, fit(err.message))


def _encoded_size(text: str) -> int:
    # grpc-message is percent-encoded: printable ASCII but '%' stays one byte, the rest three per byte.
    return sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in text.encode("utf-8"))


def fit(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message`, with its middle cut out if it would exceed `limit` bytes on the wire."""
    if _encoded_size(message) <= limit:
        return message
    budget = (limit - 64) // 2
    head = _take(message, budget)
    tail = _take(message[::-1], budget)[::-1]
    return f"{head} [... {len(message) - len(head) - len(tail)} characters cut ...] {tail}"


def _take(text: str, budget: int) -> str:
    """The longest prefix of `text` whose encoded size fits `budget`."""
    used = 0
    for i, ch in enumerate(text):
        used += _encoded_size(ch)
        if used > budget:
            return text[:i]
    return text
