"""Value <-> Python/torch conversion: constants in, results out.

Results are detached, CPU, contiguous, little-endian bytes. Tensors of
INLINE_LIMIT bytes or more travel as a blob id followed by Chunk messages.
The host is assumed little-endian (x86-64, arm64), so torch's own bytes are
the wire bytes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nnd.v1 import nnd_pb2, values_pb2

from .. import errors
from . import numlists

INLINE_LIMIT = 64 * 1024
# Where result tensors of INLINE_LIMIT bytes or more go instead of blobs, when
# set: a callable that writes the tensor's wire bytes somewhere and returns the
# name and offset to put in `Tensor.shm` / `Tensor.shm_offset`, or None when it
# does not fit (then it is a blob) (the worker's shared-memory path, worker/shm.py).
blob_sink: contextvars.ContextVar[Callable[[torch.Tensor], tuple[str, int] | None] | None] = contextvars.ContextVar(
    "blob_sink", default=None
)
# Under gRPC's default 4 MiB receive limit with room for framing, so clients
# with default channel settings (Go, Rust, Node) receive any result.
CHUNK_SIZE = 4 * 1024 * 1024 - 64 * 1024
# A saved value whose Value message would be bigger (a `tolist()` of a million
# numbers, a long list of small tensors) travels serialized, in chunks
# (`Saved.value_blob`), with every tensor inside it inline.
VALUE_LIMIT = 1024 * 1024
# Estimated encoded bytes of one scalar Value in a list (tag, length, payload),
# counted against max_saved_bytes like tensor bytes.
SCALAR_BYTES = 11

TO_TORCH: dict[int, torch.dtype] = {
    values_pb2.FLOAT32: torch.float32,
    values_pb2.FLOAT16: torch.float16,
    values_pb2.BFLOAT16: torch.bfloat16,
    values_pb2.FLOAT64: torch.float64,
    values_pb2.INT64: torch.int64,
    values_pb2.INT32: torch.int32,
    values_pb2.INT16: torch.int16,
    values_pb2.INT8: torch.int8,
    values_pb2.UINT8: torch.uint8,
    values_pb2.BOOL: torch.bool,
}
FROM_TORCH: dict[torch.dtype, int] = {v: k for k, v in TO_TORCH.items()}


def to_torch_dtype(code: int) -> torch.dtype:
    try:
        return TO_TORCH[code]
    except KeyError:
        raise errors.InvalidArgument(f"unknown dtype {code} (DType enum value)") from None


def from_torch_dtype(dtype: torch.dtype) -> int:
    try:
        return FROM_TORCH[dtype]
    except KeyError:
        raise errors.InvalidArgument(f"dtype {dtype} cannot be sent on the wire") from None


# ------------------------------------------------------------------ decoding


def decode_tensor(msg: values_pb2.Tensor, data: bytes | None = None) -> torch.Tensor:
    """A CPU tensor from a Tensor message (`data` overrides msg.data, for chunked results)."""
    dtype = to_torch_dtype(msg.dtype)
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise errors.InvalidArgument(f"tensor shape {list(shape)} has a negative dimension")
    if msg.meta:
        return torch.empty(shape, dtype=dtype, device="meta")
    raw = msg.data if data is None else data
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise errors.InvalidArgument(
            f"tensor data is {len(raw)} bytes but shape {list(shape)} of {dtype} needs "
            f"{numel} * {itemsize} = {numel * itemsize} bytes"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: frombuffer needs a writable buffer, and the tensor must own its memory.
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def decode_value(msg: values_pb2.Value) -> Any:
    """The Python/torch value of a Value message (a constant from a request)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise errors.InvalidArgument("a Value has no kind set")
    if kind == "tensor":
        return decode_tensor(msg.tensor)
    if kind in ("int", "float", "bool", "str"):
        return getattr(msg, kind)
    if kind == "slice":
        s = msg.slice
        return slice(
            s.start if s.HasField("start") else None,
            s.stop if s.HasField("stop") else None,
            s.step if s.HasField("step") else None,
        )
    if kind == "ellipsis":
        return Ellipsis
    if kind == "none":
        return None
    if kind == "list":
        return [decode_value(v) for v in msg.list.items]
    if kind == "tuple":
        return tuple(decode_value(v) for v in msg.tuple.items)
    if kind == "size":
        return torch.Size(int(d) for d in msg.size.dims)
    if kind == "dtype":
        return to_torch_dtype(msg.dtype)
    if kind == "map":
        return {k: decode_value(v) for k, v in msg.map.items.items()}
    raise errors.InvalidArgument(f"unknown Value kind {kind!r}")


