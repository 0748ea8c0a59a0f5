"""The client's layers (docs/architecture.md): wire < tracing < models < cli, each importing only the
ones below it. Every client module is imported alone, in an interpreter where no nnd module was
imported before, and may load no module of a layer above its own: an import cycle between layers
fails here. (Imports inside functions, made when a call needs them, are not import time and are
not checked.)"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parents[2] / "pyclient" / "nnd"
ORDER = ["wire", "tracing", "models", "cli"]

# One fresh interpreter, the third-party libraries imported once; a forked child per module imports it
# alone and reports the nnd modules it loaded.
_PROBE = r"""
import json, os, sys
import grpc, numpy, google.protobuf  # noqa: F401 - not nnd: shared by every child
out = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            loaded = sorted(m for m in sys.modules if m == "nnd" or m.startswith("nnd."))
            msg = {"loaded": loaded}
        except BaseException as exc:
            msg = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(msg).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    out[name] = json.loads(data)
print(json.dumps(out))
"""


def _layer(module: str) -> int:
    """A module's layer, by the subpackage it lives in; -1 below them all (nnd, nnd.errors, nnd.v1)."""
    parts = module.split(".")
    return ORDER.index(parts[1]) if len(parts) > 1 and parts[1] in ORDER else -1


def _modules() -> list[str]:
    names = []
    for layer in ORDER:
        for path in sorted((PKG / layer).glob("*.py")):
            if path.name != "__main__.py":
                names.append(f"nnd.{layer}" if path.stem == "__init__" else f"nnd.{layer}.{path.stem}")
    return names


def test_the_client_is_split_into_its_layers():
    flat = sorted(p.stem for p in PKG.glob("*.py"))
    assert flat == ["__init__", "errors"]  # everything else lives in a layer
    assert {_layer(m) for m in _modules()} == set(range(len(ORDER)))


def test_each_client_module_imports_no_layer_above_its_own():
    modules = _modules()
    res = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout)
    wrong = {}
    for module in modules:
        got = report[module]
        assert "error" not in got, (module, got)
        above = [m for m in got["loaded"] if _layer(m) > _layer(module)]
        if above:
            wrong[module] = above
    assert wrong == {}
