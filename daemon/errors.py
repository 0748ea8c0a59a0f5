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
        context.set_trailing_metadata(((EXC_TYPE_KEY, err.exc_type),))
    context.abort(err.code, err.message)
