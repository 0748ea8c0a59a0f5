"""Modules as data: `torch.export` programs sent by clients, loaded without running their code.

An exported program (`torch.export.save`) is a zip archive: a JSON graph of
ATen operators, the weights as raw bytes, and a few optional pickled extras.
`torch.export.load` is not safe on bytes from someone else: it unpickles
tensor subclasses, opaque objects and the example inputs (falling back to
`weights_only=False`), loads AOTInductor shared libraries, resolves any
`torch.*` attribute named by a node as its operator (`torch.os.system`
included), and hands shape expressions to `sympy.sympify`, which evaluates
them. So nnd never calls it. `load_program` reads the archive itself:

- entries: the program JSON, raw weights and tensor constants with their two
  configs, and the version files. The example inputs are never read. No
  pickled payload (`use_pickle`), custom or opaque object, AOTInductor or
  ExecuTorch code, legacy `.pt` file or compressed entry is accepted.
- the graph: a complete walk of the program's JSON against torch's schema
  (export_schema.py): every field known, every operator reference (node
  targets, argument values, subgraphs of control-flow operators) on the
  allow-list, no operator that touches files, storages or pointers, no
  custom objects, no `guards_code` (Python source torch would compile), and
  shape expressions bounded in form and in cost (sym_expr.py).
- then torch's own deserializer builds the program from the checked JSON and
  tensors nnd made from the raw bytes, with no example inputs.

Nothing on this path calls `pickle` or `torch.load`, hands client text to
`eval` before sym_expr.py has bounded it, or imports a module the client
names (tests/test_upload_safety.py and tests/test_export_fuzz.py check it).

An upload of kind "exported" is a directory with `program.pt2` and, from the
Python client, `modules.json`: the original class name and `extra_repr()` of
every module path, shown in the module tree instead of the unflattened
module's own class names (display only).
"""

from __future__ import annotations

import json
import os
import re
import threading
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from nnd.v1 import worker_pb2
from nnd_daemon import errors
from nnd_daemon.export import export_schema

PROGRAM = "program.pt2"
MODULES = "modules.json"
_MODEL = "model"  # torch.export.save's name for the one program of an archive

# Archive entries (below the archive's root folder) that may exist. Anything else is refused.
_FIXED_ENTRIES = {
    "archive_format",
    "archive_version",
    "byteorder",
    ".data/version",
    ".data/serialization_id",
    f"models/{_MODEL}.json",
    f"data/weights/{_MODEL}_weights_config.json",
    f"data/constants/{_MODEL}_constants_config.json",
    f"data/sample_inputs/{_MODEL}.pt",  # present, never read
}
_WEIGHT_ENTRY = re.compile(r"data/weights/weight_[0-9]+")
_CONSTANT_ENTRY = re.compile(r"data/constants/tensor_[0-9]+")

_PATH = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def _refuse(what: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"the exported program is refused: {what}")


# ------------------------------------------------------------------ checking


def _entries(archive: zipfile.ZipFile) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    """The archive's root folder and its entries below it, each one allowed."""
    infos = archive.infolist()
    if not infos:
        raise _refuse("the archive is empty")
    root = infos[0].filename.split("/", 1)[0]
    out: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        head, _, rest = info.filename.partition("/")
        if head != root or not rest:
            raise _refuse(f"unexpected entry {info.filename!r} (one root folder expected)")
        if info.compress_type != zipfile.ZIP_STORED:
            raise _refuse(f"entry {rest!r} is compressed; torch.export.save stores entries uncompressed")
        if not (rest in _FIXED_ENTRIES or _WEIGHT_ENTRY.fullmatch(rest) or _CONSTANT_ENTRY.fullmatch(rest)):
            raise _refuse(
                f"entry {rest!r} is not part of a plain exported program (no pickled objects, "
                "AOTInductor/ExecuTorch code or extra files are accepted)"
            )
        out[rest] = info
    for needed in (f"models/{_MODEL}.json", "archive_version", f"data/weights/{_MODEL}_weights_config.json"):
        if needed not in out:
            raise _refuse(f"entry {needed!r} is missing (write the program with torch.export.save)")
    return root, out


