"""Uploaded torch.export programs: the daemon's request path unpickles nothing
and calls no `torch.load`; crafted archives (a real `torch.export.save` archive,
its JSON edited here) are refused by the schema walk, in process and through a
real daemon: a file read and a file write that torch's own loader would run
(checked here) leave a canary unread and uncreated; workers run isolated from
the daemon's working directory; the upload store checks names, hashes and limits."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import zipfile
from typing import Any

import grpc
import pytest
import torch
from daemonproc import start_daemon
from exportcraft import edited, file_call, read_program, with_program

import nnd
from nnd.models import _nnsight, _upload
from nnd.v1 import nnd_pb2, nnd_pb2_grpc, worker_pb2
from nnd_daemon import errors
from nnd_daemon.control import metamodel, uploads
from nnd_daemon.control.settings import Limits, Settings
from nnd_daemon.export import export_schema, exported, sym_expr
from nnd_daemon.helper import meta as helper_meta


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
    return uploads.UploadStore(settings).upload(payload.messages([0]), _Context())


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

    store = uploads.UploadStore(settings)
    meta = store.build_meta(nnd_pb2.LoadModelRequest(model="net", upload=stored.sha256), describe)
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


def _graph(program: dict) -> dict:
    return program["graph_module"]["graph"]


def _first_node(program: dict) -> dict:
    return _graph(program)["nodes"][0]


def _first_arg(program: dict, arg: dict) -> None:
    _first_node(program)["inputs"][0]["arg"] = arg


def _first_tensor(program: dict) -> dict:
    return next(iter(_graph(program)["tensor_values"].values()))


def _weights_config(edit: Any) -> Any:
    def change(entries: dict[str, bytes]) -> None:
        name = next(n for n in entries if n.endswith("model_weights_config.json"))
        config = json.loads(entries[name])
        edit(config)
        entries[name] = json.dumps(config).encode()

    return change


def _set_expr(program: dict, text: str) -> None:
    _first_tensor(program)["sizes"][0] = {"as_expr": {"expr_str": text, "hint": None}}


_EMPTY_GRAPH = {
    "inputs": [],
    "outputs": [],
    "nodes": [],
    "tensor_values": {},
    "sym_int_values": {},
    "sym_bool_values": {},
}

CRAFTED = {
    "a torch attribute as operator": (
        _edit_program(lambda p: _first_node(p).update(target="torch.os.system")),
        "operator 'torch.os.system' is not allowed",
    ),
    "an operator that reads files": (
        _edit_program(lambda p: _first_node(p).update(target="torch.ops.aten.from_file.default")),
        "names a file",
    ),
    "an operator on storages": (
        # set_ is an allowed name (Tensor.set_); its Storage overload is refused by its schema
        _edit_program(lambda p: _first_node(p).update(target="torch.ops.aten.set_.source_Storage")),
        "Storage",
    ),
    "an operator of TorchScript's (strings, no tensors)": (
        _edit_program(lambda p: _first_node(p).update(target="torch.ops.aten.add.str")),
        "str|tensors",
    ),
    "a dunder attribute path": (
        _edit_program(lambda p: _first_node(p).update(target="torch.ops.aten.__class__.__init__")),
        "not an allowed ATen operator",
    ),
    "an operator as an argument value": (
        _edit_program(lambda p: _first_arg(p, {"as_operator": "torch.ops.aten.from_file.default"})),
        "passes an operator as a value",
    ),
    "a control-flow operand that is an operator (the file read of issue #22)": (
        _edit_program(lambda p: p.update(file_call(p, "/nonexistent/secret", shared=False, size=8))),
        "wrap_with_set_grad_enabled's operand 1 must be a subgraph",
    ),
    "a subgraph outside control flow": (
        _edit_program(lambda p: _first_arg(p, {"as_graph": {"name": "g", "graph": _EMPTY_GRAPH}})),
        "subgraph outside a control-flow operand",
    ),
    "a custom object": (
        _edit_program(lambda p: _first_arg(p, {"as_custom_obj": {"name": "x", "class_fqn": "__torch__.Evil"}})),
        "custom object",
    ),
    "an unknown field": (
        _edit_program(lambda p: _first_node(p).update(extra=1)),
        "field 'extra' that Node does not have",
    ),
    "an unknown top-level field": (
        _edit_program(lambda p: p.update(example_code="import os")),
        "field 'example_code' that ExportedProgram does not have",
    ),
    "a union with two members": (
        _edit_program(lambda p: _first_node(p)["inputs"][0]["arg"].update(as_int=1)),
        "exactly one of",
    ),
    "guards code": (
        _edit_program(lambda p: p.update(guards_code=["__import__('os').system('true')"])),
        "guards_code",
    ),
    "node metadata torch does not write": (
        _edit_program(lambda p: _first_node(p)["metadata"].update(source_fn_stack="x,torch.os.system")),
        "node metadata 'source_fn_stack'",
    ),
    "a triple quote in a stack trace (FX_GRAPH_SHOW_META writes metadata into generated source)": (
        _edit_program(lambda p: _first_node(p)["metadata"].update(stack_trace='"""+print(1)+"""')),
        "triple quote",
    ),
    "a triple quote escaped inside custom metadata": (
        _edit_program(lambda p: _first_node(p)["metadata"].update(custom=json.dumps({"k": '"""'}))),
        "triple quote",
    ),
    "a verifier torch would look up": (
        _edit_program(lambda p: p.update(verifiers=["EXIR"])),
        "verifier",
    ),
    "an integer beyond 64 bits": (
        _edit_program(lambda p: _first_tensor(p)["sizes"].__setitem__(0, {"as_int": 2**70})),
        "64-bit integer",
    ),
    "a sparse tensor": (
        _edit_program(lambda p: _first_tensor(p).update(layout=1)),
        "strided",
    ),
    "code in a shape expression": (
        _edit_program(lambda p: _set_expr(p, "__import__('os').system('true')")),
        "shape expression",
    ),
    "an attribute in a shape expression": (
        _edit_program(lambda p: _set_expr(p, "Symbol('s0').__class__")),
        "shape expression",
    ),
    "a power of unbounded cost (the 257 s GIL hold of issue #22)": (
        _edit_program(lambda p: _set_expr(p, "Pow(Integer(10), Pow(Integer(10), Integer(8)))")),
        "power that is not an integer literal",
    ),
    "10**(10**8) as Python text": (
        _edit_program(lambda p: _set_expr(p, "10**(10**8)")),
        "power that is not an integer literal",
    ),
    "a tower of small powers": (
        _edit_program(lambda p: _set_expr(p, "((((Symbol('s0')**64)**64)**64)**64)")),
        "bits",
    ),
    "a huge integer literal": (
        _edit_program(lambda p: _set_expr(p, "Mul(Integer(" + "9" * 1500 + "), Symbol('s0'))")),
        "bits|not an expression",
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
        uploads.UploadStore(settings).upload(lying, _Context())

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
        uploads.UploadStore(settings).has_upload(nnd_pb2.HasUploadRequest(sha256=big.sha256, total_bytes=big.total))

    off = _settings(tmp_path, limit=-1)
    with pytest.raises(errors.PermissionDenied, match="--no-uploads"):
        _store(off, good)
    with pytest.raises(errors.PermissionDenied, match="--no-uploads"):
        uploads.UploadStore(off).has_upload(nnd_pb2.HasUploadRequest(sha256=good.sha256))
    assert not [n for n in os.listdir(tmp_path / "uploads") if not n.startswith(".")]


# ---------------------------------------------------------------- subgraphs of control-flow operators


class _NoGrad(torch.nn.Module):
    """Exports to a wrap_with_set_grad_enabled node whose operand is a subgraph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = self.lin(x)
        return y.relu()


@pytest.fixture(scope="module")
def hop_program() -> tuple[torch.nn.Module, bytes]:
    torch.manual_seed(0)
    net = _NoGrad()
    return net, _nnsight.export(net, torch.rand(1, 3))


def _inner_node(program: dict) -> dict:
    hop = next(n for n in _graph(program)["nodes"] if n["target"].startswith("torch.ops.higher_order."))
    graph_arg = next(i["arg"]["as_graph"] for i in hop["inputs"] if "as_graph" in i["arg"])
    return graph_arg["graph"]["nodes"][0]


NESTED = {
    "an operator that reads files, inside a subgraph": (
        lambda p: _inner_node(p).update(target="torch.ops.aten.from_file.default"),
        "names a file",
    ),
    "an operator as a value, inside a subgraph": (
        lambda p: _inner_node(p)["inputs"][0].update(arg={"as_operator": "torch.os.system"}),
        "passes an operator as a value",
    ),
    "an unknown field, inside a subgraph": (
        lambda p: _inner_node(p).update(code="x"),
        "field 'code' that Node does not have",
    ),
}


def test_a_subgraph_program_loads_and_computes(tmp_path, hop_program):
    net, data = hop_program
    assert "wrap_with_set_grad_enabled" in json.dumps(read_program(data))  # the walk reached a real subgraph
    path = tmp_path / "program.pt2"
    path.write_bytes(data)
    module = exported._unflatten(exported.load_program(str(path)))
    x = torch.rand(4, 3)
    assert torch.allclose(module(x), net(x), atol=1e-6)


@pytest.mark.parametrize("case", sorted(NESTED))
def test_subgraphs_get_the_same_walk(tmp_path, hop_program, case):
    edit, reason = NESTED[case]
    path = tmp_path / "program.pt2"
    path.write_bytes(edited(hop_program[1], edit))
    with pytest.raises(errors.InvalidArgument, match=reason):
        exported.load_program(str(path))


def test_the_file_calls_run_under_torchs_own_loader(tmp_path, program, monkeypatch):
    """The crafted file read and file write are real: with the schema walk switched off, torch's
    deserializer builds them and running the module reads the secret and creates the file. So the
    refusals in the tests below are what stands between an upload and the daemon's files."""
    secret, created = tmp_path / "secret", tmp_path / "created"
    secret.write_bytes(b"SECRET42")
    secret.chmod(0o600)
    monkeypatch.setattr(export_schema, "check_program", lambda program: None)
    for path, shared in ((secret, False), (created, True)):
        archive = with_program(program[1], file_call(read_program(program[1]), str(path), shared=shared, size=8))
        (tmp_path / "evil.pt2").write_bytes(archive)
        module = exported._unflatten(exported.load_program(str(tmp_path / "evil.pt2")))
        _, leaked = module(torch.rand(2, 3))
        if not shared:
            assert bytes(leaked.tolist()) == b"SECRET42"
    assert created.exists()


# ---------------------------------------------------------------- through a real daemon


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A daemon whose working directory is a folder of the test's, as a daemon started from a shell has."""
    root = tmp_path_factory.mktemp("served")
    (root / "wd").mkdir()
    d = start_daemon(root / "daemon", cwd=str(root / "wd"))
    yield root, d
    d.stop()


def _upload_rpc(address: str, archive: bytes) -> grpc.RpcError | None:
    payload = _upload.Payload("exported", [("program.pt2", archive)])
    with grpc.insecure_channel(address) as channel:
        try:
            nnd_pb2_grpc.NndStub(channel).Upload(payload.messages([0]), timeout=120)
        except grpc.RpcError as err:
            return err
    return None


def _alive(d: Any) -> None:
    assert d.proc.poll() is None
    with grpc.insecure_channel(d.address) as channel:
        nnd_pb2_grpc.NndStub(channel).GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=30)


