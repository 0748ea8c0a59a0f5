"""Bring your own model: models whose files a client sends (Upload, HasUpload, LoadModel(upload=)).

An upload is stored once per content, in `<state_dir>/uploads/<sha256>/`: the
client's files and `.upload.json` (kind, files, when). Files arrive into a
`.partial-*` folder next to it, are checked (names, sizes, hash, and for an
exported program the whole archive, see export/exported.py) and the folder is
renamed into place: a folder named by a hash is always complete. Two uploads
of the same content never write it twice; a client asks HasUpload first and
sends nothing the daemon has.

A stored upload is loaded like any model by LoadModel(model=<name>,
upload=<sha256>). Kind "transformers" is a checkpoint folder: the daemon
builds the META model from its config.json and the worker loads its
safetensors with `from_pretrained`, as for a local directory (no pickle: .bin
and .pt files are refused; no code: trust_remote_code is refused). Kind
"exported" is a torch.export program: the META model is the unflattened
program with its weights on the meta device (no weight byte read; Scan runs
it under fake tensors like any META model) and the worker loads it with the
weights. The registry file records the hash, so a restarted daemon restores
uploaded models from the state directory; Unload deletes an upload's folder
once no loaded model uses it.

Access: `--no-uploads` refuses Upload, HasUpload and LoadModel(upload=)
(PERMISSION_DENIED; models uploaded earlier are still restored);
`--max-upload-bytes` bounds one upload (RESOURCE_EXHAUSTED). The allow-list
(`--allow-model`) names repo ids and paths and does not apply to uploads, so
an upload may name no file outside itself: every shard of a safetensors index
and every `*_file` entry in its JSON is a plain name of one of its own files
(`helper/checks.py`'s `check_references`). Uploads at once are capped per client and in all, and an
idle one is cancelled (control/admission.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from nnd.v1 import helper_pb2, nnd_pb2
from nnd_daemon import errors
from nnd_daemon.control import metamodel
from nnd_daemon.control.settings import Settings

log = logging.getLogger("nnd.uploads")

KINDS = ("transformers", "exported")
MANIFEST = ".upload.json"
MAX_CHUNK = 4 * 2**20
# Room left on the state directory's disk beyond the upload itself.
DISK_MARGIN = 256 * 2**20
_SHA = re.compile(r"[0-9a-f]{64}")
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TRANSFORMERS_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".tiktoken")
_EXPORTED_FILES = ("modules.json", "program.pt2")


def hash_prefix(name: str, size: int) -> bytes:
    """What the content hash takes in before a file's bytes (see UploadHeader.sha256)."""
    return name.encode() + b"\0" + str(size).encode() + b"\0"


def disabled(settings: Settings) -> bool:
    return settings.limits.max_upload_bytes < 0


def _check_enabled(settings: Settings) -> None:
    if disabled(settings):
        raise errors.PermissionDenied(
            "uploads are disabled on this daemon (--no-uploads); load a model by repo id or path instead"
        )


def _check_sha(sha: str) -> None:
    if not _SHA.fullmatch(sha):
        raise errors.InvalidArgument(f"{sha[:80]!r} is not a SHA-256 (64 lowercase hex digits)")


