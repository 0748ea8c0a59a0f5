"""A whole Trace (or Generate) response as one message (TraceRequest.one_message).

A server-streaming call writes each message on its own and waits for it (one
batch, one wake-up of the serving thread per message) before the status goes
out: a small trace paid that twice, once for its Saved value and once for its
TraceDone. `TraceResults` numbers its fields as TraceResponse does, so the one
message is the stream's messages joined under one tag: no value is parsed or
copied again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nnd.v1 import contract, nnd_pb2
from nnd_daemon.engine.numlists import varint as _varint

# Above this the stream's own chunking is cheaper: the client reads a streamed chunk as a view of the
# bytes gRPC received (pyclient/nnd/_chunks.py), but parses a joined one with protobuf (one more copy).
MAX_BYTES = 256 * 1024
# A TraceOnce has no stream to fall back on: its answer is one message up to the transport's limit
# (less room for the message's own framing).
MAX_ONE = contract.MAX_MESSAGE - 2**20
_KINDS = frozenset({"saved", "chunk", "step", "done", "paused"})
_ENDS = frozenset({"done", "paused"})
_TAG = bytes([nnd_pb2.TraceResponse.DESCRIPTOR.fields_by_name["results"].number << 3 | 2])


class Gathered:
    """A serialized message kept as the buffers it is made of, result chunks as views of the saved
    tensors' memory: the fast route writes them as they are (sendmsg gathers them), and only a
    transport that needs one `bytes` joins them (`SerializeToString`). A 256 MiB result joined was
    copied twice into fresh memory (each chunk serialized, then the whole) before it was sent."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: list[bytes | memoryview], size: int) -> None:
        self.parts = parts  # bytes, and byte-format views (len() is their size)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf message's method
        return b"".join(self.parts)


def join(responses: Sequence[Any], limit: int = MAX_BYTES, *, gather: bool = False) -> bytes | Gathered | None:
    """`responses` (a finished Trace's TraceResponse messages, ending with its TraceDone, or an Interact
    run's since its last pause, ending with Paused) as one serialized `TraceResponse{results}`; None
    when they must stream (too big, or of another kind). `gather`: a message over MAX_BYTES comes as
    the `Gathered` buffers of its parts instead of their copy."""
    if not responses or responses[-1].WhichOneof("kind") not in _ENDS:
        return None
    parts: list[bytes | memoryview] = []
    size = 0
    for response in responses:
        if response.WhichOneof("kind") not in _KINDS:
            return None
        # A result chunk (engine/wire.py's ChunkResponse) gives its framing and a view of its data.
        split = getattr(response, "pieces", None) if gather else None
        pieces = split() if split is not None else (response.SerializeToString(),)
        size += sum(map(len, pieces))
        parts.extend(pieces)
        if size > limit:
            return None
    head = _TAG + _varint(size)
    if gather and size > MAX_BYTES:
        return Gathered([head, *parts], len(head) + size)
    return head + b"".join(parts)


class Joiner:
    """An Interact run's `emit`: saved values and their chunks wait for the Paused or TraceDone that
    follows them and go out with it as one message (`put`); anything else (a step's tokens) goes out at
    once, after what waited. `flush()` sends what waits (the run failed or ended otherwise)."""

    def __init__(self, put: Any) -> None:
        self.put = put
        self.held: list[Any] = []

    def __call__(self, response: Any) -> None:
        kind = response.WhichOneof("kind") if isinstance(response, nnd_pb2.TraceResponse) else None
        if kind in ("saved", "chunk"):
            self.held.append(response)
            return
        if kind in _ENDS:
            whole = join([*self.held, response])
            if whole is not None:
                self.held = []
                self.put(whole)
                return
        self.flush()
        self.put(response)

    def flush(self) -> None:
        held, self.held = self.held, []
        for response in held:
            self.put(response)
