"""The daemon's packages import along its layers only (docs/architecture.md): control, worker,
helper and the fork server never import one another (the in-process engine for tests, daemon/inprocess.py, is the one
module that joins them), the engine imports none of them, and no daemon module imports the client's
internals (only the contract, nnd.v1, `nnd.__version__` and the `nnd serve` flags, nnd.cli.serve_args)."""

from __future__ import annotations

import ast
import pathlib

DAEMON = pathlib.Path(__file__).resolve().parent.parent / "daemon"
PROCESSES = ("control", "worker", "helper", "forkserver")
# Known crossings, each with its reason. An upload store built without the helper's check (tests
# of the store alone) runs that check in-process; the daemon always passes the helper's.
ALLOWED = {("control/uploads.py", "nnd_daemon.helper.checks")}


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function, as absolute names."""
    package = "nnd_daemon." + ".".join(path.relative_to(DAEMON).parent.parts) if path.parent != DAEMON else "nnd_daemon"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "nnd_daemon" and parts[1] in (*PROCESSES, "engine") else None


def test_control_worker_helper_and_engine_import_along_the_layers():
    wrong = []
    for path in sorted(DAEMON.rglob("*.py")):
        if path.name == "inprocess.py":
            continue
        mine = path.relative_to(DAEMON).parts[0] if len(path.relative_to(DAEMON).parts) > 1 else None
        for module in _imports(path):
            other = _layer(module)
            if other is None or other == mine or (str(path.relative_to(DAEMON)), module.rsplit(".", 1)[0]) in ALLOWED:
                continue
            if (str(path.relative_to(DAEMON)), module) in ALLOWED:
                continue
            if mine in PROCESSES and other == "engine" and mine != "control":
                continue  # workers and the helper run the engine
            if mine in PROCESSES or mine == "engine" or other in PROCESSES:
                wrong.append(f"{path.relative_to(DAEMON)} imports {module}")
    assert wrong == []


def test_the_daemon_imports_only_the_clients_contract():
    wrong = [
        f"{path.relative_to(DAEMON)} imports {module}"
        for path in sorted(DAEMON.rglob("*.py"))
        for module in _imports(path)
        if module.split(".")[0] == "nnd"
        and not module.startswith("nnd.v1")
        and module not in ("nnd", "nnd.__version__", "nnd.cli", "nnd.cli.serve_args")
    ]
    assert wrong == []
