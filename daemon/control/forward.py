"""The daemon's side of the data path for clients that do not follow routes:
read the few top-level fields it steers by (model, no_auto_dispatch,
keep_alive, a session's scan, the stored edits named) straight from the wire
bytes, skipping the graph and inputs without decoding them; the worker (or, for
scans, the helper) parses and checks the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from nnd_daemon import errors

# Field numbers in nnd.proto: TraceRequest and SessionRequest.
_TRACE = {"model": 1, "no_auto_dispatch": 5, "keep_alive": 6}
_SESSION = {"model": 1, "no_auto_dispatch": 3, "keep_alive": 4, "scan": 5}
_TRACE_EDITS = 7  # TraceRequest.edits
_SESSION_TRACES = 2  # SessionRequest.traces
_SESSION_TRACE_REQUEST = 1  # SessionTrace.request


@dataclass
class Steering:
    model: str = ""
    no_auto_dispatch: bool = False
    keep_alive: str = ""
    scan: bool = False


def peek(raw: bytes, session: bool) -> Steering:
    """The steering fields of a TraceRequest (or SessionRequest) in `raw`; INVALID_ARGUMENT
    if the top level is not valid protobuf wire format (nested messages are the worker's to check)."""
    numbers = _SESSION if session else _TRACE
    wanted = {n: name for name, n in numbers.items()}
    out = Steering()
    for number, value in _fields(raw, "SessionRequest" if session else "TraceRequest"):
        name = wanted.get(number)
        if name in ("no_auto_dispatch", "scan") and isinstance(value, int):
            setattr(out, name, value != 0)
        elif name in ("model", "keep_alive") and isinstance(value, memoryview):
            setattr(out, name, bytes(value).decode("utf-8", errors="replace"))
    return out


def edit_ids(raw: bytes, session: bool) -> list[str]:
    """The stored edits a TraceRequest (TraceRequest.edits) or every trace of a SessionRequest
    names, read from the wire without decoding graphs or inputs."""
    if not session:
        return _edit_ids(memoryview(raw))
    ids: list[str] = []
    for number, trace in _fields(raw, "SessionRequest"):
        if number == _SESSION_TRACES and isinstance(trace, memoryview):
            for n, request in _fields(trace, "SessionRequest"):
                if n == _SESSION_TRACE_REQUEST and isinstance(request, memoryview):
                    ids += _edit_ids(request)
    return ids


def _edit_ids(view: memoryview) -> list[str]:
    return [
        bytes(v).decode("utf-8", errors="replace")
        for n, v in _fields(view, "TraceRequest")
        if n == _TRACE_EDITS and isinstance(v, memoryview)
    ]


def _fields(raw: bytes | memoryview, kind: str) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each top-level field: varints as int, length-delimited
    fields as a view of their bytes (not decoded), fixed-size ones as int 0."""
    view = memoryview(raw)
    pos, end = 0, len(view)
    try:
        while pos < end:
            key, pos = _varint(view, pos)
            number, wire = key >> 3, key & 7
            value: int | memoryview = 0
            if wire == 0:
                value, pos = _varint(view, pos)
            elif wire == 2:
                size, pos = _varint(view, pos)
                if pos + size > end:
                    raise ValueError("truncated field")
                value = view[pos : pos + size]
                pos += size
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise ValueError(f"wire type {wire}")
            if number == 0 or pos > end:
                raise ValueError("truncated message")
            yield number, value
    except (ValueError, IndexError) as exc:
        raise errors.InvalidArgument(f"the request is not a valid nnd.v1.{kind} message ({exc}); nothing ran") from None


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
