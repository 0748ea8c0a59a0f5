"""The Helper service: META models (an LRU cache, rebuilt on demand from the
request after a restart) and the work on them whose cost a client shapes."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from typing import Any

import grpc
import psutil

from nnd.v1 import helper_pb2, helper_pb2_grpc, nnd_pb2
from nnd_daemon import errors
from nnd_daemon.helper import checks, meta

log = logging.getLogger("nnd.helper")

# The exception type a helper at its address-space limit reports, for the daemon's message.
MEMORY_EXC = "MemoryError"


def memory_error(exc: BaseException) -> errors.NndError | None:
    """A MemoryError (the helper's address-space limit) as RESOURCE_EXHAUSTED, for errors.ErrorInterceptor."""
    return errors.ResourceExhausted("out of memory", exc_type=MEMORY_EXC) if isinstance(exc, MemoryError) else None


class HelperService(helper_pb2_grpc.HelperServicer):
    def __init__(self, cache_size: int = 8) -> None:
        self._cache: OrderedDict[bytes, meta.Built] = OrderedDict()
        self._cache_size = max(1, cache_size)
        self._lock = threading.Lock()

    def _model(self, ref: helper_pb2.HelperModel) -> meta.Built:
        # Keyed by the whole reference: a model unloaded and loaded again from elsewhere is rebuilt.
        key = ref.SerializeToString(deterministic=True)
        with self._lock:
            built = self._cache.get(key)
            if built is not None:
                self._cache.move_to_end(key)
                return built
        built = meta.build(ref)
        with self._lock:
            self._cache[key] = built
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return built

    def _tokenizer(self, ref: helper_pb2.HelperModel) -> Any:
        tok = self._model(ref).tokenizer
        if tok is None:
            raise errors.FailedPrecondition(f"model {ref.key} has no tokenizer; send token ids instead of text")
        return tok

    def Describe(self, request: helper_pb2.HelperModel, context: grpc.ServicerContext) -> Any:
        return meta.describe(self._model(request))

    def Scan(self, request: helper_pb2.HelperScanRequest, context: grpc.ServicerContext) -> Any:
        from nnd_daemon import aliases, engine, intake

        built = self._model(request.model)
        limits = request.limits
        table = aliases.AliasTable.of(built.module, standard=False)
        for b in request.aliases:
            table.hosts.setdefault(b.host, {})[b.alias] = b.target

        def stacks(ids: list[str]) -> dict[str, Any]:
            missing = [i for i in ids if i not in request.edits]
            if missing:  # the daemon attached every id it read; a mismatch is its bug, not the client's
                raise errors.NndError(f"internal error: edit {missing[0]!r} was not attached to the scan")
            return dict(request.edits)

        run = intake.prepare(
            "Session" if request.session else "Scan",
            request.request,
            limits,
            rewrite=lambda graphs: aliases.rewrite_graphs(graphs, table),
            stacks=stacks,
            scan=True,
        )
        engine_limits = intake.engine_limits(limits)
        out = helper_pb2.HelperScanResponse()
        common = dict(
            emit=out.responses.append, cancelled=lambda: not context.is_active(), limits=engine_limits, edits=run.edits
        )
        with built.lock:
            if run.HasField("session"):
                engine.run_session(built.module, built.tokenizer, run.session, **common)
            else:
                engine.run(built.module, built.tokenizer, run.request, mode="scan", **common)
        return out

    def CheckEdit(self, request: helper_pb2.HelperEditRequest, context: grpc.ServicerContext) -> Any:
        from nnd_daemon.engine import plan

        plan.check_edit(request.graph, self._model(request.model).module)
        return helper_pb2.HelperEmpty()

    def Tokenize(self, request: helper_pb2.HelperTokenizeRequest, context: grpc.ServicerContext) -> Any:
        tok = self._tokenizer(request.model)
        out = nnd_pb2.TokenizeResponse()
        for text in request.request.texts:
            out.ids.add(ids=tok(text, add_special_tokens=not request.request.no_special_tokens)["input_ids"])
        return out

    def Decode(self, request: helper_pb2.HelperDecodeRequest, context: grpc.ServicerContext) -> Any:
        tok = self._tokenizer(request.model)
        skip = request.request.skip_special_tokens
        return nnd_pb2.DecodeResponse(
            texts=[tok.decode(list(i.ids), skip_special_tokens=skip) for i in request.request.ids]
        )

    def GetSource(self, request: helper_pb2.HelperSourceRequest, context: grpc.ServicerContext) -> Any:
        from nnd_daemon.engine import modules, source

        module = modules.table(self._model(request.model).module).get(request.path)
        if module is None:
            raise errors.NotFound(f"the model has no module {request.path!r}")
        return source.listing(module, request.path)

    def GetTokenizerFiles(self, request: helper_pb2.HelperModel, context: grpc.ServicerContext) -> Any:
        tok = self._tokenizer(request)
        out = nnd_pb2.TokenizerFiles()
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name), "rb") as f:
                    out.files[name] = f.read()
        return out

    def CheckUpload(self, request: helper_pb2.HelperUploadRequest, context: grpc.ServicerContext) -> Any:
        checks.check_upload(request.kind, request.folder)
        return helper_pb2.HelperEmpty()

    def Capabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        import platform

        import torch
        import transformers

        from nnd_daemon.engine import ops

        caps = helper_pb2.HelperCapabilities(ops=sorted(ops.OPS), attributes=sorted(ops.ATTRIBUTES))
        caps.libraries.update(
            {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
        )
        return caps

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            models = [b.ref.key for b in self._cache.values()]
        return helper_pb2.HelperStatus(rss_bytes=psutil.Process().memory_info().rss, models=models)