def test_a_daemon_refuses_the_file_read_and_the_file_write(served, program):
    root, d = served
    secret, created = root / "secret", root / "wd" / "argparse.py"
    secret.write_bytes(b"SECRET42")
    secret.chmod(0o600)
    base = read_program(program[1])
    attempts = {
        "read through a control-flow operand": file_call(base, str(secret), shared=False, size=8),
        "write through a control-flow operand": file_call(base, str(created), shared=True, size=64),
    }
    direct = file_call(base, str(created), shared=True, size=64)  # from_file as the node's own target
    node = direct["graph_module"]["graph"]["nodes"][0]
    node.update(target="torch.ops.aten.from_file.default", is_hop_single_tensor_return=None)
    node["inputs"] = [
        {"name": "filename", "arg": {"as_string": str(created)}, "kind": 1},
        {"name": "shared", "arg": {"as_bool": True}, "kind": 1},
        {"name": "size", "arg": {"as_int": 64}, "kind": 1},
    ]
    attempts["write as an ATen node"] = direct
    for what, crafted in attempts.items():
        err = _upload_rpc(d.address, with_program(program[1], crafted))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        assert "refused" in (err.details() or "") and "SECRET42" not in (err.details() or ""), what
    assert not created.exists()
    assert not [n for n in os.listdir(os.path.join(d.state_dir, "uploads")) if not n.startswith(".")]
    _alive(d)


