"""The daemon's side of the data path for clients that do not follow routes:
read the few top-level fields it steers by (model, no_auto_dispatch,
keep_alive, a session's scan) straight from the wire bytes, skipping the
graph and inputs without decoding them; the worker parses and checks the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from nnd_daemon import errors

# Field numbers in nnd.proto: TraceRequest and SessionRequest.
_TRACE = {"model": 1, "no_auto_dispatch": 5, "keep_alive": 6}
_SESSION = {"model": 1, "no_auto_dispatch": 3, "keep_alive": 4, "scan": 5}


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
    kind = "SessionRequest" if session else "TraceRequest"
    view = memoryview(raw)
    pos, end = 0, len(raw)
    try:
        while pos < end:
            key, pos = _varint(view, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _varint(view, pos)
                if wanted.get(number) in ("no_auto_dispatch", "scan"):
                    setattr(out, wanted[number], value != 0)
            elif wire == 2:
                size, pos = _varint(view, pos)
                if pos + size > end:
                    raise ValueError("truncated field")
                if wanted.get(number) in ("model", "keep_alive"):
                    setattr(out, wanted[number], bytes(view[pos : pos + size]).decode("utf-8"))
                pos += size
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise ValueError(f"wire type {wire}")
            if number == 0 or pos > end:
                raise ValueError("truncated message")
    except (ValueError, IndexError) as exc:
        raise errors.InvalidArgument(f"the request is not a valid nnd.v1.{kind} message ({exc}); nothing ran") from None
    return out


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
