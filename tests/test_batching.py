"""Cross-client batching (daemon/worker/batching.py) against a real daemon.

Concurrent compatible Traces are merged into one forward. Batching changes the
matmul's batch size, and float32 kernels may then block the work differently:
results equal the same requests run one at a time up to ATOL/RTOL below
(measured: at most 3e-7 on the tiny GPT-2), not bit for bit.

That merging happened is read from the worker's log in the daemon's state
dir (`logs/`): the batcher logs "batched N requests ... in one forward".
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from daemonproc import Daemon, start_daemon

from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
from nnd_daemon.engine import wire

ATOL = 1e-5
RTOL = 1e-5
# Long enough that threads started together always land in one gathering window.
WINDOW_MS = "400"
PROMPTS = ["hello world", "hello wordl", "hello worle", "hello worla"]  # one tokenized length


@pytest.fixture(scope="module")
def batching_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("batching"), "--batch-window-ms", WINDOW_MS)
    stub = nnd_pb2_grpc.NndStub(grpc.insecure_channel(d.address))
    stub.LoadModel(nnd_pb2.LoadModelRequest(model=tiny_models["gpt2"], dispatch=True), timeout=120)
    yield d
    d.stop()


def _stub(d: Daemon) -> Any:
    return nnd_pb2_grpc.NndStub(grpc.insecure_channel(d.address))


def _request(model: str, text: str, *, extra: Callable[[graph_pb2.Graph], None] | None = None) -> Any:
    """Save h[0]'s output, its sum, and a 100x expanded copy (chunked: blob ids are renumbered)."""
    g = graph_pb2.Graph()
    n = g.nodes.add(id=3)
    n.module.path, n.module.point, n.module.invoke = "transformer.h.0", graph_pb2.OUTPUT, 0
    g.nodes.add(id=5).save.value.ref = 3
    n = g.nodes.add(id=7)
    n.op.name = "sum"
    n.op.args.add().ref = 3
    g.nodes.add(id=9).save.value.ref = 7
    n = g.nodes.add(id=11)
    n.op.name = "expand"
    n.op.args.add().ref = 3
    for size in (100, -1, -1):
        n.op.args.add().value.int = size
    n = g.nodes.add(id=12)
    n.op.name = "contiguous"
    n.op.args.add().ref = 11
    g.nodes.add(id=13).save.value.ref = 12
    if extra is not None:
        extra(g)
    request = nnd_pb2.TraceRequest(model=model, graph=g)
    request.invokes.add(text=text)
    return request


def _run(d: Daemon, request: Any) -> dict[int, Any] | grpc.RpcError:
    try:
        return wire.collect(_stub(d).Trace(request, timeout=120))
    except grpc.RpcError as err:
        return err


def _concurrently(d: Daemon, requests: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def one(i: int) -> None:
        stub = _stub(d)
        barrier.wait()
        try:
            out[i] = wire.collect(stub.Trace(requests[i], timeout=120))
        except grpc.RpcError as err:
            out[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _batched_counts(d: Daemon) -> list[int]:
    text = "".join(
        pathlib.Path(p).read_text(errors="replace") for p in glob.glob(os.path.join(d.state_dir, "logs", "*"))
    )
    return [int(m) for m in re.findall(r"batched (\d+) requests", text)]


def _same(a: dict[int, Any], b: dict[int, Any]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=RTOL)


def test_concurrent_traces_are_merged_and_match_alone(batching_daemon: Daemon, tiny_models: dict[str, str]) -> None:
    requests = [_request(tiny_models["gpt2"], p) for p in PROMPTS]
    alone = [_run(batching_daemon, r) for r in requests]
    before = sum(_batched_counts(batching_daemon))
    together = _concurrently(batching_daemon, requests)
    for a, t in zip(alone, together, strict=True):
        assert isinstance(a, dict) and isinstance(t, dict), (a, t)
        _same(a, t)
        assert t[13].shape == (100, len(t[5][0]), 64)
    assert sum(_batched_counts(batching_daemon)) - before >= 2, "no request was merged with another"


def test_a_failing_request_fails_alone(batching_daemon: Daemon, tiny_models: dict[str, str]) -> None:
    def bad(g: graph_pb2.Graph) -> None:  # a shape error at run time: (1, n, 64) + (3,)
        n = g.nodes.add(id=20)
        n.op.name = "add"
        n.op.args.add().ref = 3
        n.op.args.add().value.tensor.CopyFrom(wire.Encoder().tensor(torch.ones(3)))
        g.nodes.add(id=21).save.value.ref = 20

    model = tiny_models["gpt2"]
    requests = [_request(model, PROMPTS[0]), _request(model, PROMPTS[1], extra=bad), _request(model, PROMPTS[2])]
    alone = [_run(batching_daemon, r) for r in requests]
    assert isinstance(alone[1], grpc.RpcError)
    together = _concurrently(batching_daemon, requests)
    assert isinstance(together[1], grpc.RpcError)
    assert together[1].code() == alone[1].code()
    assert together[1].details() == alone[1].details()
    for i in (0, 2):
        assert isinstance(together[i], dict), together[i]
        _same(alone[i], together[i])


def test_requests_that_do_not_qualify_still_run_concurrently(
    batching_daemon: Daemon, tiny_models: dict[str, str]
) -> None:
    model = tiny_models["gpt2"]

    def whole_batch(g: graph_pb2.Graph) -> None:  # a RESULT read: the whole batch's output
        n = g.nodes.add(id=30)
        n.module.path, n.module.point = "", graph_pb2.RESULT
        g.nodes.add(id=31).save.value.ref = 30

    def stop(g: graph_pb2.Graph) -> None:
        g.nodes.add(id=40).stop.SetInParent()

    requests = [
        _request(model, PROMPTS[0]),
        _request(model, PROMPTS[1], extra=whole_batch),
        _request(model, PROMPTS[2], extra=stop),
        _request(model, "a much longer prompt than the others"),  # another length
        _request(model, PROMPTS[3]),
    ]
    alone = [_run(batching_daemon, r) for r in requests]
    together = _concurrently(batching_daemon, requests)
    for a, t in zip(alone, together, strict=True):
        assert isinstance(a, dict) and isinstance(t, dict), (a, t)
        assert sorted(a) == sorted(t)
        for k in (5, 9, 13):
            torch.testing.assert_close(a[k], t[k], atol=ATOL, rtol=RTOL)
    # The RESULT read came back whole (alone: its own row only).
    assert together[1][31]["logits"].shape[0] == 1


def test_zero_window_turns_batching_off(tmp_path: pathlib.Path, tiny_models: dict[str, str]) -> None:
    d = start_daemon(tmp_path, "--batch-window-ms", "0")
    try:
        stub = _stub(d)
        stub.LoadModel(nnd_pb2.LoadModelRequest(model=tiny_models["gpt2"], dispatch=True), timeout=120)
        together = _concurrently(d, [_request(tiny_models["gpt2"], p) for p in PROMPTS])
        assert all(isinstance(t, dict) for t in together)
        assert _batched_counts(d) == []
    finally:
        d.stop()
