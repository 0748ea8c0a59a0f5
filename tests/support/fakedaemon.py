"""A minimal in-process Nnd servicer for client unit tests.

It serves a tiny GPT-2 module tree (built on the meta device), records every
TraceRequest it gets, and answers with whatever `reply` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from nnd.v1 import nnd_pb2, nnd_pb2_grpc, values_pb2


def gpt2_modules(n_layer: int = 3) -> list[nnd_pb2.ModuleInfo]:
    """ModuleInfo for a tiny GPT-2, as the daemon would describe it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    return module_infos(model)


def module_infos(model: object) -> list[nnd_pb2.ModuleInfo]:
    return [
        nnd_pb2.ModuleInfo(path=path, type=type(mod).__name__, extra=_extra(mod))
        for path, mod in model.named_modules()  # type: ignore[attr-defined]
    ]


def _extra(mod: object) -> str:
    """extra_repr(), or for a leaf that overrides __repr__ (transformers'
    Conv1D) what its repr puts between the parentheses."""
    import torch

    if type(mod).__repr__ is not torch.nn.Module.__repr__ and not list(mod.children()):  # type: ignore[attr-defined]
        text = repr(mod)
        name = type(mod).__name__ + "("
        if text.startswith(name) and text.endswith(")"):
            return text[len(name) : -1]
    return mod.extra_repr()  # type: ignore[attr-defined]


def meta(shape: Iterable[int], dtype: int = values_pb2.FLOAT32) -> values_pb2.Value:
    return values_pb2.Value(tensor=values_pb2.Tensor(dtype=dtype, shape=list(shape), meta=True))


Reply = Callable[[str, nnd_pb2.TraceRequest], Iterable[nnd_pb2.TraceResponse]]


def saves(request: nnd_pb2.TraceRequest) -> list[int]:
    return [n.id for n in request.graph.nodes if n.WhichOneof("kind") == "save"]


def default_reply(method: str, request: nnd_pb2.TraceRequest) -> Iterator[nnd_pb2.TraceResponse]:
    """Every save answers a [1, 4, 16] float32 tensor (meta for a scan)."""
    for node in saves(request):
        if method == "Scan":
            value = meta([1, 4, 16])
        else:
            value = values_pb2.Value(
                tensor=values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[1, 4, 16], data=bytes(4 * 64))
            )
        yield nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=node, value=value))
    yield nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=0.01))


@dataclass
class FakeNnd(nnd_pb2_grpc.NndServicer):
    modules: list[nnd_pb2.ModuleInfo]
    reply: Reply = default_reply
    requests: list[tuple[str, Any]] = field(default_factory=list)  # (method, request message)
    loads: list[nnd_pb2.LoadModelRequest] = field(default_factory=list)
    state: int = nnd_pb2.META
    cancelled: threading.Event = field(default_factory=threading.Event)

    def _info(self, name: str) -> nnd_pb2.ModelInfo:
        return nnd_pb2.ModelInfo(name=name, state=self.state, architecture="GPT2LMHeadModel", modules=self.modules)

    def LoadModel(self, request, context):  # noqa: N802
        self.loads.append(request)
        return self._info(request.model)

    def GetModel(self, request, context):  # noqa: N802
        return self._info(request.model)

    def Dispatch(self, request, context):  # noqa: N802
        yield nnd_pb2.DispatchProgress(stage="loading", done=1, total=2)
        self.state = nnd_pb2.DISPATCHED
        yield nnd_pb2.DispatchProgress(stage="ready", done=2, total=2, model=self._info(request.model))

    def Release(self, request, context):  # noqa: N802
        self.state = nnd_pb2.META
        return self._info(request.model)

    def _run(self, method: str, request, context):
        self.requests.append((method, request))
        context.add_callback(self.cancelled.set)
        try:
            yield from self.reply(method, request)
        except Abort as abort:
            context.set_trailing_metadata(abort.metadata)
            context.abort(abort.code, abort.message)

    def Trace(self, request, context):  # noqa: N802
        yield from self._run("Trace", request, context)

    def Scan(self, request, context):  # noqa: N802
        yield from self._run("Scan", request, context)

    def Generate(self, request, context):  # noqa: N802
        yield from self._run("Generate", request, context)

    def Session(self, request, context):  # noqa: N802
        """Each block answered as `reply` answers it alone, then one done for the session."""
        self.requests.append(("Session", request))
        for trace in request.traces:
            for response in self.reply("Generate" if trace.generate else "Trace", trace.request):
                if response.WhichOneof("kind") != "done":
                    yield response
        yield nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=0.01))

    def CreateEdit(self, request, context):  # noqa: N802
        self.requests.append(("CreateEdit", request))
        return nnd_pb2.EditInfo(id=f"edit-{len(self.requests)}", model=request.model)

    def Tokenize(self, request, context):  # noqa: N802
        return nnd_pb2.TokenizeResponse(ids=[nnd_pb2.TokenIds(ids=[ord(c) % 64 for c in t]) for t in request.texts])

    def Decode(self, request, context):  # noqa: N802
        return nnd_pb2.DecodeResponse(texts=["".join(chr(65 + i % 26) for i in r.ids) for r in request.ids])


class Abort(Exception):
    """Raise from a reply to end the call with a status (and the exception
    type the daemon names in trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, exc_type: str = "") -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.metadata = (("nnd-exception-type", exc_type),) if exc_type else ()


def serve(fake: FakeNnd, socket_path: str) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    nnd_pb2_grpc.add_NndServicer_to_server(fake, server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server
