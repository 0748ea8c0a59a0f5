"""Uploads without a daemon process: the daemon's request path for an uploaded
torch.export program unpickles nothing and calls no `torch.load`, crafted
archives are refused, and the upload store checks names, hashes and limits."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from typing import Any

import pytest
import torch

from nnd import _nnsight, _upload
from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon import errors
from nnd_daemon.control import metamodel, uploads
from nnd_daemon.control.settings import Limits, Settings
from nnd_daemon.helper import meta as helper_meta
from nnd_daemon.worker import exported


class _Context:
    def is_active(self) -> bool:
        return True


def _settings(tmp_path: Any, limit: int = 2**30) -> Settings:
    return Settings(address="", state_dir=str(tmp_path), limits=Limits(max_upload_bytes=limit))


@pytest.fixture(scope="module")
def program() -> tuple[torch.nn.Module, bytes]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return net, _nnsight.export(net, torch.rand(1, 3))


def _store(settings: Settings, payload: _upload.Payload) -> nnd_pb2.UploadResponse:
    return uploads.upload(settings, payload.messages([0]), _Context())


def _no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unpickling on the upload path")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch._C, "_pickle_load_obj", refuse)
    monkeypatch.setattr(torch.export, "load", refuse)


def test_the_request_path_unpickles_nothing(tmp_path, program, monkeypatch):
    net, data = program
    settings = _settings(tmp_path)
    payload = _upload.Payload("exported", [("modules.json", _upload.modules_json(net)), ("program.pt2", data)])
    _store(_settings(tmp_path / "warm"), payload)  # imports done before the guard goes up
    _no_unpickling(monkeypatch)

    stored = _store(settings, payload)  # Upload: checks the archive
    assert stored.received_bytes == payload.total and not stored.existed
    built: dict[str, Any] = {}

    def describe(ref: Any) -> metamodel.MetaModel:  # what the helper process does for LoadModel
        built["meta"] = helper_meta.build(ref)
        return metamodel.MetaModel(ref=ref, description=helper_meta.describe(built["meta"]))

    meta = uploads.build_meta(settings, nnd_pb2.LoadModelRequest(model="net", upload=stored.sha256), describe)
    assert meta.architecture == "Sequential" and {str(p.device) for p in built["meta"].module.parameters()} == {"meta"}
    assert [m.type for m in meta.modules()] == ["Sequential", "Linear", "ReLU", "Linear"]
    module, tokenizer, dtype = exported.load(  # the worker's Load
        worker_pb2.WorkerLoadRequest(model=os.path.join(tmp_path, "uploads", stored.sha256)), lambda *a: None
    )
    x = torch.rand(5, 3)
    assert tokenizer is None and dtype == "float32"
    assert torch.allclose(module(x), net(x), atol=1e-6)


def _rewrite(data: bytes, change: Any) -> bytes:
    """The archive with `change(entries)` applied to {name: bytes}."""
    src = zipfile.ZipFile(io.BytesIO(data))
    entries = {info.filename: src.read(info) for info in src.infolist()}
    change(entries)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, content in entries.items():
            z.writestr(name, content)
    return out.getvalue()


def _edit_program(edit: Any) -> Any:
    def change(entries: dict[str, bytes]) -> None:
        name = next(n for n in entries if n.endswith("models/model.json"))
        program = json.loads(entries[name])
        edit(program)
        entries[name] = json.dumps(program).encode()

    return change


def _first_node(program: dict) -> dict:
    return program["graph_module"]["graph"]["nodes"][0]


def _weights_config(edit: Any) -> Any:
    def change(entries: dict[str, bytes]) -> None:
        name = next(n for n in entries if n.endswith("model_weights_config.json"))
        config = json.loads(entries[name])
        edit(config)
        entries[name] = json.dumps(config).encode()

    return change


def _set_expr(program: dict, text: str) -> None:
    program["graph_module"]["graph"]["nodes"][0]["outputs"][0] = {"as_sym_int": {"as_expr": {"expr_str": text}}}


CRAFTED = {
    "a torch attribute as operator": (
        _edit_program(lambda p: _first_node(p).update(target="torch.os.system")),
        "operator 'torch.os.system' is not allowed",
    ),
    "an operator that reads files": (
        _edit_program(lambda p: _first_node(p).update(target="torch.ops.aten.from_file.default")),
        "touches files",
    ),
    "code in a shape expression": (
        _edit_program(lambda p: _set_expr(p, "__import__('os').system('true')")),
        "shape expression",
    ),
    "a pickled weight": (
        _weights_config(lambda c: next(iter(c["config"].values())).update(use_pickle=True)),
        "pickled",
    ),
    "compiled code": (
        lambda e: e.update({"archive/data/aotinductor/model/model.so": b"\x7fELF"}),
        "not part of a plain exported program",
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_archives_are_refused(tmp_path, program, case):
    change, reason = CRAFTED[case]
    bad = _rewrite(program[1], change)
    payload = _upload.Payload("exported", [("program.pt2", bad)])
    with pytest.raises(errors.InvalidArgument, match=reason):
        _store(_settings(tmp_path), payload)
    assert not [n for n in os.listdir(tmp_path / "uploads") if not n.startswith(".")]  # nothing stored


def test_a_pickle_in_the_example_inputs_never_runs(tmp_path, program):
    """torch.export.load unpickles the example inputs, falling back to
    weights_only=False (so a crafted archive runs code); nnd never reads them."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return (os.makedirs, (str(marker),))

    evil = io.BytesIO()
    torch.save(Payload(), evil)

    def change(entries: dict[str, bytes]) -> None:
        name = next(n for n in entries if n.endswith("sample_inputs/model.pt"))
        entries[name] = evil.getvalue()

    path = tmp_path / "program.pt2"
    path.write_bytes(_rewrite(program[1], change))
    module = exported._unflatten(exported.load_program(str(path)))
    assert module(torch.rand(2, 3)).shape == (2, 2)
    assert not marker.exists()


