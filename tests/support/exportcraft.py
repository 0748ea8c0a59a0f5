"""Crafted torch.export archives for the upload-safety tests: a real `torch.export.save`
archive of a small module, its program JSON edited (tests/test_upload_safety.py,
tests/test_export_fuzz.py)."""

from __future__ import annotations

import copy
import io
import json
import zipfile
from collections.abc import Callable
from typing import Any

PROGRAM_ENTRY = "models/model.json"


def read_program(archive: bytes) -> dict[str, Any]:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        name = next(n for n in z.namelist() if n.endswith(PROGRAM_ENTRY))
        return json.loads(z.read(name))


def rewrite(archive: bytes, change: Callable[[dict[str, bytes]], None]) -> bytes:
    """The archive with `change(entries)` applied to {name: bytes}."""
    src = zipfile.ZipFile(io.BytesIO(archive))
    entries = {info.filename: src.read(info) for info in src.infolist()}
    change(entries)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, content in entries.items():
            z.writestr(name, content)
    return out.getvalue()


def with_program(archive: bytes, program: dict[str, Any]) -> bytes:
    def change(entries: dict[str, bytes]) -> None:
        name = next(n for n in entries if n.endswith(PROGRAM_ENTRY))
        entries[name] = json.dumps(program).encode()

    return rewrite(archive, change)


def edited(archive: bytes, edit: Callable[[dict[str, Any]], Any]) -> bytes:
    program = read_program(archive)
    edit(program)
    return with_program(archive, program)


def _positional(arg: dict[str, Any]) -> dict[str, Any]:
    return {"name": "", "arg": arg, "kind": 1}


def file_call(program: dict[str, Any], path: str, *, shared: bool, size: int) -> dict[str, Any]:
    """`program` with a first node that calls aten.from_file(path) through the control-flow operator
    wrap_with_set_grad_enabled (it calls its operand with the rest) and returns the bytes as a
    second output: the issue's file read (shared=False) and file write (shared=True creates the
    file, mapped for writing). torch's own loader runs it when the module runs."""
    out = copy.deepcopy(program)
    gm = out["graph_module"]
    graph = gm["graph"]
    graph["nodes"].insert(
        0,
        {
            "target": "torch.ops.higher_order.wrap_with_set_grad_enabled",
            "inputs": [
                _positional({"as_bool": False}),
                _positional({"as_operator": "torch.ops.aten.from_file.default"}),
                _positional({"as_string": path}),
                _positional({"as_bool": shared}),
                _positional({"as_int": size}),
                {"name": "dtype", "arg": {"as_scalar_type": 1}, "kind": 2},
            ],
            "outputs": [{"as_tensor": {"name": "leak"}}],
            "metadata": {"nn_module_stack": graph["nodes"][0]["metadata"]["nn_module_stack"].split(";")[0]},
            "is_hop_single_tensor_return": True,
        },
    )
    graph["tensor_values"]["leak"] = {
        "dtype": 1,
        "sizes": [{"as_int": size}],
        "requires_grad": False,
        "device": {"type": "cpu", "index": None},
        "strides": [{"as_int": 1}],
        "storage_offset": {"as_int": 0},
        "layout": 7,
    }
    graph["outputs"].append({"as_tensor": {"name": "leak"}})
    gm["signature"]["output_specs"].append({"user_output": {"arg": {"as_tensor": {"name": "leak"}}}})
    for entry in gm["module_call_graph"]:  # the root's output tree: one more leaf
        if entry["fqn"] == "" and entry["signature"]:
            entry["signature"]["out_spec"] = json.dumps(
                [
                    1,
                    {
                        "type": "builtins.tuple",
                        "context": "null",
                        "children_spec": [{"type": None, "context": None, "children_spec": []}] * 2,
                    },
                ]
            )
    return out
