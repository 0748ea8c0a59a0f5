"""A worker's gateway checks each later message of an Interact stream (limits, alias paths). The same
bytes at the same sync point of a repeated block are checked once; a change of the alias table makes
them mean what the new table says."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2
from nnd_daemon.worker.gateway import Gateway


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])


class _Context:
    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> None:
        return None

    def peer(self) -> str:
        return "test"


class _Service:
    """Hands the test the gateway's parser of later messages instead of running anything."""

    def __init__(self) -> None:
        self.model = _Model()
        self.activity = SimpleNamespace(begin=lambda *a, **k: None, end=lambda *a: None, refused=lambda *a: None)
        self.parse: Any = None

    def interact(self, run, start, messages, context, stop, on_error, caps=None, inflight=None, parse=None):
        self.parse = parse
        return iter(())


def _start() -> bytes:
    request = nnd_pb2.TraceRequest(model="m")
    request.invokes.add().text = "x"
    return nnd_pb2.InteractRequest(start=nnd_pb2.InteractStart(request=request, want=[1])).SerializeToString()


def _later(path: str) -> bytes:
    graph = graph_pb2.Graph()
    node = graph.nodes.add(id=5)
    node.module.path = path
    return nnd_pb2.InteractRequest(more=nnd_pb2.InteractContinue(graph=graph, finish=True)).SerializeToString()


def _aliases(target: str) -> worker_pb2.WorkerConfig:
    return worker_pb2.WorkerConfig(set_aliases=True, aliases=[worker_pb2.AliasBinding(host="", alias="mid", target=target)])


def test_a_repeated_continuation_is_checked_once_and_follows_a_new_alias_table():
    service = _Service()
    gateway = Gateway(service, "m", 0, nnd_pb2.Limits())
    gateway.configure(_aliases("layers.0"))

    def parse(raw: bytes) -> Any:
        list(gateway.interact(iter([_start()]), _Context()))  # a stream, as each block opens one
        return service.parse(raw)

    raw = _later("mid")
    first, again = parse(raw), parse(raw)
    assert first.more.graph.nodes[0].module.path == "layers.0"
    assert again is first  # checked once
    gateway.configure(_aliases("layers.1"))
    moved = parse(raw)
    assert moved.more.graph.nodes[0].module.path == "layers.1"
    other = parse(_later("layers.0"))
    assert other.more.graph.nodes[0].module.path == "layers.0"
