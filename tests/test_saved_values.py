"""Saved values that are not tensors (a `tolist()` of a million numbers) against a real daemon.

They count against max_saved_bytes (an estimate of their encoded size), and a
value too big for one message travels serialized in chunks
(`Saved.value_blob`), so a client whose channel keeps gRPC's default 4 MiB
receive limit (any language's default) gets it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd
from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
from nnd.wire import _results

LIMIT = 8_000_000  # max_saved_bytes of the daemon here


@pytest.fixture(scope="module")
def small_limit_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("saved"), "--max-saved-bytes", str(LIMIT), in_process=True)
    nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
    yield d
    d.stop()


def _request(model: str, repeat: int, *, tolist: bool) -> nnd_pb2.TraceRequest:
    """Saves transformer.h.0's output flattened and repeated `repeat` times (node 5), as a list or a tensor."""
    g = graph_pb2.Graph()
    n = g.nodes.add(id=1)
    n.module.path, n.module.point, n.module.invoke = "transformer.h.0", graph_pb2.OUTPUT, 0
    n = g.nodes.add(id=2)
    n.op.name = "flatten"
    n.op.args.add().ref = 1
    n = g.nodes.add(id=3)
    n.op.name = "repeat"
    n.op.args.add().ref = 2
    n.op.args.add().value.int = repeat
    n = g.nodes.add(id=4)
    n.op.name = "tolist" if tolist else "contiguous"
    n.op.args.add().ref = 3
    g.nodes.add(id=5).save.value.ref = 4
    request = nnd_pb2.TraceRequest(model=model, graph=g)
    request.invokes.add(text="hello world")
    return request


def _trace(address: str, request: nnd_pb2.TraceRequest) -> list[nnd_pb2.TraceResponse]:
    # gRPC's defaults: no message over 4 MiB is received.
    with grpc.insecure_channel(address) as channel:
        return list(nnd_pb2_grpc.NndStub(channel).Trace(request))


def _width(address: str, model: str) -> int:
    responses = _trace(address, _request(model, 1, tolist=False))
    return int(_results.collect(iter(responses), use_torch=True).saved[5].numel())


def test_a_million_floats_arrive_at_default_limits(tmp_path: pathlib.Path, tiny_models: dict[str, str]) -> None:
    d = start_daemon(tmp_path, in_process=True)
    try:
        model = tiny_models["gpt2"]
        nnd.TransformersModel(model, address=d.address, device="cpu", dispatch=True)
        repeat = -(-1_000_000 // _width(d.address, model))
        want = _results.collect(iter(_trace(d.address, _request(model, repeat, tolist=False))), use_torch=True)
        responses = _trace(d.address, _request(model, repeat, tolist=True))
        chunks = [r for r in responses if r.WhichOneof("kind") == "chunk"]
        assert len(chunks) >= 2  # ~9 MB of messages, in pieces under the default limit
        got = _results.collect(iter(responses), use_torch=True).saved[5]
        assert isinstance(got, list) and len(got) >= 1_000_000
        assert torch.equal(torch.tensor(got, dtype=torch.float32), want.saved[5])
    finally:
        d.stop()


def test_non_tensor_values_count_against_max_saved_bytes(
    small_limit_daemon: Daemon, tiny_models: dict[str, str]
) -> None:
    address, model = small_limit_daemon.address, tiny_models["gpt2"]
    width = _width(address, model)
    # As a tensor, a million float32 are 4 MB: under the limit. As a list, ~11 MB encoded: over it.
    repeat = -(-1_000_000 // width)
    assert (
        _results.collect(iter(_trace(address, _request(model, repeat, tolist=False))), use_torch=True).saved[5].numel()
    )
    with pytest.raises(grpc.RpcError) as err:
        _trace(address, _request(model, repeat, tolist=True))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"max_saved_bytes={LIMIT}" in err.value.details()
    # Half of that fits, and arrives in chunks.
    got = _results.collect(iter(_trace(address, _request(model, repeat // 2, tolist=True))), use_torch=True).saved[5]
    assert isinstance(got, list) and len(got) == width * (repeat // 2)


def test_a_long_list_of_small_tensors_arrives_at_default_limits(
    small_limit_daemon: Daemon, tiny_models: dict[str, str]
) -> None:
    """Many tensors under the inline limit in one value: more than 4 MiB together, so serialized in chunks."""
    address, model = small_limit_daemon.address, tiny_models["gpt2"]
    width = _width(address, model)
    repeat = -(-1_600_000 // width)  # 6.4 MB of float32 in all...
    request = _request(model, 1, tolist=False)
    g = request.graph
    n = g.nodes.add(id=6)
    n.op.name = "repeat"
    n.op.args.add().ref = 2
    n.op.args.add().value.int = repeat
    n = g.nodes.add(id=7)
    n.op.name = "split"  # ...as tensors of 4 KB, each inline
    n.op.args.add().ref = 6
    n.op.args.add().value.int = 1000
    g.nodes.add(id=8).save.value.ref = 7
    responses = _trace(address, request)
    saved = {r.saved.node: r.saved for r in responses if r.WhichOneof("kind") == "saved"}
    assert saved[8].value_blob and not saved[8].HasField("value")
    got = _results.collect(iter(responses), use_torch=True).saved
    assert len(got[8]) == -(-width * repeat // 1000)
    assert torch.equal(torch.cat(list(got[8])), got[5].repeat(repeat))