def test_workers_do_not_import_from_the_daemons_working_directory(served):
    """A file that lands in the daemon's working directory (what the issue's write put there) is
    never imported by a worker started afterwards (python -I, an empty working directory)."""
    root, d = served
    marker = root / "imported"
    (root / "wd" / "argparse.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 2))
        wrapped = nnd.NNsight(net, torch.rand(1, 3), address=d.address, name="iso", device="cpu")
        x = torch.rand(2, 3)
        with wrapped.trace(x):  # starts the model's worker
            out = wrapped[0].output.save()
        assert torch.allclose(out, net(x), atol=1e-6)
    finally:
        (root / "wd" / "argparse.py").unlink()
    assert not marker.exists()
    _alive(d)


# ---------------------------------------------------------------- shape expressions torch writes


class _Flat(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).reshape(-1)[: x.shape[0] * 2 + 1]


def test_composite_size_expressions_load_and_compute(tmp_path):
    """A dynamic batch gives sizes like Mul(Integer(4), Symbol('s..')): the bounded grammar accepts
    what torch writes, and the module computes what the original does."""
    torch.manual_seed(0)
    net = _Flat()
    data = _nnsight.export(net, torch.rand(1, 3))
    exprs = [m for m in re.findall(r'"expr_str": "([^"]*)"', json.dumps(read_program(data)))]
    assert any(e.startswith(("Mul(", "Add(")) for e in exprs), exprs
    path = tmp_path / "program.pt2"
    path.write_bytes(data)
    module = exported._unflatten(exported.load_program(str(path)))
    x = torch.rand(5, 3)
    assert torch.equal(module(x), net(x))


def test_expressions_sympy_writes_are_accepted_and_cheap_ones_only():
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod, PowByNatural

    s0, s1 = sympy.Symbol("s0", positive=True, integer=True), sympy.Symbol("s1", positive=True, integer=True)
    written = [
        FloorDiv(s0, 2) * s1 + sympy.Max(1, s0) ** 2,
        Mod(s0 * s1, 7) + PowByNatural(s0, 3),
        sympy.Eq(s0, 3 * s1 - 1),
        sympy.Rational(1, 2) * s0,
        sympy.Integer(2**62) * s0,
    ]
    for expr in written:
        assert sym_expr.why_not(sympy.srepr(expr)) == "", sympy.srepr(expr)
    refused = {
        "Pow(Symbol('s0'), Symbol('s1'))": "power",
        "Pow(Integer(2), Integer(100000))": "power",
        "PowByNatural(Integer(10), Integer(64))": "",  # 10**64: 213 bits, cheap
        "Mul(" + ", ".join(["Pow(Symbol('s0'), Integer(64))"] * 2) + ")": "bits",
        "LShift(Integer(1), Integer(10000))": "shifts",
        "Symbol('os')": "not a size symbol",
        "getattr(Symbol('s0'), 'x')": "not a size function",
        "Symbol('s0')[0]": "Subscript",
        "(lambda: 1)()": "not a size function",
    }
    for text, why in refused.items():
        assert re.search(why, sym_expr.why_not(text)) if why else sym_expr.why_not(text) == "", text


# ---------------------------------------------------------------- what common modules export to passes


class _Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.pool = torch.nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.nn.functional.gelu(self.bn(self.conv(x)))).flatten(1).softmax(-1)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.att = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(x))
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)  # filled with -inf
        return self.att(h, h, h, attn_mask=causal)[0]


