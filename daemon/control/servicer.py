"""The public Nnd service: validate, and route to the registry, the helper or a
worker. Methods raise NndError; the server's errors.ErrorInterceptor makes it a status.

Trace, Generate and Session arrive here only from clients that do not follow
routes: their bytes go to the model's worker unparsed (forward.py), and the
worker checks them. Local clients send them to the worker directly (GetRoute).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import grpc

from nnd import __version__
from nnd.v1 import contract, graph_pb2, helper_pb2, nnd_pb2, worker_pb2
from nnd_daemon import aliases, errors, identity, intake
from nnd_daemon.control import forward, logread
from nnd_daemon.control.registry import Registry
from nnd_daemon.control.settings import Settings
from nnd_daemon.inflight import InflightBudget

log = logging.getLogger("nnd.servicer")


class NndServicer:
    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        # Peers whose data requests the daemon forwarded: logged once each (how tests and
        # operators see that a client does not follow routes).
        self._forwarded: set[tuple[str, str]] = set()
        self.inflight = InflightBudget(settings.limits.max_inflight_bytes)

    def _user(self, context: grpc.ServicerContext) -> str:
        """Who is calling (identity.py): their verified user name, or what the transport tells."""
        return identity.who(context, self.registry.tickets, token=self.registry.token_required)

    def _worker_metadata(self, entry: Any, worker: Any, context: grpc.ServicerContext) -> list[tuple[str, str]]:
        """What a forwarded request carries to the worker: the model, the epoch, and the caller's user as a
        ticket the worker can check (it trusts no name it cannot verify)."""
        metadata = [(contract.MODEL_KEY, entry.name), (contract.EPOCH_KEY, str(worker.epoch))]
        user = self._user(context)
        if user:
            metadata.append((identity.USER_KEY, self.registry.tickets.mint(user, ttl_s=3600)))
        return metadata

    # -- server -------------------------------------------------------------
    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> nnd_pb2.ServerInfo:
        # The engine's ops and the library versions come from the helper: this process never imports torch.
        caps = self.registry.helper.capabilities()
        info = nnd_pb2.ServerInfo(
            version=__version__,
            protocol="nnd.v1",
            ops=caps.ops,
            attributes=caps.attributes,
            limits=self.settings.limits.to_proto(),
            devices=["cpu"] + [f"cuda:{i}" for i in range(self.registry.gpus.count())],
        )
        info.libraries.update(caps.libraries)
        return info

    # -- models -------------------------------------------------------------
    def LoadModel(self, request: nnd_pb2.LoadModelRequest, context: grpc.ServicerContext) -> nnd_pb2.ModelInfo:
        self.registry.uploads.before_load(self.registry.upload_of, request)  # LoadModel(upload=): allowed, named
        entry = self.registry.load(request, user=self._user(context))
        # nnsight's rename=: extra module names for this handle only (checked before anything runs).
        table = entry.meta.renamed(request.rename) if request.rename else None
        if request.dispatch:
            for _ in self.registry.dispatch(entry.name, None, request.keep_alive, user=self._user(context)):
                pass
        info = self.registry.info(entry, modules=True)
        if table is not None:
            names = table.aliases_of()
            for module in info.modules:
                module.aliases[:] = sorted(names.get(module.path, ()))
        return info

    def GetModel(self, request: nnd_pb2.GetModelRequest, context: grpc.ServicerContext) -> nnd_pb2.ModelInfo:
        return self.registry.info(self.registry.get(request.model), modules=True)

    def GetRoute(self, request: nnd_pb2.RouteRequest, context: grpc.ServicerContext) -> nnd_pb2.Route:
        return self.registry.route(request.model, request.failed_epoch)

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> nnd_pb2.ListModelsResponse:
        return nnd_pb2.ListModelsResponse(models=[self.registry.info(e) for e in self.registry.entries()])

    def Dispatch(self, request: nnd_pb2.DispatchRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        entry = self.registry.get(request.model)
        override = request.placement if request.HasField("placement") else None
        yield from self.registry.dispatch(entry.name, override, request.keep_alive, user=self._user(context))
        yield nnd_pb2.DispatchProgress(stage="ready", message="dispatched", model=self.registry.info(entry))

    def Release(self, request: nnd_pb2.ReleaseRequest, context: grpc.ServicerContext) -> nnd_pb2.ModelInfo:
        entry = self.registry.release(request.model, user=self._user(context), force=request.force)
        return self.registry.info(entry)

    def Unload(self, request: nnd_pb2.UnloadRequest, context: grpc.ServicerContext) -> nnd_pb2.UnloadResponse:
        self.registry.unload(request.model, user=self._user(context), force=request.force)
        return nnd_pb2.UnloadResponse()

    def ReadLogs(self, request: nnd_pb2.ReadLogsRequest, context: grpc.ServicerContext) -> Any:
        return logread.read(self.registry.log_path(request.model), request.offset, request.max_bytes)

    # -- uploads (control/uploads.py) ---------------------------------------
    def Upload(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> nnd_pb2.UploadResponse:
        return self.registry.uploads.upload(request_iterator, context)

    def HasUpload(self, request: nnd_pb2.HasUploadRequest, context: grpc.ServicerContext) -> Any:
        return self.registry.uploads.has_upload(request)

    # -- tracing ------------------------------------------------------------
    def Scan(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._scan(raw, context, session=False)

    def _scan(self, raw: bytes, context: grpc.ServicerContext, *, session: bool) -> Iterator[bytes]:
        """A Scan (or scan Session), run in the helper process. The daemon reads only the
        model and the edit ids off the wire: parsing and checking a request (millions of
        nodes, hundreds of MB) is the helper's work, never this process's."""
        steer = forward.peek(raw, session=session)
        if not steer.model:
            raise errors.InvalidArgument("the request names no model")
        entry = self.registry.get(steer.model)
        stacks = entry.meta.edits.stacks(forward.edit_ids(raw, session), self.settings.limits.max_request_bytes)
        what = "this scan" if session else "this Scan"
        with self.inflight.hold(len(raw), what):
            scan = helper_pb2.HelperScanRequest(
                model=entry.meta.ref,
                request=raw,
                session=session,
                edits=stacks,
                aliases=self.registry.alias_config(entry).aliases,
                limits=self.settings.limits.to_proto(),
            )
            out = self.registry.helper.call("Scan", scan, what=what, timeout=self._deadline(context), client=context)
        for message in out.responses:
            yield message.SerializeToString()

    def _deadline(self, context: grpc.ServicerContext) -> float | None:
        """The call's own deadline, else the daemon's default (None: none)."""
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None and remaining < 1e8 else self.settings.limits.default_deadline_s
        return timeout or None

    def _forward_deadline(self, context: grpc.ServicerContext) -> tuple[float | None, list[tuple[str, str]]]:
        """The timeout of a call forwarded to a worker, and metadata for it: the client's own deadline, else
        the daemon's default, which the worker applies itself (contract.DEFAULT_DEADLINE_KEY)."""
        remaining = context.time_remaining()
        if remaining is not None and remaining < 1e8:
            return remaining, []
        default = self.settings.limits.default_deadline_s
        if not default:
            return None, []
        return default + contract.FORWARD_GRACE_S, [(contract.DEFAULT_DEADLINE_KEY, "1")]

    def Trace(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._forward("Trace", raw, context)

    def Generate(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from self._forward("Generate", raw, context)

    def Session(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        """Several traces in one request: run in order in the model's worker, or as scans here."""
        steer = forward.peek(raw, session=True)
        if steer.scan:
            yield from self._scan(raw, context, session=True)
            return
        yield from self._forward("Session", raw, context, steer)

    def Interact(self, raws: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """For clients that do not follow routes: read the model off the first message, then pass
        every message to the model's worker as bytes, and its answers back (worker/gateway.py
        parses, checks and completes them, as for a forwarded Trace)."""
        raw = next(raws, None)
        first = intake.parse(nnd_pb2.InteractRequest, raw or b"")
        if first.WhichOneof("kind") != "start":
            raise errors.InvalidArgument("an Interact stream starts with an InteractStart")
        start = first.start
        request = start.session if start.HasField("session") else start.request
        if not request.model:
            raise errors.InvalidArgument("the request names no model")
        entry = self.registry.acquire(
            request.model,
            auto_dispatch=not request.no_auto_dispatch,
            keep_alive=request.keep_alive,
            user=self._user(context),
        )
        try:
            worker = entry.worker
            if worker is None:
                raise errors.Unavailable(f"model {entry.name} lost its worker: {entry.last_error}")
            timeout, deadline = self._forward_deadline(context)
            metadata = [*self._worker_metadata(entry, worker, context), *deadline]
            yield from worker.interact(itertools.chain([raw], raws), timeout=timeout, client=context, metadata=metadata)
        finally:
            self.registry.done(entry)

    def _forward(
        self, method: str, raw: bytes, context: grpc.ServicerContext, steer: forward.Steering | None = None
    ) -> Iterator[bytes]:
        """Pass a data request's bytes to the model's worker (dispatching it first unless told not to)."""
        steer = steer or forward.peek(raw, session=False)
        if not steer.model:
            raise errors.InvalidArgument("the request names no model")
        entry = self.registry.acquire(
            steer.model, auto_dispatch=not steer.no_auto_dispatch, keep_alive=steer.keep_alive, user=self._user(context)
        )
        try:
            worker = entry.worker
            if worker is None:
                raise errors.Unavailable(f"model {entry.name} lost its worker: {entry.last_error}")
            peer = (entry.name, context.peer())
            if peer not in self._forwarded:
                if len(self._forwarded) >= 4096:  # TCP peers differ by port: keep the set bounded
                    self._forwarded.clear()
                self._forwarded.add(peer)
                log.info("forwarding %s of %s for %s, a client that does not follow routes", method, *peer)
            timeout, deadline = self._forward_deadline(context)
            metadata = [*self._worker_metadata(entry, worker, context), *deadline]
            # A client that goes away cancels the worker's call at once (not at its next response).
            try:
                with self.inflight.hold(len(raw), "the request"):
                    call = worker.forward(method, raw, timeout=timeout, client=context, metadata=metadata)
                    yield from self.inflight.passing(call, "a result")
            except errors.NndError:
                if entry.lost_epoch == worker.epoch and entry.lost_reason.startswith("was released"):
                    # Another user released (or unloaded) it under this request: say who and when.
                    raise errors.Unavailable(
                        f"the worker of {entry.name} {entry.lost_reason} while this request ran"
                    ) from None
                if entry.gone:  # its worker was stopped under it: say why, not "Channel closed!"
                    raise errors.Unavailable(f"model {entry.name} was unloaded while this request ran") from None
                raise
        finally:
            self.registry.done(entry)
            if not context.is_active():  # an interrupted cell, a restarted kernel: say so in the daemon's log
                log.info("%s on %s cancelled: its client (%s) cancelled or went away", method, entry.name, context.peer())

    # -- edits --------------------------------------------------------------
    def CreateEdit(self, request: nnd_pb2.CreateEditRequest, context: grpc.ServicerContext) -> nnd_pb2.EditInfo:
        entry = self.registry.get(request.model)
        intake.check_nodes(request.graph, "the edit")
        graph = graph_pb2.Graph()
        graph.CopyFrom(request.graph)
        _resolve_aliases(entry.meta, [graph])
        intake.check_part(graph, graph.ByteSize(), self.settings.limits, "the edit")
        check = helper_pb2.HelperEditRequest(model=entry.meta.ref, graph=graph)
        self.registry.helper.call("CheckEdit", check, what="this edit's check", client=context)
        edit = entry.meta.edits.create(
            graph,
            name=request.name,
            base=request.base,
            replace=request.replace,
            max_bytes=self.settings.limits.max_request_bytes,
            user=self._user(context),
        )
        change = worker_pb2.WorkerConfig()
        change.edits[edit.id].CopyFrom(edit.stack())
        self.registry.configure(entry, change)  # before the client can name it in a request to the worker
        return edit.info(entry.name)

    def ListEdits(self, request: nnd_pb2.ListEditsRequest, context: grpc.ServicerContext) -> Any:
        entry = self.registry.get(request.model)
        return nnd_pb2.ListEditsResponse(edits=[e.info(entry.name) for e in entry.meta.edits.all()])

    def DeleteEdit(self, request: nnd_pb2.DeleteEditRequest, context: grpc.ServicerContext) -> Any:
        entry = self.registry.get(request.model)
        entry.meta.edits.delete(request.id)
        self.registry.configure(entry, worker_pb2.WorkerConfig(deleted_edits=[request.id]))
        return nnd_pb2.DeleteEditResponse()

    # -- tokens -------------------------------------------------------------
    def _tokens(self, model: str) -> helper_pb2.HelperModel:
        meta = self.registry.get(model).meta
        if not meta.has_tokenizer:
            raise errors.FailedPrecondition(f"model {model} has no tokenizer; send token ids instead of text")
        return meta.ref

    def Tokenize(self, request: nnd_pb2.TokenizeRequest, context: grpc.ServicerContext) -> nnd_pb2.TokenizeResponse:
        ref = self._tokens(request.model)
        size, limit = sum(len(t.encode("utf-8")) for t in request.texts), self.settings.limits.max_tokenize_bytes
        if limit and size > limit:
            raise errors.ResourceExhausted(
                f"the texts are {size} bytes, over the daemon's limit max_tokenize_bytes={limit}; send less text "
                "per request"
            )
        call = helper_pb2.HelperTokenizeRequest(model=ref, request=request)
        return self.registry.helper.call("Tokenize", call, what="this Tokenize", client=context)

    def Decode(self, request: nnd_pb2.DecodeRequest, context: grpc.ServicerContext) -> nnd_pb2.DecodeResponse:
        _check_token_ids(request.ids)
        call = helper_pb2.HelperDecodeRequest(model=self._tokens(request.model), request=request)
        return self.registry.helper.call("Decode", call, what="this Decode", client=context)

    def GetTokenizerFiles(self, request: nnd_pb2.GetModelRequest, context: grpc.ServicerContext) -> Any:
        ref = self._tokens(request.model)
        return self.registry.helper.call("GetTokenizerFiles", ref, what="GetTokenizerFiles", client=context)

    # -- operations inside a forward (engine/source.py) ---------------------
    def GetSource(self, request: nnd_pb2.GetSourceRequest, context: grpc.ServicerContext) -> Any:
        meta = self.registry.get(request.model).meta
        path = request.path
        if path and meta.aliases is not None:
            path = meta.aliases.resolve(path) or path
        call = helper_pb2.HelperSourceRequest(model=meta.ref, path=path)
        return self.registry.helper.call("GetSource", call, what="this GetSource", client=context)


def _resolve_aliases(meta: Any, graphs: list[Any]) -> None:
    """Rewrite alias paths ("layers.0.attention") to real ones, so any client can use aliases."""
    aliases.rewrite_graphs(graphs, meta.aliases)


def _check_token_ids(sequences: Any) -> None:
    # Tokenizers take unsigned 32-bit ids; a larger or negative one overflows inside them.
    for ids in sequences:
        for i in ids.ids:
            if not 0 <= i < 2**32:
                raise errors.InvalidArgument(f"token id {i} is out of range (ids are 0 .. 2**32-1)")

