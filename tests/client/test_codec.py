"""Value encoding round trips and response reassembly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nnd.v1 import nnd_pb2, values_pb2
from nnd.wire import _codec, _meta, _results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8])
def test_torch_round_trip(dtype):
    t = (torch.arange(24).reshape(2, 3, 4) % 5).to(dtype)
    back = _codec.Decoder().value(_codec.encode(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_bfloat16_wire_bytes_are_torch_storage():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    v = _codec.encode(t)
    assert v.tensor.dtype == values_pb2.BFLOAT16
    assert v.tensor.data == t.view(torch.int16).numpy().tobytes()
    widened = _codec.Decoder(use_torch=False).value(v)
    assert widened.dtype == np.float32 and widened.tolist() == [1.0, -2.5, 3.140625]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int8, np.bool_])
def test_numpy_round_trip(dtype):
    a = (np.arange(6).reshape(2, 3) % 3).astype(dtype)
    back = _codec.Decoder(use_torch=False).value(_codec.encode(a))
    assert back.dtype == a.dtype and np.array_equal(back, a)


def test_scalars_and_containers():
    value = [1, 2.5, True, "s", None, Ellipsis, slice(None, -1), (1, [2]), {"a": 1}, torch.Size([2, 3]), torch.int64]
    assert _codec.Decoder().value(_codec.encode(value)) == value
    plain = _codec.Decoder(use_torch=False).value(_codec.encode((torch.Size([2]), torch.float16)))
    assert plain == ((2,), "float16")


def test_slice_with_nonint_bound_is_refused():
    with pytest.raises(TypeError, match="slice bounds"):
        _codec.encode(slice(0, 2.5))


def test_meta_tensors():
    v = values_pb2.Value(tensor=values_pb2.Tensor(dtype=values_pb2.FLOAT16, shape=[2, 3], meta=True))
    t = _codec.Decoder().value(v)
    assert t.device.type == "meta" and t.shape == (2, 3) and t.dtype == torch.float16
    m = _codec.Decoder(use_torch=False).value(v)
    assert isinstance(m, _meta.MetaTensor) and m.shape == (2, 3) and m.dtype == "float16" and m.ndim == 2


def test_chunks_are_concatenated_per_blob_in_order():
    a = torch.arange(10, dtype=torch.float32)
    b = torch.arange(6, dtype=torch.int64)
    ab, bb = a.numpy().tobytes(), b.numpy().tobytes()
    t1 = values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[10], blob=1)
    t2 = values_pb2.Tensor(dtype=values_pb2.INT64, shape=[2, 3], blob=2)
    nested = values_pb2.Value(list=values_pb2.ValueList(items=[values_pb2.Value(tensor=t2)]))
    stream = [
        nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=3, value=values_pb2.Value(tensor=t1))),
        nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=5, value=nested)),
        nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=1, data=ab[:7])),
        nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=2, data=bb[:20])),
        nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=1, data=ab[7:])),
        nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=2, data=bb[20:])),
        nnd_pb2.TraceResponse(step=nnd_pb2.StepTokens(step=0, ids=[4, 5])),
        nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=0.5)),
    ]
    steps: list[_results.StepToken] = []
    res = _results.collect(stream, on_step=steps.append)
    assert torch.equal(res.saved[3], a) and torch.equal(res.saved[5][0], b.reshape(2, 3))
    assert [s.ids for s in steps] == [(4, 5)] and res.compute_s == 0.5


def test_a_one_message_response_reads_as_the_stream_it_joins():
    """The worker joins a small trace's stream into one TraceResults message (TraceRequest.one_message)
    by joining the messages' bytes; the client reads from it what it reads from the stream."""
    from nnd_daemon.worker import onemessage

    a = torch.arange(10, dtype=torch.float32)
    ab = a.numpy().tobytes()
    t1 = values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[10], blob=1)
    stream = [
        nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=3, value=values_pb2.Value(tensor=t1))),
        nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=4, value=values_pb2.Value(int=7))),
        nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=1, data=ab[:7])),
        nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=1, data=ab[7:])),
        nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=0.25)),
    ]
    one = nnd_pb2.TraceResponse.FromString(onemessage.join(stream))
    assert one.WhichOneof("kind") == "results" and len(one.results.saved) == 2 and len(one.results.chunk) == 2
    res = _results.collect([one])
    assert torch.equal(res.saved[3], a) and res.saved[4] == 7 and res.compute_s == 0.25
    # A Generate's steps join too, and reach the client's on_step in step order.
    steps = [nnd_pb2.TraceResponse(step=nnd_pb2.StepTokens(step=i, ids=[10 + i], text=[f"t{i}"])) for i in range(3)]
    both = nnd_pb2.TraceResponse.FromString(onemessage.join([stream[0], steps[0], *stream[1:3], *steps[1:], *stream[3:]]))
    seen: list = []
    res = _results.collect([both], on_step=seen.append)
    streamed: list = []
    _results.collect([*steps, stream[-1]], on_step=streamed.append)
    assert seen == streamed and [t.step for t in seen] == [0, 1, 2] and seen[2].ids == (12,)
    assert torch.equal(res.saved[3], a) and res.saved[4] == 7
    # What must stream stays a stream: an unfinished stream, results over the bound.
    assert onemessage.join(stream[:-1]) is None and onemessage.join(steps) is None
    big = nnd_pb2.TraceResponse(chunk=nnd_pb2.Chunk(blob=1, data=b"x" * onemessage.MAX_BYTES))
    assert onemessage.join([big, stream[-1]]) is None


