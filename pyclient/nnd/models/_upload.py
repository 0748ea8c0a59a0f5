"""Bring your own model: send a model this process holds to the daemon.

`nnd.TransformersModel(hf_model)` sends a transformers model's config and
weights (safetensors) and, when it has one, its tokenizer; `nnd.NNsight(module,
example_inputs)` (see _nnsight.py) sends a torch.export program. Either way the
files are addressed by a content hash (SHA-256 over names, sizes and bytes):
the client first asks the daemon whether it holds that hash (HasUpload, which
also checks the size against the daemon's limit) and sends the bytes in 1 MiB
chunks (Upload, client streaming) only if not; then it loads the upload under
a name with LoadModel(upload=<hash>). Sending the same model twice sends it
once.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from nnd.errors import ModelNotFound
from nnd.models._model import TransformersModel
from nnd.v1 import nnd_pb2

CHUNK = 1024 * 1024


@dataclass
class UploadInfo:
    """What sending a model to the daemon did (`model.upload_info`)."""

    kind: str
    """"transformers" or "exported"."""
    sha256: str
    """The content hash the daemon stores the model under."""
    total_bytes: int
    """The size of the model's files."""
    sent_bytes: int = 0
    """Bytes actually sent: 0 when the daemon already held the same content."""
    existed: bool = False
    """Whether the daemon already held the content (nothing was sent)."""


@dataclass
class Payload:
    """The files of an upload: name -> bytes, or the path of a file on disk."""

    kind: str
    files: list[tuple[str, bytes | str]]
    sha256: str = ""
    total: int = 0
    _keep: Any = field(default=None, repr=False)  # a TemporaryDirectory the paths live in

    def __post_init__(self) -> None:
        self.files.sort(key=lambda f: f[0].encode())
        digest = hashlib.sha256()
        total = 0
        for name, content in self.files:
            size = len(content) if isinstance(content, bytes) else os.path.getsize(content)
            digest.update(name.encode() + b"\0" + str(size).encode() + b"\0")
            for piece in _pieces(content):
                digest.update(piece)
            total += size
        self.sha256, self.total = digest.hexdigest(), total

    def header(self) -> nnd_pb2.UploadHeader:
        return nnd_pb2.UploadHeader(
            kind=self.kind,
            sha256=self.sha256,
            files=[
                nnd_pb2.UploadFile(name=n, size=len(c) if isinstance(c, bytes) else os.path.getsize(c))
                for n, c in self.files
            ],
        )

    def messages(self, sent: list[int]) -> Iterator[nnd_pb2.UploadRequest]:
        yield nnd_pb2.UploadRequest(header=self.header())
        for index, (_, content) in enumerate(self.files):
            for piece in _pieces(content):
                sent[0] += len(piece)
                yield nnd_pb2.UploadRequest(chunk=nnd_pb2.UploadChunk(file=index, data=piece))


def _pieces(content: bytes | str) -> Iterator[bytes]:
    if isinstance(content, bytes):
        for start in range(0, len(content), CHUNK):
            yield content[start : start + CHUNK]
        return
    with open(content, "rb") as f:
        while piece := f.read(CHUNK):
            yield piece


_ONE_UPLOAD = threading.Lock()


def send(conn: Any, payload: Payload, request: nnd_pb2.LoadModelRequest) -> tuple[nnd_pb2.ModelInfo, UploadInfo]:
    """Make sure the daemon holds `payload`, then load it with `request` (its `upload` is set here)."""
    info = UploadInfo(payload.kind, payload.sha256, payload.total)
    request.upload = payload.sha256
    have = conn.call("HasUpload", nnd_pb2.HasUploadRequest(sha256=payload.sha256, total_bytes=payload.total))
    info.existed = have.present
    for attempt in range(2):
        if not info.existed or attempt:
            sent = [0]
            try:
                # One upload at a time per process: the daemon caps uploads in progress per client.
                with _ONE_UPLOAD:
                    response = conn.stub.Upload(payload.messages(sent), metadata=conn._metadata())
            except grpc.RpcError as err:
                raise conn._translate(err) from None
            info.sent_bytes += response.received_bytes
            info.existed = info.existed and response.existed
        try:
            return conn.call("LoadModel", request), info
        except ModelNotFound:
            # The daemon deleted it between HasUpload and LoadModel (its last user was unloaded): send it.
            if attempt:
                raise
            info.existed = False
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ transformers models


