"""Checks of a trace request against the daemon's limits, before any work."""

from __future__ import annotations

from typing import Any

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.control.settings import Limits


def check(request: nnd_pb2.TraceRequest, limits: Limits, *, generate: bool) -> None:
    if not request.model:
        raise errors.InvalidArgument("the request names no model")
    if not request.invokes:
        raise errors.InvalidArgument("the request has no input: give a prompt, token ids or tensors")
    if limits.max_invokes and len(request.invokes) > limits.max_invokes:
        raise errors.ResourceExhausted(
            f"{len(request.invokes)} invokes exceed the daemon's limit max_invokes={limits.max_invokes}"
        )
    if limits.max_request_bytes:
        size = request.ByteSize()
        if size > limits.max_request_bytes:
            raise errors.ResourceExhausted(
                f"the request is {size} bytes, over the daemon's limit max_request_bytes={limits.max_request_bytes}"
            )
    if generate:
        n = request.generate.max_new_tokens
        if n < 0:
            raise errors.InvalidArgument(f"max_new_tokens must be positive, not {n}")
        if limits.max_new_tokens and n > limits.max_new_tokens:
            raise errors.ResourceExhausted(
                f"max_new_tokens={n} exceeds the daemon's limit max_new_tokens={limits.max_new_tokens}; "
                "ask for fewer tokens or raise the limit (nnd serve --max-new-tokens)"
            )


def engine_limits(limits: Limits) -> Any:
    from nnd_daemon.engine import EngineLimits

    return EngineLimits(
        max_saved_bytes=limits.max_saved_bytes,
        max_invokes=limits.max_invokes,
        max_sequence_length=limits.max_sequence_length,
        max_new_tokens=limits.max_new_tokens,
        max_constant_bytes=limits.max_constant_bytes,
    )