def _check_size(settings: Settings, total: int) -> None:
    limit = settings.limits.max_upload_bytes
    if limit > 0 and total > limit:
        raise errors.ResourceExhausted(
            f"the upload is {_size(total)}, over this daemon's limit --max-upload-bytes={_size(limit)}"
        )


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_files(kind: str, files: Iterable[Any]) -> None:
    """Refuse an upload whose kind or file list is not one nnd loads without running code."""
    if kind not in KINDS:
        raise errors.InvalidArgument(f"upload kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    names = [f.name for f in files]
    if not names:
        raise errors.InvalidArgument("the upload has no file")
    if names != sorted(names) or len(set(names)) != len(names):
        raise errors.InvalidArgument("the upload's files must be sorted by name, each once")
    for f in files:
        if not _FILE.fullmatch(f.name):
            raise errors.InvalidArgument(
                f"file name {f.name[:80]!r} is not allowed (letters, digits, '.', '_', '-'; no folders)"
            )
        if f.size < 0:
            raise errors.InvalidArgument(f"file {f.name} has a negative size")
        if kind == "transformers" and not f.name.endswith(_TRANSFORMERS_SUFFIXES):
            raise errors.InvalidArgument(
                f"file {f.name} is not allowed in a transformers upload: only {', '.join(_TRANSFORMERS_SUFFIXES)} "
                "files are (weights as safetensors; no pickled .bin/.pt, no code)"
            )
        if kind == "exported" and f.name not in _EXPORTED_FILES:
            raise errors.InvalidArgument(
                f"file {f.name} is not allowed in an exported upload (only {', '.join(_EXPORTED_FILES)})"
            )
    if kind == "transformers":
        if "config.json" not in names:
            raise errors.InvalidArgument("a transformers upload needs config.json")
        if not any(n.endswith(".safetensors") for n in names):
            raise errors.InvalidArgument("a transformers upload needs its weights as .safetensors")
    if kind == "exported" and "program.pt2" not in names:
        raise errors.InvalidArgument("an exported upload needs program.pt2 (torch.export.save)")


@dataclass
class Stored:
    sha256: str
    kind: str
    path: str


Check = Callable[[str, str], None]


class UploadStore:
    """The uploads folder of one state directory and the RPCs on it; the registry owns one.

    `check(kind, folder)` checks uploaded content: the daemon's helper process
    (control/helper_supervisor.py), so a crafted upload never loads in the daemon's own; without
    one (the store used as a library, in tests), this process."""

    def __init__(self, settings: Settings, check: Check | None = None) -> None:
        self.settings = settings
        self.root = os.path.join(settings.state_dir, "uploads")
        self._check = check
        self._lock = threading.Lock()
        # Hashes being loaded right now: an Unload never deletes them under a LoadModel.
        self._pinned: dict[str, int] = {}

    def path(self, sha: str) -> str:
        return os.path.join(self.root, sha)

    def get(self, sha: str) -> Stored | None:
        _check_sha(sha)
        try:
            with open(os.path.join(self.path(sha), MANIFEST)) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return None
        return Stored(sha, str(manifest.get("kind", "")), self.path(sha))

    def pin(self, sha: str) -> None:
        with self._lock:
            self._pinned[sha] = self._pinned.get(sha, 0) + 1

    def unpin(self, sha: str) -> None:
        with self._lock:
            self._pinned[sha] -= 1
            if not self._pinned[sha]:
                del self._pinned[sha]

    def delete(self, sha: str) -> None:
        with self._lock:
            if sha in self._pinned:
                return
            target = self.path(sha)
            if not os.path.isdir(target):
                return
            # Rename first: the folder of a hash is complete or absent, never half-deleted.
            doomed = tempfile.mkdtemp(prefix=".deleting-", dir=self.root)
            os.rename(target, os.path.join(doomed, sha))
        shutil.rmtree(doomed, ignore_errors=True)
        log.info("deleted upload %s", sha)

    def stored(self) -> tuple[int, int]:
        """How many uploads are kept, and their bytes (for the metrics)."""
        count = total = 0
        if not os.path.isdir(self.root):
            return 0, 0
        for name in os.listdir(self.root):
            if name.startswith("."):
                continue
            count += 1
            for folder, _dirs, files in os.walk(os.path.join(self.root, name)):
                for f in files:
                    try:
                        total += os.lstat(os.path.join(folder, f)).st_size
                    except OSError:
                        pass
        return count, total

    def clean_partial(self) -> None:
        """Remove what interrupted uploads and deletions left (at start, once the daemon owns the socket)."""
        if not os.path.isdir(self.root):
            return
        for name in os.listdir(self.root):
            if name.startswith((".partial-", ".deleting-")):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # -- RPCs (servicer.py calls these) -------------------------------------
    def upload(self, messages: Iterator[Any], context: grpc.ServicerContext) -> nnd_pb2.UploadResponse:
        settings = self.settings
        _check_enabled(settings)
        messages = _well_formed(messages)
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise errors.InvalidArgument("the first message of an Upload must be its header")
        header = first.header
        _check_sha(header.sha256)
        check_files(header.kind, header.files)
        total = sum(f.size for f in header.files)
        _check_size(settings, total)
        if self.get(header.sha256) is not None:
            return nnd_pb2.UploadResponse(sha256=header.sha256, existed=True)
        os.makedirs(self.root, mode=0o750, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if total + DISK_MARGIN > free:
            raise errors.ResourceExhausted(
                f"the upload is {_size(total)} but the state directory's disk has {_size(free)} free"
            )
        tmp = tempfile.mkdtemp(prefix=".partial-", dir=self.root)
        try:
            received = _write(tmp, header, messages, context)
            self._checker()(header.kind, tmp)
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(
                    {
                        "kind": header.kind,
                        "sha256": header.sha256,
                        "files": {x.name: x.size for x in header.files},
                        "created": time.time(),
                    },
                    f,
                )
            try:
                os.rename(tmp, self.path(header.sha256))
            except OSError:
                if self.get(header.sha256) is None:
                    raise
                # Someone else stored the same content meanwhile.
                return nnd_pb2.UploadResponse(sha256=header.sha256, existed=True)
            tmp = ""
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("stored %s upload %s (%s)", header.kind, header.sha256, _size(received))
        return nnd_pb2.UploadResponse(sha256=header.sha256, received_bytes=received)

    def _checker(self) -> Check:
        if self._check is None:
            from nnd_daemon.helper.checks import check_upload

            return check_upload
        return self._check

    def has_upload(self, request: nnd_pb2.HasUploadRequest) -> nnd_pb2.HasUploadResponse:
        settings = self.settings
        _check_enabled(settings)
        _check_sha(request.sha256)
        present = self.get(request.sha256) is not None
        if not present and request.total_bytes:
            _check_size(settings, request.total_bytes)
        return nnd_pb2.HasUploadResponse(present=present, max_upload_bytes=max(settings.limits.max_upload_bytes, 0))

    # -- the registry's side -------------------------------------------------
    def before_load(self, taken: Callable[[str], str | None], request: nnd_pb2.LoadModelRequest) -> None:
        """LoadModel(upload=) from a client: allowed, named, and not taking another model's name.
        `taken(name)`: the upload of the model loaded as `name` ("" for none), None if no model is."""
        if not request.upload:
            return
        _check_enabled(self.settings)
        _check_sha(request.upload)
        request.model = request.model.strip() or f"upload-{request.upload[:12]}"
        upload = taken(request.model)
        if upload is not None and upload != request.upload:
            raise errors.AlreadyExists(
                f"the name {request.model!r} is taken by another model; unload it first or choose another name"
            )

    def build_meta(
        self,
        request: nnd_pb2.LoadModelRequest,
        describe: Callable[[helper_pb2.HelperModel], metamodel.MetaModel],
    ) -> metamodel.MetaModel:
        """The META model of a stored upload (registry.load, for LoadModel(upload=) and restores),
        built by `describe` (in the helper process)."""
        _check_sha(request.upload)
        if request.trust_remote_code:
            raise errors.PermissionDenied("an uploaded model runs no code: trust_remote_code is refused")
        stored = self.get(request.upload)
        if stored is None:
            raise errors.NotFound(f"no upload {request.upload} on this daemon; send it with Upload first")
        self.pin(stored.sha256)
        try:
            exported = stored.kind == "exported"
            if exported and request.options.ListFields():
                raise errors.InvalidArgument(
                    "an uploaded torch.export program is built as exported: load options do not apply"
                )
            ref = helper_pb2.HelperModel(
                key=request.model, source=stored.path, task=request.task, exported=exported, options=request.options
            )
            return describe(ref)
        finally:
            self.unpin(stored.sha256)

    def forget(self, sha: str) -> None:
        """After the Unload of the last model using upload `sha`: delete it."""
        try:
            self.delete(sha)
        except OSError as exc:
            log.warning("could not delete upload %s: %s", sha, exc)


def _well_formed(messages: Iterator[Any]) -> Iterator[Any]:
    for message in messages:
        if isinstance(message, errors.Malformed):  # server.py's parser could not read it
            raise message.error
        yield message


def _write(folder: str, header: Any, messages: Iterator[Any], context: grpc.ServicerContext) -> int:
    """Write the chunks into `folder`, checking sizes and the content hash; returns the bytes received."""
    files = list(header.files)
    digest = hashlib.sha256()
    current = -1
    out: Any = None
    written = 0
    received = 0

    def advance(to: int) -> None:
        nonlocal current, out, written
        while current < to:
            if out is not None:
                out.close()
                out = None
            if current >= 0 and written != files[current].size:
                raise errors.InvalidArgument(
                    f"file {files[current].name} ended after {written} of its {files[current].size} bytes"
                )
            current += 1
            written = 0
            if current < len(files):
                digest.update(hash_prefix(files[current].name, files[current].size))
                out = open(os.path.join(folder, files[current].name), "wb")  # noqa: SIM115 - closed by advance

    try:
        for message in messages:
            if message.WhichOneof("kind") != "chunk":
                raise errors.InvalidArgument("an Upload has one header, as its first message")
            chunk = message.chunk
            if chunk.file >= len(files) or chunk.file < current:
                raise errors.InvalidArgument(f"chunk for file {chunk.file} out of order (files arrive in order)")
            if len(chunk.data) > MAX_CHUNK:
                raise errors.InvalidArgument(f"a chunk is over {MAX_CHUNK} bytes")
            advance(chunk.file)
            if written + len(chunk.data) > files[current].size:
                raise errors.InvalidArgument(f"file {files[current].name} is longer than its declared size")
            out.write(chunk.data)
            digest.update(chunk.data)
            written += len(chunk.data)
            received += len(chunk.data)
        if not context.is_active():
            raise errors.Cancelled("the upload was cancelled")
        advance(len(files))
    finally:
        if out is not None:
            out.close()
    if digest.hexdigest() != header.sha256:
        raise errors.InvalidArgument(
            f"the content's SHA-256 is {digest.hexdigest()}, not the {header.sha256} the header gives; nothing stored"
        )
    return received
