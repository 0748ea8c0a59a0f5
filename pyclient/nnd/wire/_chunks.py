"""Data-method stubs whose responses skip protobuf for result chunks.

A big result streams as `TraceResponse{chunk}` messages of a few MiB, or comes
inside one `TraceResponse{results}` (TraceOnce). Parsing either with protobuf
copies its data twice more (into the message, then out as `bytes`), each time
into fresh memory; here the chunk's data is a view of the bytes received, which
the client copies once, into the result's buffer (_results.py). Every other
response is parsed by protobuf as before, and so is any chunk laid out otherwise
than the two fields in order (another server's).
"""

from __future__ import annotations

from typing import Any

import grpc

from nnd.v1 import contract, nnd_pb2


def _number(descriptor: Any, name: str) -> int:
    return int(descriptor.fields_by_name[name].number)


_CHUNK = _number(nnd_pb2.TraceResponse.DESCRIPTOR, "chunk")
_RESULTS = _number(nnd_pb2.TraceResponse.DESCRIPTOR, "results")
_RESULTS_CHUNK = _number(nnd_pb2.TraceResults.DESCRIPTOR, "chunk")
_BLOB = _number(nnd_pb2.Chunk.DESCRIPTOR, "blob")
_DATA = _number(nnd_pb2.Chunk.DESCRIPTOR, "data")
_VARINT, _LEN = 0, 2
# A whole answer this big is read field by field (`_whole`); a smaller one protobuf parses faster.
_BIG = 1 << 16


class Chunk:
    """A `TraceResponse{chunk}` read without protobuf; answers what readers of responses ask
    (`WhichOneof("kind")`, `chunk.blob`, `chunk.data`)."""

    __slots__ = ("blob", "data")

    def __init__(self, blob: int, data: memoryview) -> None:
        self.blob = blob
        self.data = data  # a view of the received message

    @property
    def chunk(self) -> Chunk:
        return self

    def WhichOneof(self, group: str) -> str | None:  # noqa: N802 - the protobuf message's method
        return "chunk" if group == "kind" else None


def _varint(buf: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _chunk(raw: bytes) -> Chunk | None:
    """The chunk in `raw` when it is exactly `chunk {blob; data}` (or `chunk {data}`), else None."""
    buf = memoryview(raw)
    tag, at = _varint(buf, 0)
    if tag != (_CHUNK << 3 | _LEN):
        return None
    size, at = _varint(buf, at)
    if at + size != len(buf):
        return None
    return _fields(buf[at:])


def _fields(buf: memoryview) -> Chunk | None:
    """A Chunk message's bytes when they are exactly `blob; data` (or `data`), else None."""
    blob = 0
    tag, at = _varint(buf, 0)
    if tag == (_BLOB << 3 | _VARINT):
        blob, at = _varint(buf, at)
        tag, at = _varint(buf, at)
    if tag != (_DATA << 3 | _LEN):
        return None
    size, at = _varint(buf, at)
    if at + size != len(buf):
        return None
    return Chunk(blob, buf[at:])


class Results:
    """A `TraceResults` whose chunks are views of the received message (`chunk`); its other fields are
    the parsed message's."""

    __slots__ = ("_message", "chunk")

    def __init__(self, message: nnd_pb2.TraceResults, chunks: list[Chunk]) -> None:
        self._message = message
        self.chunk = chunks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._message, name)


class Whole:
    """A `TraceResponse{results}` (the whole answer as one message, TraceOnce's) read by `_whole`."""

    __slots__ = ("results",)

    def __init__(self, results: Results) -> None:
        self.results = results

    def WhichOneof(self, group: str) -> str | None:  # noqa: N802 - the protobuf message's method
        return "results" if group == "kind" else None


def _whole(raw: bytes) -> Whole | None:
    """`raw` when it is a `TraceResponse{results}`: its chunks' data as views of `raw` (protobuf would
    copy each into fresh memory: a 256 MiB result twice more before the client's own copy), every other
    field parsed by protobuf. None for any other message."""
    buf = memoryview(raw)
    tag, at = _varint(buf, 0)
    if tag != (_RESULTS << 3 | _LEN):
        return None
    size, at = _varint(buf, at)
    end = len(buf)
    if at + size != end:
        return None
    rest: list[memoryview] = []
    chunks: list[Chunk] = []
    while at < end:
        start = at
        tag, at = _varint(buf, at)
        kind = tag & 7
        if kind == _LEN:
            size, at = _varint(buf, at)
            at += size
        elif kind == _VARINT:
            _, at = _varint(buf, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        else:
            return None
        if at > end:
            raise ValueError("truncated field")
        chunk = _fields(buf[at - size : at]) if kind == _LEN and tag >> 3 == _RESULTS_CHUNK else None
        if chunk is not None:
            chunks.append(chunk)
        else:
            rest.append(buf[start:at])
    return Whole(Results(nnd_pb2.TraceResults.FromString(b"".join(rest)), chunks))


def response(raw: bytes) -> nnd_pb2.TraceResponse | Chunk | Whole:
    """A data method's response: a `Chunk` for a result chunk, a `Whole` for the whole answer in one
    message, else the parsed message."""
    try:
        parsed = _chunk(raw) or (_whole(raw) if len(raw) > _BIG else None)
    except ValueError:
        parsed = None
    if parsed is not None:
        return parsed
    # protobuf takes bytes or a bytearray, not the map a big part is read into (_fast._fresh)
    return nnd_pb2.TraceResponse.FromString(raw if isinstance(raw, (bytes, bytearray)) else bytes(raw))


class DataStub:
    """Trace, TraceOnce, Generate, Session and Interact of nnd.v1.Nnd on `channel` (as `NndStub` has them),
    their responses read by `response`."""

    def __init__(self, channel: grpc.Channel) -> None:
        def stream(method: str, request: Any) -> Any:
            return channel.unary_stream(
                f"/nnd.v1.Nnd/{method}",
                request_serializer=request.SerializeToString,
                response_deserializer=response,
                _registered_method=True,
            )

        self.Trace = stream("Trace", nnd_pb2.TraceRequest)
        self.Generate = stream("Generate", nnd_pb2.TraceRequest)
        self.Session = stream("Session", nnd_pb2.SessionRequest)
        # A Trace answered in one message (nnd.proto, TraceOnce): a results message, never a chunk alone.
        self.TraceOnce = channel.unary_unary(
            f"/nnd.v1.Nnd/{contract.TRACE_ONCE}",
            request_serializer=nnd_pb2.TraceRequest.SerializeToString,
            response_deserializer=response,
            _registered_method=True,
        )
        self.Interact = channel.stream_stream(
            "/nnd.v1.Nnd/Interact",
            request_serializer=nnd_pb2.InteractRequest.SerializeToString,
            response_deserializer=response,
            _registered_method=True,
        )
