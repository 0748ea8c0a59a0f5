"""The public Nnd service: validate, route to the registry or a worker, and map
errors to statuses in one place (`_guard`)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from nnd import __version__
from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2
from nnd_daemon import errors
from nnd_daemon.control import gpus, requests, uploads
from nnd_daemon.control.registry import Registry
from nnd_daemon.control.settings import Settings

log = logging.getLogger("nnd.servicer")


def _guard(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn NndError into its status; anything else is INTERNAL, logged."""

    @functools.wraps(method)
    def unary(self: NndServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except errors.NndError as err:
            errors.abort(context, err)
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            errors.abort(context, errors.NndError(f"internal error: {type(exc).__name__}: {exc}"))

    @functools.wraps(method)
    def streaming(self: NndServicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except errors.NndError as err:
            errors.abort(context, err)
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            errors.abort(context, errors.NndError(f"internal error: {type(exc).__name__}: {exc}"))

    return streaming if inspect.isgeneratorfunction(method) else unary


class NndServicer:
    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry

    # -- server -------------------------------------------------------------
    @_guard
    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> nnd_pb2.ServerInfo:
        import torch
        import transformers

        from nnd_daemon.engine import ops

        info = nnd_pb2.ServerInfo(
            version=__version__,
            protocol="nnd.v1",
            ops=sorted(ops.OPS),
            attributes=sorted(ops.ATTRIBUTES),
            limits=self.settings.limits.to_proto(),
            devices=["cpu"] + [f"cuda:{i}" for i in range(gpus.count())],
        )
        info.libraries.update(
            {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
        )
        return info

    # -- models -------------------------------------------------------------
    @_guard
    def LoadModel(self, request: nnd_pb2.LoadModelRequest, context: grpc.ServicerContext) -> nnd_pb2.ModelInfo:
        uploads.before_load(self.settings, self.registry, request)  # LoadModel(upload=): allowed, named
        entry = self.registry.load(request)
        # nnsight's rename=: extra module names for this handle only (checked before anything runs).
        table = entry.meta.renamed(request.rename) if request.rename else None
        if request.dispatch:
            for _ in self.registry.dispatch(entry.name, None, request.keep_alive):
                pass
        info = self.registry.info(entry, modules=True)
        if table is not None:
            names = table.aliases_of()
            for module in info.modules:
                module.aliases[:] = sorted(names.get(module.path, ()))
        return info

    @_guard
    def GetModel(self, request: nnd_pb2.GetModelRequest, context: grpc.ServicerContext) -> nnd_pb2.ModelInfo:
        return self.registry.info(self.registry.get(request.model), modules=True)

    @_guard
    def ListModels(self, request: Any, context: grpc.ServicerContext) -> nnd_pb2.ListModelsResponse:
        return nnd_pb2.ListModelsResponse(models=[self.registry.info(e) for e in self.registry.entries()])

    @_guard
    def Dispatch(self, request: nnd_pb2.DispatchRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        entry = self.registry.get(request.model)
        override = request.placement if request.HasField("placement") else None
        yield from self.registry.dispatch(entry.name, override, request.keep_alive)
        yield nnd_pb2.DispatchProgress(stage="ready", message="dispatched", model=self.registry.info(entry))

    @_guard
    def Release(self, request: nnd_pb2.ReleaseRequest, context: grpc.ServicerContext) -> nnd_pb2.ModelInfo:
        return self.registry.info(self.registry.release(request.model))

    @_guard
    def Unload(self, request: nnd_pb2.UnloadRequest, context: grpc.ServicerContext) -> nnd_pb2.UnloadResponse:
        self.registry.unload(request.model)
        return nnd_pb2.UnloadResponse()

    # -- uploads (control/uploads.py) ---------------------------------------
    @_guard
    def Upload(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> nnd_pb2.UploadResponse:
        return uploads.upload(self.settings, request_iterator, context)

    @_guard
    def HasUpload(self, request: nnd_pb2.HasUploadRequest, context: grpc.ServicerContext) -> Any:
        return uploads.has_upload(self.settings, request)

    # -- tracing ------------------------------------------------------------
    @_guard
    def Scan(self, request: nnd_pb2.TraceRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        from nnd_daemon import engine

        requests.check(request, self.settings.limits, generate=False)
        meta = self.registry.get(request.model).meta
        _resolve_aliases(meta, [request.graph])
        edits = {i: list(stack.graphs) for i, stack in meta.edits.stacks(request.edits).items()}
        out: list[Any] = []
        with meta.lock:
            engine.run(
                meta.module,
                meta.tokenizer,
                request,
                mode="scan",
                emit=out.append,
                cancelled=lambda: not context.is_active(),
                limits=requests.engine_limits(self.settings.limits),
                edits=edits,
            )
        for message in out:
            yield message.SerializeToString()

    @_guard
    def Trace(self, request: nnd_pb2.TraceRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._run(request, context, generate=False)

    @_guard
    def Generate(self, request: nnd_pb2.TraceRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._run(request, context, generate=True)

    def _run(self, request: nnd_pb2.TraceRequest, context: grpc.ServicerContext, *, generate: bool) -> Iterator[bytes]:
        requests.check(request, self.settings.limits, generate=generate)
        meta = self.registry.get(request.model).meta
        _resolve_aliases(meta, [request.graph])
        run = worker_pb2.WorkerRunRequest(request=request, generate=generate, edits=meta.edits.stacks(request.edits))
        yield from self._on_worker(request.model, run, context, request.no_auto_dispatch, request.keep_alive)

    @_guard
    def Interact(self, messages: Iterator[Any], context: grpc.ServicerContext) -> Iterator[bytes]:
        """Check the first message, add the edits' graphs, then pass messages both ways unparsed by the worker."""
        first = next(messages, None)
        if first is None or getattr(first, "WhichOneof", lambda _: None)("kind") != "start":
            text = getattr(first, "text", "an Interact stream starts with an InteractStart")
            raise errors.InvalidArgument(text)
        start = first.start
        requests.check(start.request, self.settings.limits, generate=start.generate)
        meta = self.registry.get(start.request.model).meta
        _resolve_aliases(meta, [start.request.graph])
        run = worker_pb2.WorkerRunRequest(
            request=start.request, generate=start.generate, edits=meta.edits.stacks(start.request.edits)
        )

        def upstream() -> Iterator[worker_pb2.WorkerInteractRequest]:
            yield worker_pb2.WorkerInteractRequest(run=run, client=first)
            for msg in messages:
                if not isinstance(msg, nnd_pb2.InteractRequest):  # malformed bytes: end the run
                    return
                if msg.HasField("more"):
                    # Aliases (`model.layers` on any architecture) resolve here, as in a Trace.
                    _resolve_aliases(meta, [msg.more.graph])
                yield worker_pb2.WorkerInteractRequest(client=msg)

        request = start.request
        entry = self.registry.acquire(
            request.model, auto_dispatch=not request.no_auto_dispatch, keep_alive=request.keep_alive
        )
        try:
            worker = entry.worker
            if worker is None:
                raise errors.Unavailable(f"model {entry.name} lost its worker: {entry.last_error}")
            remaining = context.time_remaining()
            timeout = (
                remaining if remaining is not None and remaining < 1e8 else self.settings.limits.default_deadline_s
            )
            yield from worker.interact(upstream(), timeout=timeout or None, client=context)
        finally:
            self.registry.done(entry)

    def _on_worker(
        self,
        model: str,
        run: worker_pb2.WorkerRunRequest,
        context: grpc.ServicerContext,
        no_auto_dispatch: bool,
        keep_alive: str,
    ) -> Iterator[bytes]:
        entry = self.registry.acquire(model, auto_dispatch=not no_auto_dispatch, keep_alive=keep_alive)
        try:
            remaining = context.time_remaining()
            timeout = (
                remaining if remaining is not None and remaining < 1e8 else self.settings.limits.default_deadline_s
            )
            worker = entry.worker
            if worker is None:
                raise errors.Unavailable(f"model {entry.name} lost its worker: {entry.last_error}")
            # A client that goes away cancels the worker's call at once (not at its next response).
            try:
                yield from worker.run(run, timeout=timeout or None, client=context)
            except errors.NndError:
                if entry.gone:  # its worker was stopped under it: say why, not "Channel closed!"
                    raise errors.Unavailable(f"model {entry.name} was unloaded while this request ran") from None
                raise
        finally:
            self.registry.done(entry)
            if not context.is_active():  # an interrupted cell, a restarted kernel: say so in the daemon's log
                kind = "session" if run.HasField("session") else "generate" if run.generate else "trace"
                log.info("%s on %s cancelled: its client (%s) cancelled or went away", kind, entry.name, context.peer())

    # -- sessions -----------------------------------------------------------
    @_guard
    def Session(self, request: nnd_pb2.SessionRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        """Several traces in one request, run in order in the model's worker (or as scans here)."""
        from nnd_daemon import engine

        if not request.traces:
            raise errors.InvalidArgument("the session has no trace: add at least one")
        meta = self.registry.get(request.model).meta
        ids: list[str] = []
        for trace in request.traces:
            if not trace.request.model:
                trace.request.model = request.model
            requests.check(trace.request, self.settings.limits, generate=trace.generate and not request.scan)
            ids.extend(trace.request.edits)
        _resolve_aliases(meta, [t.request.graph for t in request.traces])
        stacks = meta.edits.stacks(ids)
        if request.scan:
            out: list[Any] = []
            with meta.lock:
                engine.run_session(
                    meta.module,
                    meta.tokenizer,
                    request,
                    emit=out.append,
                    cancelled=lambda: not context.is_active(),
                    limits=requests.engine_limits(self.settings.limits),
                    edits={i: list(stack.graphs) for i, stack in stacks.items()},
                )
            yield from out
            return
        run = worker_pb2.WorkerRunRequest(session=request, edits=stacks)
        for raw in self._on_worker(request.model, run, context, request.no_auto_dispatch, request.keep_alive):
            yield nnd_pb2.TraceResponse.FromString(raw)

    # -- edits --------------------------------------------------------------
    @_guard
    def CreateEdit(self, request: nnd_pb2.CreateEditRequest, context: grpc.ServicerContext) -> nnd_pb2.EditInfo:
        from nnd_daemon.engine import plan

        entry = self.registry.get(request.model)
        graph = graph_pb2.Graph()
        graph.CopyFrom(request.graph)
        _resolve_aliases(entry.meta, [graph])
        if self.settings.limits.max_request_bytes and graph.ByteSize() > self.settings.limits.max_request_bytes:
            raise errors.ResourceExhausted(
                f"the edit is {graph.ByteSize()} bytes, over the limit max_request_bytes="
                f"{self.settings.limits.max_request_bytes}"
            )
        requests.check_depth(graph, "the edit")
        plan.check_edit(graph, entry.meta.module)
        edit = entry.meta.edits.create(graph, name=request.name, base=request.base, replace=request.replace)
        return edit.info(entry.name)

    @_guard
    def ListEdits(self, request: nnd_pb2.ListEditsRequest, context: grpc.ServicerContext) -> Any:
        entry = self.registry.get(request.model)
        return nnd_pb2.ListEditsResponse(edits=[e.info(entry.name) for e in entry.meta.edits.all()])

    @_guard
    def DeleteEdit(self, request: nnd_pb2.DeleteEditRequest, context: grpc.ServicerContext) -> Any:
        self.registry.get(request.model).meta.edits.delete(request.id)
        return nnd_pb2.DeleteEditResponse()

    # -- tokens -------------------------------------------------------------
    def _tokenizer(self, model: str) -> Any:
        tok = self.registry.get(model).meta.tokenizer
        if tok is None:
            raise errors.FailedPrecondition(f"model {model} has no tokenizer; send token ids instead of text")
        return tok

    @_guard
    def Tokenize(self, request: nnd_pb2.TokenizeRequest, context: grpc.ServicerContext) -> nnd_pb2.TokenizeResponse:
        tok = self._tokenizer(request.model)
        out = nnd_pb2.TokenizeResponse()
        for text in request.texts:
            out.ids.add(ids=tok(text, add_special_tokens=not request.no_special_tokens)["input_ids"])
        return out

    @_guard
    def Decode(self, request: nnd_pb2.DecodeRequest, context: grpc.ServicerContext) -> nnd_pb2.DecodeResponse:
        tok = self._tokenizer(request.model)
        _check_token_ids(request.ids)
        texts = [tok.decode(list(ids.ids), skip_special_tokens=request.skip_special_tokens) for ids in request.ids]
        return nnd_pb2.DecodeResponse(texts=texts)

    @_guard
    def GetTokenizerFiles(self, request: nnd_pb2.GetModelRequest, context: grpc.ServicerContext) -> Any:
        tok = self._tokenizer(request.model)
        out = nnd_pb2.TokenizerFiles()
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name), "rb") as f:
                    out.files[name] = f.read()
        return out


def _check_token_ids(sequences: Any) -> None:
    # Tokenizers take unsigned 32-bit ids; a larger or negative one overflows inside them.
    for ids in sequences:
        for i in ids.ids:
            if not 0 <= i < 2**32:
                raise errors.InvalidArgument(f"token id {i} is out of range (ids are 0 .. 2**32-1)")


def _resolve_aliases(meta: Any, graphs: list[Any]) -> None:
    """Rewrite alias paths ("layers.0.attention") to real ones, so any client can use aliases."""
    from nnd_daemon.engine import aliases

    aliases.rewrite_graphs(graphs, meta.aliases)

