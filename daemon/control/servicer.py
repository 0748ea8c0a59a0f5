"""The public Nnd service: validate, route to the registry or a worker, and map
errors to statuses in one place (`_guard`).

Trace, Generate and Session arrive here only from clients that do not follow
routes: their bytes go to the model's worker unparsed (forward.py), and the
worker checks them. Local clients send them to the worker directly (GetRoute).
"""

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
from nnd_daemon import errors, requests, shared
from nnd_daemon.control import forward, uploads
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
        # Peers whose data requests the daemon forwarded: logged once each (how tests and
        # operators see that a client does not follow routes).
        self._forwarded: set[tuple[str, str]] = set()

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
            devices=["cpu"] + [f"cuda:{i}" for i in range(_gpu_count())],
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
        if request.rename:  # nnsight's rename=: extra module names, for every client of the model
            entry.meta.rename(request.rename)
            self.registry.configure(entry, self.registry.alias_config(entry))
        if request.dispatch:
            for _ in self.registry.dispatch(entry.name, None, request.keep_alive):
                pass
        return self.registry.info(entry, modules=True)

    @_guard
    def GetModel(self, request: nnd_pb2.GetModelRequest, context: grpc.ServicerContext) -> nnd_pb2.ModelInfo:
        return self.registry.info(self.registry.get(request.model), modules=True)

    @_guard
    def GetRoute(self, request: nnd_pb2.RouteRequest, context: grpc.ServicerContext) -> nnd_pb2.Route:
        return self.registry.route(request.model, request.failed_epoch)

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
    def Trace(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._forward("Trace", raw, context)

    @_guard
    def Generate(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._forward("Generate", raw, context)

    @_guard
    def Session(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        """Several traces in one request: run in order in the model's worker, or as scans here."""
        steer = forward.peek(raw, session=True)
        if steer.scan:
            yield from self._scan_session(raw, context)
            return
        yield from self._forward("Session", raw, context, steer)

    def _forward(
        self, method: str, raw: bytes, context: grpc.ServicerContext, steer: forward.Steering | None = None
    ) -> Iterator[bytes]:
        """Pass a data request's bytes to the model's worker (dispatching it first unless told not to)."""
        steer = steer or forward.peek(raw, session=False)
        if not steer.model:
            raise errors.InvalidArgument("the request names no model")
        entry = self.registry.acquire(
            steer.model, auto_dispatch=not steer.no_auto_dispatch, keep_alive=steer.keep_alive
        )
        try:
            remaining = context.time_remaining()
            timeout = (
                remaining if remaining is not None and remaining < 1e8 else self.settings.limits.default_deadline_s
            )
            worker = entry.worker
            if worker is None:
                raise errors.Unavailable(f"model {entry.name} lost its worker: {entry.last_error}")
            peer = (entry.name, context.peer())
            if peer not in self._forwarded:
                if len(self._forwarded) >= 4096:  # TCP peers differ by port: keep the set bounded
                    self._forwarded.clear()
                self._forwarded.add(peer)
                log.info("forwarding %s of %s for %s, a client that does not follow routes", method, *peer)
            metadata = [(shared.MODEL_KEY, entry.name), (shared.EPOCH_KEY, str(worker.epoch))]
            # A client that goes away cancels the worker's call at once (not at its next response).
            yield from worker.forward(method, raw, timeout=timeout or None, client=context, metadata=metadata)
        finally:
            self.registry.done(entry)

    def _scan_session(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        from nnd_daemon import engine

        try:
            request = nnd_pb2.SessionRequest.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - a client's garbage is its own error
            raise errors.InvalidArgument(
                f"the request is not a valid nnd.v1.SessionRequest message ({exc}); nothing ran"
            ) from None
        if not request.traces:
            raise errors.InvalidArgument("the session has no trace: add at least one")
        meta = self.registry.get(request.model).meta
        ids: list[str] = []
        for trace in request.traces:
            if not trace.request.model:
                trace.request.model = request.model
            requests.check(trace.request, self.settings.limits, generate=False)
            ids.extend(trace.request.edits)
        _resolve_aliases(meta, [t.request.graph for t in request.traces])
        stacks = meta.edits.stacks(ids)
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
        change = worker_pb2.WorkerConfig()
        change.edits[edit.id].graphs.extend(edit.graphs)
        self.registry.configure(entry, change)  # before the client can name it in a request to the worker
        return edit.info(entry.name)

    @_guard
    def ListEdits(self, request: nnd_pb2.ListEditsRequest, context: grpc.ServicerContext) -> Any:
        entry = self.registry.get(request.model)
        return nnd_pb2.ListEditsResponse(edits=[e.info(entry.name) for e in entry.meta.edits.all()])

    @_guard
    def DeleteEdit(self, request: nnd_pb2.DeleteEditRequest, context: grpc.ServicerContext) -> Any:
        entry = self.registry.get(request.model)
        entry.meta.edits.delete(request.id)
        self.registry.configure(entry, worker_pb2.WorkerConfig(deleted_edits=[request.id]))
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


def _resolve_aliases(meta: Any, graphs: list[Any]) -> None:
    """Rewrite alias paths ("layers.0.attention") to real ones, so any client can use aliases."""
    from nnd_daemon.engine import aliases

    aliases.rewrite_graphs(graphs, meta.aliases)


def _gpu_count() -> int:
    return (
        len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
        if os.path.isdir("/dev")
        else 0
    )