def test_a_big_one_message_answer_is_sent_and_read_without_copies_of_its_chunks():
    """A TraceOnce answer over MAX_BYTES: the worker keeps it as the buffers it is made of, each
    chunk's data a view of the saved tensor's memory (onemessage.Gathered, written by the fast route
    with one gathering sendmsg); the client reads the received message's chunks as views of it
    (_chunks.response), not as protobuf's copies. The bytes are protobuf's, and so are the values."""
    from nnd.wire import _chunks
    from nnd_daemon.engine import wire
    from nnd_daemon.worker import onemessage

    a = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: several chunks of 256 KiB
    raw = memoryview(a.numpy()).cast("B")
    size = 256 * 1024
    chunks = [wire.ChunkResponse(1, raw[i : i + size]) for i in range(0, len(raw), size)]
    t1 = values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[300_000], blob=1)
    saved = nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=3, value=values_pb2.Value(tensor=t1)))
    done = nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=0.25))
    whole = onemessage.join([saved, *chunks, done], limit=onemessage.MAX_ONE, gather=True)
    assert isinstance(whole, onemessage.Gathered)
    assert any(isinstance(p, memoryview) and p.obj is raw.obj for p in whole.parts)  # views, not copies
    as_protobuf = nnd_pb2.TraceResponse(saved=saved.saved)
    as_protobuf.results.saved.append(saved.saved)
    as_protobuf.ClearField("saved")
    for c in chunks:
        as_protobuf.results.chunk.add(blob=1, data=bytes(c.data))
    as_protobuf.results.done.compute_s = 0.25
    joined = whole.SerializeToString()
    assert joined == onemessage.join([saved, *chunks, done], limit=onemessage.MAX_ONE) == as_protobuf.SerializeToString()
    assert len(whole) == len(joined)

    received = bytearray(joined)
    read = _chunks.response(received)
    assert read.WhichOneof("kind") == "results"
    assert all(isinstance(c.data, memoryview) and c.data.obj is received for c in read.results.chunk)
    assert [(c.blob, bytes(c.data)) for c in read.results.chunk] == [(c.blob, c.data) for c in as_protobuf.results.chunk]
    res = _results.collect([read])
    assert torch.equal(res.saved[3], a) and res.compute_s == 0.25
    # A message cut short is refused as protobuf refuses it, never read as the chunks that arrived.
    with pytest.raises(Exception, match="[Tt]runcated|[Ee]rror parsing"):
        _chunks.response(received[:-100])
    # A small answer stays bytes, parsed by protobuf as before.
    small = onemessage.join([saved, wire.ChunkResponse(1, raw[:4000]), done], limit=onemessage.MAX_ONE, gather=True)
    assert isinstance(small, bytes) and isinstance(_chunks.response(small), nnd_pb2.TraceResponse)


def test_short_tensor_data_is_an_error():
    v = values_pb2.Value(tensor=values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[4], data=b"\0" * 8))
    with pytest.raises(ValueError, match="needs 16 bytes"):
        _codec.Decoder().value(v)