def constant_bytes(msg: values_pb2.Value) -> int:
    """Bytes of tensor data inside a constant (for max_constant_bytes)."""
    kind = msg.WhichOneof("kind")
    if kind == "tensor":
        return len(msg.tensor.data)
    if kind in ("list", "tuple"):
        return sum(constant_bytes(v) for v in getattr(msg, kind).items)
    if kind == "map":
        return sum(constant_bytes(v) for v in msg.map.items.values())
    return 0


# ------------------------------------------------------------------ encoding


# dtypes numpy does not have as such: tensor_view reads them through an integer view.
_VIEWED = (torch.bfloat16, torch.bool)


def tensor_view(t: torch.Tensor) -> memoryview:
    """Little-endian element bytes of `t` as a flat byte view (bfloat16 through a 16-bit view).

    No copy for a contiguous CPU tensor: a big result's bytes are copied once,
    into the messages that carry them, not first into a `bytes` of their own
    (fresh memory, which costs a page fault per 4 KiB)."""
    if t.numel() == 0:  # memoryview cannot cast a view with a zero in its shape
        return memoryview(b"")
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


_device_names: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = str(device)
    return name


def is_meta(t: torch.Tensor) -> bool:
    """True for tensors without data: meta or fake tensors (a Scan)."""
    if t.device.type == "meta":
        return True
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the usual case: no subclass to ask about
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@dataclass
class Encoder:
    """Turns saved values into Value messages; big tensors become blobs.

    Every byte a value makes the worker send counts against `max_bytes`
    (max_saved_bytes; 0: no limit): tensor bytes, and an estimate for
    everything else, checked as encoding goes, so a huge list is refused
    before its messages are built."""

    next_blob: int = 1
    # Blob id -> a view of the saved tensor's bytes, or the strided tensor itself (valid while the run's
    # saved values stay unchanged).
    blobs: list[tuple[int, memoryview | torch.Tensor]] = field(default_factory=list)
    total_bytes: int = 0
    max_bytes: int = 0
    inline: bool = False  # every tensor inline (inside a value that travels serialized: `saved`)
    placed: int = 0  # tensors the blob sink took (shared memory)

    def count(self, nbytes: int) -> None:
        self.total_bytes += nbytes
        if self.max_bytes and self.total_bytes > self.max_bytes:
            raise errors.ResourceExhausted(
                f"saved values exceed the limit max_saved_bytes={self.max_bytes} ({self.total_bytes} bytes so far "
                "in this request, the values its sync points sent included; non-tensor values estimated); save "
                "less or slice first"
            )

    def tensor(self, t: torch.Tensor) -> values_pb2.Tensor:
        dtype = from_torch_dtype(t.dtype)  # first: a dtype the wire cannot carry is refused as such
        plain_cpu = t.is_cpu and type(t) is torch.Tensor  # the usual case, asked cheaply: neither meta nor fake
        if not plain_cpu and is_meta(t):
            return values_pb2.Tensor(dtype=dtype, shape=t.shape, meta=True, device="meta")
        nbytes = t.numel() * t.element_size()
        self.count(nbytes)
        if plain_cpu and nbytes < INLINE_LIMIT and t.dtype not in _VIEWED:  # a small value: its bytes at once
            data = (t.detach() if t.requires_grad else t).numpy().tobytes()  # C order, whatever the strides
            return values_pb2.Tensor(dtype=dtype, shape=t.shape, device="cpu", data=data)
        msg = values_pb2.Tensor(dtype=dtype, shape=t.shape, device=_device_name(t.device))
        sink = blob_sink.get()
        if sink is not None and nbytes >= INLINE_LIMIT and not self.inline:
            place = sink(t)
            if place is not None:
                msg.shm, msg.shm_offset = place
                self.placed += 1
                return msg
        if nbytes >= INLINE_LIMIT and not self.inline:
            msg.blob = self.next_blob
            # A strided CPU view (a slice, an expand) is copied chunk by chunk as it is sent, not first
            # into a contiguous copy of its own (fresh memory: a page fault per 4 KiB).
            strided = t.device.type == "cpu" and not t.is_contiguous()
            self.blobs.append((self.next_blob, t.detach() if strided else tensor_view(t)))
            self.next_blob += 1
        else:
            msg.data = tensor_view(t).tobytes()
        return msg

    def saved(self, x: Any) -> tuple[values_pb2.Value, bytes | None]:
        """A saved value's message, or (when it is bigger than VALUE_LIMIT) an empty one and its
        serialized bytes, with every tensor inline: a blob of its own, chunked (`Saved.value_blob`)."""
        first, before, placed = len(self.blobs), self.total_bytes, self.placed
        msg = self.value(x)
        if msg.ByteSize() <= VALUE_LIMIT:
            return msg, None
        if len(self.blobs) == first and self.placed == placed:  # every tensor in it is inline already
            return values_pb2.Value(), msg.SerializeToString()
        # Again, self-contained: its bytes are counted once, its tensors are not blobs of their own.
        del self.blobs[first:]
        self.total_bytes, self.inline = before, True
        try:
            raw = self.value(x).SerializeToString()
        finally:
            self.inline = False
        return values_pb2.Value(), raw

    def value(self, x: Any) -> values_pb2.Value:
        if isinstance(x, torch.Tensor):
            return values_pb2.Value(tensor=self.tensor(x))
        if isinstance(x, str):
            self.count(len(x) + SCALAR_BYTES)
            return values_pb2.Value(str=x)
        self.count(SCALAR_BYTES)
        if x is None:
            return values_pb2.Value(none=values_pb2.Empty())
        if x is Ellipsis:
            return values_pb2.Value(ellipsis=values_pb2.Empty())
        if isinstance(x, bool):
            return values_pb2.Value(bool=x)
        if isinstance(x, int):
            return values_pb2.Value(int=x)
        if isinstance(x, float):
            return values_pb2.Value(float=x)
        if isinstance(x, torch.dtype):
            return values_pb2.Value(dtype=from_torch_dtype(x))
        if isinstance(x, torch.Size):
            return values_pb2.Value(size=values_pb2.Shape(dims=list(x)))
        if isinstance(x, slice):
            s = values_pb2.Slice()
            for name in ("start", "stop", "step"):
                if getattr(x, name) is not None:
                    setattr(s, name, int(getattr(x, name)))
            return values_pb2.Value(slice=s)
        if isinstance(x, torch.device):
            return values_pb2.Value(str=str(x))
        if isinstance(x, Mapping):  # dicts and HF ModelOutputs: tensor-like fields only
            items = {str(k): self.value(v) for k, v in x.items() if _encodable(v)}
            self.count(sum(len(k) for k in items))
            return values_pb2.Value(map=values_pb2.ValueMap(items=items))
        if isinstance(x, (list, tuple)):
            # Inside a sequence, what the wire cannot carry (a KV cache among a
            # block's inputs) becomes None so positions keep their meaning.
            kind = "list" if isinstance(x, list) else "tuple"
            numbers = numlists.encode(x)  # a tolist() of a tensor: at once
            if numbers is not None:
                self.count(SCALAR_BYTES * len(x))
                return numbers
            items = [self.value(v) if _carried(v) else values_pb2.Value(none=values_pb2.Empty()) for v in x]
            return values_pb2.Value(**{kind: values_pb2.ValueList(items=items)})
        raise errors.InvalidArgument(f"a value of type {type(x).__name__} cannot be returned")