def _check_path(value: Any, key: str) -> None:
    if not isinstance(value, str) or (value and not _PATH.fullmatch(value)):
        raise _refuse(f"{key} {str(value)[:80]!r} is not a module path")
    if any(part.startswith("__") for part in value.split(".")):
        raise _refuse(f"{key} {value[:80]!r} names a private attribute")


def check_program_json(program: dict[str, Any]) -> None:
    """Refuse a serialized program whose graph could do more than compute with tensors (export_schema.py)."""
    if not isinstance(program, dict) or "graph_module" not in program:
        raise _refuse("models/model.json is not a serialized exported program")
    export_schema.check_program(program)


def _payload_config(archive: zipfile.ZipFile, root: str, name: str) -> dict[str, Any]:
    try:
        data = json.loads(archive.read(f"{root}/{name}"))
        config = data["config"]
    except KeyError:
        return {}
    except (ValueError, TypeError) as exc:
        raise _refuse(f"{name} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _refuse(f"{name} holds no payload table")
    for fqn, meta in config.items():
        _check_path(fqn, "tensor name")
        if not isinstance(meta, dict) or meta.get("use_pickle") or not isinstance(meta.get("tensor_meta"), dict):
            raise _refuse(f"tensor {fqn!r} is pickled (a tensor subclass or object); only plain tensors are accepted")
        if not re.fullmatch(r"(weight|tensor)_[0-9]+", str(meta.get("path_name", ""))):
            raise _refuse(f"tensor {fqn!r} is not stored as raw bytes")
    return config


# ------------------------------------------------------------------ loading


def _tensor(archive: zipfile.ZipFile, root: str, folder: str, meta: dict[str, Any], *, on_meta: bool) -> torch.Tensor:
    from torch._export.serde import schema
    from torch._export.serde.serialize import deserialize_scalar_type

    def ints(items: Any) -> tuple[int, ...]:
        out = []
        for item in items if isinstance(items, list) else [items]:
            if not isinstance(item, dict) or set(item) != {"as_int"} or not isinstance(item["as_int"], int):
                raise ValueError("sizes must be plain integers")
            out.append(item["as_int"])
        return tuple(out)

    tm = meta["tensor_meta"]
    try:
        dtype = deserialize_scalar_type(schema.ScalarType(int(tm["dtype"])))
        size, stride, (offset,) = ints(tm["sizes"]), ints(tm["strides"]), ints(tm["storage_offset"])
        if len(size) != len(stride):
            raise ValueError("sizes and strides differ in length")
    except (KeyError, TypeError, ValueError) as exc:
        raise _refuse(f"tensor metadata of {meta.get('path_name')} is malformed ({exc})") from None
    if any(not isinstance(d, int) or d < 0 for d in (*size, *stride, offset)):
        raise _refuse(f"tensor {meta.get('path_name')} has symbolic or negative sizes")
    needed = offset + 1 + sum((d - 1) * s for d, s in zip(size, stride, strict=True)) if all(size) else 0
    if on_meta:
        flat = torch.empty(max(needed, 0), dtype=dtype, device="meta")
    else:
        info = archive.getinfo(f"{root}/{folder}/{meta['path_name']}")
        element = torch.empty((), dtype=dtype).element_size()
        if info.file_size < needed * element or info.file_size % element:
            raise _refuse(f"tensor {meta['path_name']} has {info.file_size} bytes, too few for its shape")
        raw = bytearray(archive.read(info))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    out = torch.as_strided(flat, size, stride, offset) if needed else torch.empty(size, dtype=dtype, device=flat.device)
    return out


def load_program(path: str, *, on_meta: bool = False) -> Any:
    """The ExportedProgram in `path`, checked as described above; weights on
    the meta device (no weight byte read) when `on_meta`."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass

    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise _refuse(f"not a torch.export archive ({exc})") from None
    with archive:
        root, entries = _entries(archive)
        version = archive.read(f"{root}/archive_version").decode(errors="replace").strip()
        if version != "0":
            raise _refuse(f"archive version {version!r} is not the one this daemon reads (0)")
        raw_program = archive.read(f"{root}/models/{_MODEL}.json")
        try:
            program = json.loads(raw_program)
        except ValueError as exc:
            raise _refuse(f"models/model.json is not valid JSON ({exc})") from None
        check_program_json(program)
        state_dict: dict[str, Any] = {}
        for fqn, meta in _payload_config(archive, root, f"data/weights/{_MODEL}_weights_config.json").items():
            t = _tensor(archive, root, "data/weights", meta, on_meta=on_meta)
            state_dict[fqn] = (
                torch.nn.Parameter(t, requires_grad=bool(meta["tensor_meta"].get("requires_grad")))
                if meta.get("is_param")
                else t
            )
        constants: dict[str, Any] = {}
        config_name = f"data/constants/{_MODEL}_constants_config.json"
        if config_name in entries:
            for fqn, meta in _payload_config(archive, root, config_name).items():
                constants[fqn] = _tensor(archive, root, "data/constants", meta, on_meta=on_meta)
    try:
        serialized = _bytes_to_dataclass(schema.ExportedProgram, raw_program)
        serialized.guards_code = []  # refused above; torch compiles and runs it in ExportedProgram.module()
        with _DESERIALIZE_LOCK:
            return ExportedProgramDeserializer(None).deserialize(serialized, state_dict, constants, None)
    except errors.NndError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's deserializer raises many kinds
        raise _refuse(f"torch cannot read it ({type(exc).__name__}: {exc})") from None


# torch's deserializer keeps process-wide state (_CURRENT_DESERIALIZER): two programs read at
# once (uploads from several threads) fail, so they take turns.
_DESERIALIZE_LOCK = threading.Lock()


def module_types(directory: str) -> dict[str, tuple[str, str]]:
    """Module path -> (class name, extra_repr) as the client described its module (display only)."""
    try:
        with open(os.path.join(directory, MODULES)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    out: dict[str, tuple[str, str]] = {}
    if isinstance(data, dict):
        for path, item in data.items():
            if isinstance(path, str) and isinstance(item, list) and len(item) == 2:
                out[path] = (str(item[0])[:200], str(item[1])[:1000])
    return out


def build(directory: str, *, on_meta: bool) -> torch.nn.Module:
    """The module tree of the uploaded program in `directory` (torch.export.unflatten): the
    original module paths, hooks work on every module that ran."""
    ep = load_program(os.path.join(directory, PROGRAM), on_meta=on_meta)
    return _unflatten(ep)


def _unflatten(ep: Any) -> torch.nn.Module:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = torch.export.unflatten(ep)
        except Exception as exc:  # noqa: BLE001
            raise _refuse(f"its module tree cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    module.requires_grad_(False)
    return module


def is_program_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, PROGRAM))


# ------------------------------------------------------------------ the worker's load


def load(
    req: worker_pb2.WorkerLoadRequest, report: Callable[[int, int, str], None]
) -> tuple[torch.nn.Module, Any, str]:
    """A worker's Load for an uploaded exported program: (module, no tokenizer, dtype)."""
    from nnd_daemon.modelclass import QUANTIZED, torch_dtype

    placement = req.placement
    if placement.tp_size > 1:
        raise errors.InvalidArgument("an exported module cannot be split for tensor parallel; dispatch it without --tp")
    if placement.dtype in QUANTIZED:
        raise errors.InvalidArgument(f"an exported module cannot be quantized ({placement.dtype}); use a float dtype")
    device = _device(placement)
    ep = load_program(os.path.join(req.model, PROGRAM))
    if device.type != "cpu":
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, device)
    module = _unflatten(ep)
    if placement.dtype and placement.dtype != "auto":
        module.to(torch_dtype(placement.dtype))  # floating parameters only; ops with a fixed dtype keep theirs
    count = sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers())
    report(count, count, "tensors")
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
    dtype = str(max(set(floats), key=floats.count)).removeprefix("torch.") if floats else ""
    return module, None, dtype


def _device(placement: Any) -> torch.device:
    text = (placement.device or placement.device_map or "").strip()
    if text.startswith("{"):
        raise errors.InvalidArgument("an exported module runs on one device; give device=, not a device_map table")
    if text in ("", "auto", "balanced", "sequential"):
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text.isdigit():
        text = f"cuda:{text}"
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise errors.InvalidArgument(f"unknown device {text!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise errors.InvalidArgument(f"device {text!r} is not available on this daemon")
    return device
