"""The warm process of tests/support/warmfork.py: import what the suite's subprocesses import, then
fork one child per request and run its script in it.

Protocol, JSON lines: the first line out is {"ready": bool, "why": str}. Then each line in is
{"id", "script", "args", "env", "cwd", "stdout", "stderr"} (paths; stderr null: with stdout), answered
by {"id", "pid"} or {"id", "error"}; when a child ends, {"pid", "code"} (Popen's code: -N for signal
N). End of input ends the warm process and kills the children it still has.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import selectors
import signal
import sys
import threading
import traceback
from typing import Any


def _say(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _child(request: dict[str, Any], wake: tuple[int, int], sel: selectors.BaseSelector) -> None:
    """In the forked child: become `python SCRIPT ARGS`. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sel.close()  # the warm process's own descriptors are no child's business
        for fd in wake:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        out = os.open(request["stdout"], flags, 0o644)
        err = os.open(request["stderr"], flags, 0o644) if request["stderr"] else out
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads:  # read once as torch was imported here; a fresh process would have read the child's
            import torch

            torch.set_num_threads(int(threads))
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts it
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as Python would, the exit status says it
        traceback.print_exc()
    finally:
        try:  # what an interpreter's own exit does: wait for non-daemon threads, run atexit
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def main() -> None:
    for name in json.loads(sys.argv[1]):
        importlib.import_module(name)
    if threading.active_count() > 1:
        _say({"ready": False, "why": f"{threading.active_count()} threads after the imports: forking is unsafe"})
        return
    wake = os.pipe()
    os.set_blocking(wake[0], False)
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake[0], selectors.EVENT_READ)
    _say({"ready": True, "why": ""})
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake[0]:
                while True:
                    try:
                        if not os.read(wake[0], 512):
                            break
                    except BlockingIOError:
                        break
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    children.discard(pid)
                    _say({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data = os.read(0, 1 << 16)
            if not data:
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    _say({"id": request["id"], "error": f"fork failed: {exc}"})
                    continue
                if pid == 0:
                    _child(request, wake, sel)
                children.add(pid)
                _say({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    main()
