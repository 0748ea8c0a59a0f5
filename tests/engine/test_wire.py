"""Value encoding: dtypes, bfloat16, inline vs chunked tensors, plain values."""

from __future__ import annotations

import pytest
import torch
import wire_results
from graphs import Graph, value

from nnd_daemon import errors
from nnd_daemon.engine import wire


@pytest.mark.parametrize("dtype", list(wire.FROM_TORCH))
def test_tensor_round_trip(dtype):
    t = (torch.arange(24).reshape(2, 3, 4) % 7).to(dtype)
    assert torch.equal(wire.decode_value(value(t)), t)


@pytest.mark.parametrize("dtype", list(wire.FROM_TORCH))
@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.transpose(0, 2),  # strided
        lambda t: t[:, -1],  # a slice, as output[:, -1]
        lambda t: t[0, 0, 0],  # 0-d
        lambda t: t[:, :0],  # empty
        lambda t: t.expand(3, 2, 3, 4)[:, 1],  # stride 0
    ],
)
def test_a_small_tensor_of_any_layout_round_trips_inline(dtype, make):
    t = make((torch.arange(24).reshape(2, 3, 4) % 7).to(dtype))
    msg = wire.Encoder().value(t)
    assert msg.tensor.data or t.numel() == 0
    got = wire.decode_value(msg)
    assert got.shape == t.shape and got.dtype == t.dtype and torch.equal(got, t)


def test_a_tensor_that_requires_grad_encodes_its_values():
    t = torch.linspace(-1, 1, 12).reshape(3, 4).requires_grad_()
    assert torch.equal(wire.decode_value(wire.Encoder().value(t * 2)), (t * 2).detach())


def test_bfloat16_is_upper_half_of_float32():
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    f32 = torch.tensor([1.5, -2.0]).numpy().tobytes()
    raw = wire_results.tensor_bytes(t)
    assert raw == f32[2:4] + f32[6:8]


def test_plain_values_round_trip():
    for x in [3, 2.5, True, "s", None, Ellipsis, slice(1, None, 2), torch.Size([2, 3]), torch.float16, [1, (2, 3)]]:
        assert wire.decode_value(wire.Encoder().value(x)) == x


def test_big_tensor_is_chunked(gpt2):
    g = Graph()
    big = g.save(g.op("zeros", 1_300_000))  # 5.2 MB: two 4 MiB chunks
    small = g.save(g.op("ones", 3))
    msgs = gpt2.stream(g.request("Hi"))
    kinds = [r.WhichOneof("kind") for r in msgs]
    assert kinds == ["saved", "chunk", "chunk", "saved", "done"]
    assert msgs[0].saved.value.tensor.blob == msgs[1].chunk.blob == msgs[2].chunk.blob
    assert len(msgs[1].chunk.data) == wire.CHUNK_SIZE
    got = wire_results.collect(msgs)
    assert torch.equal(got[big.id], torch.zeros(1_300_000)) and torch.equal(got[small.id], torch.ones(3))


def test_model_output_is_a_map(gpt2):
    g = Graph()
    out = g.save(g.module(""))
    got = gpt2.run(g.request("Hi"))[out.id]
    assert isinstance(got, dict) and "logits" in got


def test_unknown_dtype():
    v = value(torch.zeros(2))
    v.tensor.dtype = 99
    with pytest.raises(errors.InvalidArgument, match="dtype"):
        wire.decode_value(v)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn])
def test_a_small_tensor_of_a_dtype_the_wire_lacks_is_refused_by_name(dtype):
    """Whether numpy has the dtype (complex) or not (float8), the refusal names it; not numpy's TypeError."""
    with pytest.raises(errors.InvalidArgument, match="cannot be sent on the wire"):
        wire.Encoder().value(torch.zeros(3, dtype=dtype))


def test_a_chunk_is_written_as_protobuf_writes_it_and_the_client_reads_it_back():
    from nnd.v1 import nnd_pb2
    from nnd.wire import _chunks

    data = bytes(range(256)) * 300
    for blob in (1, 300, 2**32 - 1):
        ours = wire.ChunkResponse(blob, memoryview(data))
        raw = ours.SerializeToString()
        assert raw == ours.message().SerializeToString()
        assert nnd_pb2.TraceResponse.FromString(raw).chunk == nnd_pb2.Chunk(blob=blob, data=data)
        got = _chunks.response(raw)
        assert isinstance(got, _chunks.Chunk) and got.WhichOneof("kind") == "chunk"
        assert got.chunk.blob == blob and bytes(got.chunk.data) == data


def test_the_client_reads_any_other_layout_with_protobuf():
    from nnd.v1 import nnd_pb2
    from nnd.wire import _chunks

    data = b"\x01\x02\x03" * 1000
    # Fields in another order (valid protobuf a server in another language may write), and an unknown field.
    inner = b"\x12\xb8\x17" + data + b"\x08\x07"
    reordered = b"\x12" + bytes([(len(inner) & 0x7F) | 0x80, len(inner) >> 7]) + inner
    unknown = nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=7, data=data)).SerializeToString() + b"\x98\x06\x01"
    saved = nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=3)).SerializeToString()
    for raw in (reordered, unknown):
        got = _chunks.response(raw)
        assert isinstance(got, nnd_pb2.TraceResponse)
        assert got.chunk.blob == 7 and got.chunk.data == data
    assert _chunks.response(saved) == nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=3))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 5)[1, 2].expand(3_000_000),  # one element, 12 MB
        lambda: torch.randn(40, 1000, 60).transpose(0, 2),  # rows of 40 000 values
        lambda: torch.randn(3, 1_100_000)[:, ::2],  # rows of 550 000 values: more than a chunk holds (1 032 192)
        lambda: torch.randn(2, 1_200_001)[:, 1:],  # rows just over a chunk
        lambda: torch.randn(3, 700_000, dtype=torch.float64).t(),
        lambda: (torch.randn(3000, 3000) > 0).t(),
        lambda: torch.randn(1500, 1500).bfloat16().t(),
    ],
)
def test_a_strided_result_is_sent_as_its_contiguous_bytes(make):
    from nnd.wire import _chunks

    t = make()
    assert not t.is_contiguous()
    encoder = wire.Encoder()
    msg = encoder.value(t)
    assert msg.tensor.blob and len(encoder.blobs) == 1
    responses = list(wire.saved_messages(1, msg, encoder.blobs))[1:]
    assert len(responses) > 1 and all(len(r.chunk.data) <= wire.CHUNK_SIZE for r in responses)
    want = wire_results.tensor_bytes(t.contiguous())
    # As the client receives them (one after the other: strided chunks share one staging buffer) ...
    received = b"".join(bytes(_chunks.response(r.SerializeToString()).chunk.data) for r in responses)
    assert received == want
    # ... and as in-process readers of the responses see them.
    assert b"".join(bytes(r.chunk.data) for r in responses) == want
    assert wire.decode_tensor(msg.tensor, want).equal(t)