def test_store_checks_names_hashes_and_limits(tmp_path):
    settings = _settings(tmp_path, limit=1000)
    good = _upload.Payload("transformers", [("config.json", b"{}"), ("model.safetensors", b"x")])

    header = good.header()
    header.sha256 = "0" * 64
    lying = iter([nnd_pb2.UploadRequest(header=header), *list(good.messages([0]))[1:]])
    with pytest.raises(errors.InvalidArgument, match="SHA-256"):
        uploads.upload(settings, lying, _Context())

    pickled = _upload.Payload("transformers", [("config.json", b"{}"), ("pytorch_model.bin", b"x")])
    with pytest.raises(errors.InvalidArgument, match="pickled"):
        _store(settings, pickled)
    with pytest.raises(errors.InvalidArgument, match="not allowed"):
        _store(settings, _upload.Payload("exported", [("../program.pt2", b"x")]))
    with pytest.raises(errors.InvalidArgument, match="model_type"):
        _store(settings, good)  # config.json without model_type

    big = _upload.Payload("exported", [("program.pt2", b"x" * 2000)])
    with pytest.raises(errors.ResourceExhausted, match="--max-upload-bytes"):
        _store(settings, big)
    with pytest.raises(errors.ResourceExhausted, match="--max-upload-bytes"):
        uploads.has_upload(settings, nnd_pb2.HasUploadRequest(sha256=big.sha256, total_bytes=big.total))

    off = _settings(tmp_path, limit=-1)
    with pytest.raises(errors.PermissionDenied, match="--no-uploads"):
        _store(off, good)
    with pytest.raises(errors.PermissionDenied, match="--no-uploads"):
        uploads.has_upload(off, nnd_pb2.HasUploadRequest(sha256=good.sha256))
    assert not [n for n in os.listdir(tmp_path / "uploads") if not n.startswith(".")]
