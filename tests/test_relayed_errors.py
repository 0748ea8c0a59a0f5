"""A status another nnd process answered with (a worker, the helper, a tensor-parallel rank 0) is
passed on by one function, errors.relayed: same code, message and exception type, and never counted
as the daemon's own refusal."""

from __future__ import annotations

import grpc

from nnd.v1 import contract
from nnd_daemon import errors
from nnd_daemon.control.events import Events


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailers=()):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def test_a_failed_call_is_relayed_with_its_code_message_and_exception_type():
    err = errors.from_rpc(
        _Failed(grpc.StatusCode.INVALID_ARGUMENT, "shape mismatch", ((contract.EXC_TYPE_KEY, "RuntimeError"),))
    )
    assert (err.code, err.message, err.exc_type) == (grpc.StatusCode.INVALID_ARGUMENT, "shape mismatch", "RuntimeError")
    assert errors.from_rpc(_Failed(grpc.StatusCode.NOT_FOUND, "")).message == str(grpc.StatusCode.NOT_FOUND)


def test_a_status_number_from_another_rank_is_the_same_code():
    for code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN):
        assert errors.relayed(code.value[0], "m").code == code


def test_a_relayed_refusal_is_not_counted_as_the_daemons_own():
    events = Events()
    events.on_error("Trace", errors.from_rpc(_Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_invokes=4")))
    events.on_error("Trace", errors.ResourceExhausted("over max_queue_depth=64"))
    assert events.refusals == {("max_queue_depth",): 1}
