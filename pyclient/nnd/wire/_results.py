"""Reassembling a Trace/Scan/Generate response stream into saved values."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from nnd.v1 import nnd_pb2, values_pb2
from nnd.wire import _codec, _dtypes
from nnd.wire._warm import WarmBuffers

if TYPE_CHECKING:
    from nnd.wire._shm import Lease


@dataclass(frozen=True)
class StepToken:
    """The tokens one generation step produced: one id (and text) per invoke."""

    step: int
    ids: tuple[int, ...]
    texts: tuple[str, ...] = ()
    trace: int = 0
    """In a session: which of its blocks produced these tokens (0 otherwise)."""

    @property
    def id(self) -> int:
        """The id of the first (usually only) invoke."""
        return self.ids[0]

    @property
    def text(self) -> str:
        """The text of the first invoke's token ("" unless text was streamed)."""
        return self.texts[0] if self.texts else ""


WARM_MIN = 16 * 2**20  # results this big are reassembled in recycled memory (_warm.py)
_warm = WarmBuffers()


def _buffer(nbytes: int) -> np.ndarray:
    if nbytes >= WARM_MIN:
        return _warm.take(nbytes)
    return np.empty(nbytes, dtype=np.uint8)  # not zero-filled: every byte is about to be written


class _Blobs:
    """Chunked tensors reassembled with one copy: each chunk goes straight into a buffer of the
    tensor's size, allocated when the Saved message naming the blob arrives (the decoder then
    wraps that buffer without copying it again)."""

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}
        self.filled: dict[int, int] = {}
        self.parts: dict[int, list[bytes]] = {}  # blobs of unknown size (never from nnd): joined at the end

    def expect(self, value: values_pb2.Value) -> None:
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            t = value.tensor
            if t.blob and t.blob not in self.buffers:
                self.buffers[t.blob] = _buffer(math.prod(t.shape) * _dtypes.itemsize(_dtypes.name_of(t.dtype)))
                self.filled[t.blob] = 0
        elif kind in ("list", "tuple"):
            for item in getattr(value, kind).items:
                self.expect(item)
        elif kind == "map":
            for item in value.map.items.values():
                self.expect(item)

    def add(self, blob: int, data: bytes) -> None:
        buf = self.buffers.get(blob)
        start = self.filled.get(blob, 0)
        if buf is None or start + len(data) > len(buf):
            self.parts.setdefault(blob, []).append(data)
            return
        buf[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.filled[blob] = start + len(data)

    def joined(self) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for blob, buf in self.buffers.items():
            if blob in self.parts:  # more bytes than the shape says: let the decoder report it
                out[blob] = buf[: self.filled[blob]].tobytes() + b"".join(self.parts[blob])
            elif self.filled[blob] != len(buf):
                out[blob] = buf[: self.filled[blob]].tobytes()
            else:
                out[blob] = buf
        for blob, parts in self.parts.items():
            out.setdefault(blob, b"".join(parts))
        return out


@dataclass
class Results:
    """Everything a response stream carried, decoded."""

    saved: dict[int, Any] = field(default_factory=dict)
    compute_s: float = 0.0


def _say_queued(queued: nnd_pb2.Queued) -> None:
    """One line, in the notebook cell or terminal, while a request waits for a shared model."""
    import sys

    why = "the model is busy"
    if queued.paused_by:  # held by another client's run stopped at a sync point: say whose, and how long at most
        why = (
            f"the model is paused at a sync point by another client ({queued.paused_by}) for at most "
            f"{queued.paused_for_at_most_s:.1f} s more"
        )
    print(f"nnd: {why}; waiting for its turn ({queued.ahead} ahead)", file=sys.stderr, flush=True)


def collect(
    responses: Iterable[nnd_pb2.TraceResponse],
    *,
    use_torch: bool | None = None,
    on_step: Callable[[StepToken], None] | None = None,
    lease: Lease | None = None,
    until_paused: bool = False,
) -> Results:
    """Read a whole response stream. Chunks of a blob are concatenated in
    arrival order; values are decoded once every chunk is in.

    `lease`: the shared-memory region (`_shm.attach`) the request behind
    `responses` named (if any), settled here: back to the pool when the stream
    failed to finish or no result lies in it, else once the results that view it
    are garbage; the size of the big results sizes the next region.

    `until_paused`: stop at an Interact stream's Paused message (a sync point's
    values), leaving the rest of the stream unread."""
    raw: dict[int, values_pb2.Value] = {}
    serialized: dict[int, int] = {}  # node -> the blob holding its serialized value (Saved.value_blob)
    blobs = _Blobs()
    out = Results()
    ok = False
    decoder = None
    try:
        def take(saved: nnd_pb2.Saved) -> None:
            if saved.value_blob:
                serialized[saved.node] = saved.value_blob
            else:
                raw[saved.node] = saved.value
                blobs.expect(saved.value)

        for msg in responses:
            kind = msg.WhichOneof("kind")
            if kind == "saved":
                take(msg.saved)
            elif kind == "results":  # the whole response in one message (TraceRequest.one_message)
                whole = msg.results
                if on_step is not None:
                    for step in whole.step:
                        on_step(StepToken(step.step, tuple(step.ids), tuple(step.text), step.trace))
                for saved in whole.saved:
                    take(saved)
                for chunk in whole.chunk:
                    blobs.add(chunk.blob, chunk.data)
                out.compute_s = whole.done.compute_s
                if until_paused and whole.HasField("paused"):
                    break
            elif kind == "chunk":
                blobs.add(msg.chunk.blob, msg.chunk.data)
            elif kind == "step":
                if on_step is not None:
                    on_step(StepToken(msg.step.step, tuple(msg.step.ids), tuple(msg.step.text), msg.step.trace))
            elif kind == "done":
                out.compute_s = msg.done.compute_s
            elif kind == "queued" and not msg.queued.running:
                _say_queued(msg.queued)
            elif kind == "paused" and until_paused:
                break
        joined = blobs.joined()
        for node, blob in serialized.items():
            raw[node] = values_pb2.Value.FromString(bytes(joined.pop(blob, b"")))
        region = lease.region if lease is not None else None
        decoder = _codec.Decoder(joined, use_torch=use_torch, regions={region.name: lease} if region else None)
        out.saved = {node: decoder.value(value) for node, value in raw.items()}
        ok = True
    finally:
        if lease is not None:
            lease.finish(ok, decoder.big_bytes if decoder is not None else 0)
    return out