def _carried(x: Any) -> bool:
    """Whether `value` can encode x itself (containers are judged item by item)."""
    return isinstance(x, (list, tuple, Mapping, torch.device, slice)) or x is Ellipsis or _encodable(x)


def _encodable(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return all(_encodable(v) for v in x)
    return x is None or isinstance(x, (torch.Tensor, bool, int, float, str, torch.Size, torch.dtype, Mapping))


def saved_messages(
    node: int,
    value: values_pb2.Value,
    blobs: Iterable[tuple[int, bytes | memoryview | torch.Tensor]],
    value_blob: int = 0,
) -> Iterable[nnd_pb2.TraceResponse | ChunkResponse]:
    """The Saved message for `node` followed by the chunks of its blobs, in order (`value_blob`: the
    first of them is the value itself, serialized; `value` is then empty)."""
    saved = nnd_pb2.Saved(node=node, value_blob=value_blob) if value_blob else nnd_pb2.Saved(node=node, value=value)
    yield nnd_pb2.TraceResponse(saved=saved)
    for blob, raw in blobs:
        if isinstance(raw, torch.Tensor):
            staging = _Staging()
            for pieces in _chunked(raw, CHUNK_SIZE // raw.element_size()):
                yield ChunkResponse(blob, _Strided(pieces, staging))
            continue
        view = memoryview(raw).cast("B")
        for start in range(0, len(view), CHUNK_SIZE):
            yield ChunkResponse(blob, view[start : start + CHUNK_SIZE])


def _pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of `t` of at most `limit` elements each, covering it in row-major order."""
    if t.numel() <= limit:
        yield t
    elif t.dim() == 1:
        for start in range(0, t.shape[0], limit):
            yield t[start : start + limit]
    elif t[0].numel() <= limit:
        rows = limit // t[0].numel()
        for start in range(0, t.shape[0], rows):
            yield t[start : start + rows]
    else:
        for row in t:
            yield from _pieces(row, limit)


def _chunked(t: torch.Tensor, limit: int) -> Iterator[list[torch.Tensor]]:
    """`t`'s pieces grouped into chunks of at most `limit` elements."""
    group: list[torch.Tensor] = []
    size = 0
    for piece in _pieces(t, limit):
        if size + piece.numel() > limit:
            yield group
            group, size = [], 0
        group.append(piece)
        size += piece.numel()
    if group:
        yield group


class _Staging:
    """One chunk's worth of memory, reused for every chunk of a strided blob: its chunks are
    serialized one after the other, on the thread that sends them."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(CHUNK_SIZE, dtype=torch.uint8)
        return self.buffer


class _Strided:
    """The bytes of a few views of a strided tensor, in order, gathered when serialized."""

    def __init__(self, pieces: list[torch.Tensor], staging: _Staging) -> None:
        self.pieces = pieces
        self.staging = staging
        self.nbytes = sum(p.numel() for p in pieces) * pieces[0].element_size()

    def __len__(self) -> int:
        return self.nbytes

    def view(self, *, own: bool = False) -> memoryview:
        """The bytes, in the staging buffer (valid until the next chunk of the blob is gathered), or with
        `own` in memory of their own (gathered there directly: one copy, not two)."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8) if own else self.staging.get()[: self.nbytes]
        typed = buffer.view(self.pieces[0].dtype)
        at = 0
        for p in self.pieces:
            typed[at : at + p.numel()].view(p.shape).copy_(p)
            at += p.numel()
        return memoryview(buffer.numpy())


def _tag(descriptor: Any, name: str, wire_type: int) -> bytes:
    return numlists.varint(descriptor.fields_by_name[name].number << 3 | wire_type)


_CHUNK_TAG = _tag(nnd_pb2.TraceResponse.DESCRIPTOR, "chunk", 2)
_BLOB_TAG = _tag(nnd_pb2.Chunk.DESCRIPTOR, "blob", 0)
_DATA_TAG = _tag(nnd_pb2.Chunk.DESCRIPTOR, "data", 2)


class ChunkResponse:
    """A `TraceResponse{chunk}` whose wire bytes are written straight from the saved tensor's memory.

    Building the message would copy each chunk three times (a `bytes` of it, the
    message's field, the serialized message), each into fresh memory; this makes
    the serialized message in one copy (gRPC's own copy follows). It answers the
    few questions the worker asks of a response (`WhichOneof`, `chunk.blob`, which
    batching renumbers); `message()` is the real thing, for any other use."""

    __slots__ = ("_data", "blob")

    def __init__(self, blob: int, data: memoryview | _Strided) -> None:
        self.blob = blob
        self._data = data  # the saved tensor's bytes, read when sent (the run's saved values are final by then)

    @property
    def data(self) -> memoryview | bytes:
        """The chunk's bytes, as `Chunk.data` (a copy of its own for a strided tensor's)."""
        return self._data.view().tobytes() if isinstance(self._data, _Strided) else self._data

    def _bytes(self) -> memoryview:
        """The chunk's bytes, to send at once (a strided tensor's lie in the blob's staging buffer)."""
        return self._data.view() if isinstance(self._data, _Strided) else self._data

    @property
    def chunk(self) -> ChunkResponse:
        return self

    def WhichOneof(self, group: str) -> str | None:  # noqa: N802 - the protobuf message's method
        return "chunk" if group == "kind" else None

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf message's method
        return b"".join(self.pieces(stable=False))

    def pieces(self, *, stable: bool = True) -> tuple[bytes, bytes | memoryview]:
        """The serialized message as its framing and its data: the data a view of the saved tensor's
        memory, or (a strided tensor's, gathered into a staging buffer the next chunk reuses) with
        `stable`, gathered into memory of its own."""
        size = len(self._data)
        inner = (
            _BLOB_TAG + numlists.varint(self.blob) + _DATA_TAG + numlists.varint(size)
            if self.blob
            else _DATA_TAG + numlists.varint(size)
        )
        data = self._data.view(own=stable) if isinstance(self._data, _Strided) else self._data
        return _CHUNK_TAG + numlists.varint(len(inner) + size) + inner, data

    def message(self) -> nnd_pb2.TraceResponse:
        msg = nnd_pb2.TraceResponse()
        msg.chunk.blob = self.blob
        msg.chunk.data = self._bytes().tobytes()
        return msg