@pytest.mark.parametrize(
    "make",
    [lambda: (_Conv().eval(), torch.rand(1, 3, 8, 8)), lambda: (_Attention().eval(), torch.randint(0, 10, (1, 5)))],
)
def test_common_modules_pass_the_walk_and_compute(tmp_path, make):
    torch.manual_seed(0)
    net, example = make()
    path = tmp_path / "program.pt2"
    path.write_bytes(_nnsight.export(net, example))
    module = exported._unflatten(exported.load_program(str(path)))
    x = torch.cat([example, example])
    assert torch.allclose(module(x), net(x), atol=1e-6)


def test_an_upload_cannot_take_another_models_name(tmp_path):
    store = uploads.UploadStore(_settings(tmp_path))
    sha = "a" * 64
    loaded = {"gpt2": "", "mine": sha}.get  # name -> the upload it was loaded from ("" for none)
    with pytest.raises(errors.AlreadyExists, match="'gpt2' is taken by another model"):
        store.before_load(loaded, nnd_pb2.LoadModelRequest(model="gpt2", upload=sha))
    with pytest.raises(errors.AlreadyExists, match="'mine' is taken"):
        store.before_load(loaded, nnd_pb2.LoadModelRequest(model="mine", upload="b" * 64))
    store.before_load(loaded, nnd_pb2.LoadModelRequest(model="mine", upload=sha))  # the same upload: allowed
    unnamed = nnd_pb2.LoadModelRequest(model="  ", upload=sha)
    store.before_load(loaded, unnamed)
    assert unnamed.model == "upload-aaaaaaaaaaaa"