def transformers_payload(model: Any, tokenizer: Any) -> Payload:
    """config.json, generation_config.json and model.safetensors as `save_pretrained`
    writes them, and the tokenizer's files."""
    keep = tempfile.TemporaryDirectory(prefix="nnd-upload-")
    folder = keep.name
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    files: list[tuple[str, bytes | str]] = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name.endswith((".json", ".safetensors", ".txt", ".model", ".jinja", ".tiktoken")):
            files.append((name, path))
    return Payload("transformers", files, _keep=keep)


def default_tokenizer(model: Any) -> Any:
    """The tokenizer saved beside the checkpoint `model` was loaded from, if there is one locally."""
    source = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not source:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer: the model still takes token ids
        return None


def infer_task(model: Any) -> str:
    """nnsight's rule: a generative model is text-generation; otherwise the daemon decides by class name."""
    can_generate = getattr(model, "can_generate", None)
    try:
        return "text-generation" if callable(can_generate) and can_generate() else ""
    except Exception:  # noqa: BLE001
        return ""


class _Uploaded:
    """Mixin of the handles whose model is sent from this process: LoadModel becomes
    HasUpload/Upload + LoadModel(upload=)."""

    _payload: Payload | None
    _upload_name: str
    _upload_info: UploadInfo | None

    def _load(self, request: nnd_pb2.LoadModelRequest) -> nnd_pb2.ModelInfo:
        request.model = self._upload_name
        if self._payload is None:  # opened by name: loaded already (or restored by the daemon)
            return super()._load(request)  # type: ignore[misc]
        info, upload = send(self._conn, self._payload, request)  # type: ignore[attr-defined]
        object.__setattr__(self, "_upload_info", upload)
        object.__setattr__(self, "_payload", None)  # the files are on the daemon; free them here
        return info

    @property
    def upload_info(self) -> UploadInfo | None:
        """What sending the model did: its content hash, size, and the bytes
        actually sent (0 when the daemon already had it)."""
        return self._upload_info


class UploadedModel(_Uploaded, TransformersModel):
    """`nnd.TransformersModel(hf_model)`: a transformers model held in this
    process (edited, fine-tuned, built from a config), sent to the daemon.

    The config and the weights (safetensors) are uploaded under `name` (or a
    name derived from their content hash), with `tokenizer`'s files (default:
    the tokenizer saved beside the checkpoint the model was loaded from, if
    there is one). The daemon stores them in its state directory and, as
    nnsight reports an in-memory model dispatched, dispatches it at once (on
    the device its parameters are on here, unless `device`/`device_map` say
    otherwise; `dispatch=False` leaves it META until the first trace); from
    then on it behaves like one loaded by repo id: released, restored after a
    restart. The task is `task`, else text-generation for a generative
    model, else inferred by the daemon from the class name. Sending identical
    weights again sends nothing (see `upload_info`).
    """

    def __init__(
        self, model: Any, *, name: str | None = None, tokenizer: Any = None, task: str | None = None, **kwargs: Any
    ) -> None:
        if not (hasattr(model, "save_pretrained") and hasattr(model, "config")):
            raise TypeError(
                f"TransformersModel takes a repo id, a path or a transformers model, not a {type(model).__name__}; "
                "for any other torch module use nnd.NNsight(module, example_inputs)"
            )
        if kwargs.get("trust_remote_code"):
            raise ValueError("an uploaded model runs no code on the daemon; trust_remote_code cannot be set")
        tok = default_tokenizer(model) if tokenizer is None else (tokenizer or None)
        object.__setattr__(self, "_payload", transformers_payload(model, tok))
        object.__setattr__(self, "_upload_name", name or "")
        object.__setattr__(self, "_upload_info", None)
        # An in-memory model is already loaded in nnsight (dispatched: True): so here, on the daemon,
        # where this process keeps it (its parameters' device) unless told otherwise.
        kwargs.setdefault("dispatch", True)
        if kwargs.get("device") is None and kwargs.get("device_map") is None:
            first = next(iter(model.parameters()), None)
            if first is not None and first.device.type != "meta":
                kwargs["device"] = str(first.device)
        super().__init__("", task=task or infer_task(model), **kwargs)
        if tok is not None:
            self._tokenizer = tok


def modules_json(module: Any) -> bytes:
    """modules.json: the class name and extra_repr of every module path."""
    table = {path: [type(m).__name__, m.extra_repr()] for path, m in module.named_modules()}
    return json.dumps(table, sort_keys=True).encode()
