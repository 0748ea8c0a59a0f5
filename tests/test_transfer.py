"""Big results streamed in chunks (no shm) against a real daemon: the bytes are the tensor plain PyTorch computes.

Each graph saves a layer output `h` small enough to come inline, and big
tensors made from it (several 4 MiB chunks each, in float32, bfloat16, bool,
and from a non-contiguous view); the expected big values are computed here,
with plain torch, from the inline `h`. Big results are reassembled in memory
the client recycles (nnd/_results.py), so the tests also check that a result
still alive is never overwritten by a later one, and that recycled memory
holds exactly the new result.
"""

from __future__ import annotations

import gc

import pytest
import torch
from daemonproc import Daemon

import nnd
from nnd.v1 import graph_pb2, nnd_pb2
from nnd.wire import _results

COPIES = 24_000  # h is [1, T, 64]: 24000 copies of it are several 4 MiB chunks in float32


class _Graph:
    def __init__(self) -> None:
        self.g = graph_pb2.Graph()
        self.next = 1

    def node(self) -> graph_pb2.Node:
        n = self.g.nodes.add(id=self.next)
        self.next += 1
        return n

    def op(self, name: str, ref: int, *ints: int) -> int:
        n = self.node()
        n.op.name = name
        n.op.args.add().ref = ref
        for i in ints:
            n.op.args.add().value.int = i
        return n.id

    def save(self, ref: int) -> int:
        n = self.node()
        n.save.value.ref = ref
        return n.id


def _trace(d: Daemon, model: str, text: str) -> dict[str, torch.Tensor]:
    g = _Graph()
    n = g.node()
    n.module.path, n.module.point, n.module.invoke = "transformer.h.0", graph_pb2.OUTPUT, 0
    h = n.id
    big = g.op("expand", h, COPIES, -1, -1)
    saves = {
        "h": g.save(h),
        "f32": g.save(g.op("contiguous", big)),
        "bf16": g.save(g.op("contiguous", g.op("bfloat16", big))),
        "bool": g.save(g.op("contiguous", g.op("gt", big, 0))),
        "transposed": g.save(g.op("contiguous", g.op("transpose", big, 0, 2))),
    }
    request = nnd_pb2.TraceRequest(model=model, graph=g.g)
    request.invokes.add(text=text)
    saved = _results.collect(nnd.connect(d.address).stream("Trace", request), use_torch=True).saved
    return {k: saved[v] for k, v in saves.items()}


def _expected(h: torch.Tensor) -> dict[str, torch.Tensor]:
    big = h.expand(COPIES, -1, -1)
    return {
        "h": h,
        "f32": big.contiguous(),
        "bf16": big.bfloat16().contiguous(),
        "bool": (big > 0).contiguous(),
        "transposed": big.transpose(0, 2).contiguous(),
    }


def _check(got: dict[str, torch.Tensor]) -> None:
    want = _expected(got["h"])
    assert got["f32"].nbytes > 3 * 4 * 2**20  # really streamed in several chunks
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(got[k], w), k


@pytest.fixture(scope="module")
def gpt2(daemon: Daemon, tiny_models: dict[str, str]) -> str:
    nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    return tiny_models["gpt2"]


def test_streamed_results_are_the_tensors_torch_computes(daemon: Daemon, gpt2: str) -> None:
    _check(_trace(daemon, gpt2, "hello world"))


def test_recycled_memory_never_overwrites_a_live_result(daemon: Daemon, gpt2: str) -> None:
    first = _trace(daemon, gpt2, "hello world")
    second = _trace(daemon, gpt2, "world hello")  # first still alive: it must get memory of its own
    assert not torch.equal(first["f32"], second["f32"])
    _check(first)
    _check(second)
    first["f32"][0, 0, 0] = 42.0  # writable, and only first's
    assert second["f32"][0, 0, 0] != 42.0
    del first, second
    gc.collect()
    for text in ("hello world", "world hello", "hello world"):  # now in recycled memory
        _check(_trace(daemon, gpt2, text))


def test_big_results_of_traces_are_each_their_own(daemon: Daemon, gpt2: str) -> None:
    """A trace's big results come as one TraceOnce message on the worker's fast socket, sent as views
    of the saved tensors (onemessage.Gathered) and received into recycled memory (wire/_warm.py,
    _fast._fresh): a result kept alive keeps its values while later ones arrive in that memory."""
    model = nnd.TransformersModel(gpt2, address=daemon.address)
    router = model._conn.router

    def trace(text: str) -> dict[str, torch.Tensor]:
        before = (router.fast_calls, router.once_calls)
        with model.trace(text):
            h = model.transformer.h[0].output.save()
            f32 = model.transformer.h[0].output.expand(COPIES, -1, -1).contiguous().save()
            transposed = model.transformer.h[0].output.expand(COPIES, -1, -1).transpose(0, 2).contiguous().save()
            expanded = model.transformer.h[0].output.expand(COPIES, -1, -1).transpose(0, 1).save()  # strided: gathered as sent
        assert (router.fast_calls, router.once_calls) == (before[0] + 1, before[1] + 1)  # one framed TraceOnce
        return {"h": h, "f32": f32, "transposed": transposed, "expanded": expanded}

    def check(got: dict[str, torch.Tensor]) -> None:
        big = got["h"].expand(COPIES, -1, -1)
        assert got["f32"].nbytes > 3 * 4 * 2**20
        assert torch.equal(got["f32"], big.contiguous()) and torch.equal(got["transposed"], big.transpose(0, 2).contiguous())
        assert torch.equal(got["expanded"], big.transpose(0, 1))

    first = trace("hello world")
    second = trace("world hello")  # while first lives
    check(first)
    check(second)
    assert not torch.equal(first["f32"], second["f32"])
    del first, second
    gc.collect()
    for text in ("hello world", "world hello", "hello world"):  # now in the memory the first two left
        check(trace(text))
