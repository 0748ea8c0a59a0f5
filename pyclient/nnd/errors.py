"""Exceptions the client raises, mapped from the daemon's gRPC statuses.

An error the daemon marks with the Python type the same code would have raised
in-process (a shape error is a RuntimeError) is raised as a class deriving from
both that builtin and `NndError`, so `except RuntimeError:` works as it would
with nnsight and `except nnd.NndError:` catches everything nnd raises.
"""

from __future__ import annotations

import builtins

import grpc

from nnd.v1 import contract


class NndError(Exception):
    """Base class of every error nnd raises."""

    code: grpc.StatusCode | None = None


class DaemonUnavailable(NndError):
    """The daemon (or the model's worker) cannot be reached."""


class ModelNotFound(NndError, KeyError):
    """No such model, or no such module path."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidRequest(NndError, ValueError):
    """The daemon refused a request as malformed."""


class WrongState(NndError):
    """The model is not in a state that allows the request."""


class LimitExceeded(NndError):
    """A daemon limit or the memory budget was exceeded."""


class Unauthenticated(NndError):
    """The daemon wants a token (NND_TOKEN / --token)."""


class Unsupported(NndError):
    """The daemon does not implement this capability."""


class Cancelled(NndError):
    """The request was cancelled."""


class DeadlineExceeded(NndError, TimeoutError):
    """The request ran past its deadline."""


class ExportError(NndError, RuntimeError):
    """`nnd.NNsight(module, example_inputs)`: torch.export cannot export the
    module (data-dependent control flow, unsupported Python...). Raised in the
    client, with torch's reason, before anything is sent to the daemon."""


class OutOfOrderError(InvalidRequest):
    """After a sync point (a real value read inside a block), a line used a
    module the paused forward had already run past (nnsight's OutOfOrderError).
    The message names both lines."""


_BY_CODE: dict[grpc.StatusCode, type[NndError]] = {
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: WrongState,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
    grpc.StatusCode.UNIMPLEMENTED: Unsupported,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}

_ALLOWED_BUILTINS = {"RuntimeError", "IndexError", "TypeError", "ValueError", "KeyError", "AttributeError"}
_mixed: dict[tuple[type, type], type] = {}


def _mix(base: type[NndError], builtin: type[BaseException]) -> type[NndError]:
    key = (base, builtin)
    if key not in _mixed:
        _mixed[key] = type(builtin.__name__, (base, builtin), {"__module__": "nnd.errors"})
    return _mixed[key]


def from_rpc_error(err: grpc.RpcError) -> NndError:
    """Translate a gRPC error into the matching nnd exception."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    base = _BY_CODE.get(code, NndError) if code is not None else NndError
    exc_type = contract.exc_type_of(err)
    if exc_type == "OutOfOrderError" and base is InvalidRequest:
        cls: type[NndError] = OutOfOrderError
    elif exc_type in _ALLOWED_BUILTINS and not issubclass(base, getattr(builtins, exc_type)):
        cls = _mix(base, getattr(builtins, exc_type))
    else:
        cls = base
    exc = cls(details)
    exc.code = code
    return exc
