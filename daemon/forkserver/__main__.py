"""Fork server entry: `python -I -m nnd_daemon.forkserver --control FD`.

Started by the daemon (control/forking.py), never by hand. FD is one end of a
SOCK_SEQPACKET pair only the daemon holds (no path anyone could connect to).
The first message names the modules to import ({"preload": [...]}: torch,
transformers, the worker's and the helper's code); it then says whether its
state can be forked and serves spawn requests. A request is JSON {module,
args, env, cwd} with the child's log file descriptor attached; the child runs
`python -I -m module args` as the daemon would have started it, from this
imported state, and shows that command line in `ps` (setproctitle). Replies
and events are JSON: {"ready": bool, "why"} once, {"pid"} or {"error"} per
request, {"exit": pid, "code"} as each child ends (Popen's returncode: -N for
signal N).

Forking is only safe from one Python thread and before any CUDA context
exists (the CUDA driver cannot be used in a forked child): where the preloaded
state breaks either, it answers "not ready" and the daemon execs as before.
The server ends when the daemon does (its end of the pair closes); children
that outlive it end too (parentwatch.py follows the fork server's life).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import selectors
import shlex
import signal
import socket
import sys
import threading
import traceback
import warnings
from typing import Any

MAX_MESSAGE = 1 << 20


def fork_unsafe(maps: str, python_threads: int, cuda_initialized: bool) -> str:
    """Why this process's state must not be forked ("" if it may): a second Python thread (it may
    hold a lock the child then never sees released), or a CUDA driver loaded in it."""
    if python_threads > 1:
        return f"{python_threads} Python threads are running in it"
    if cuda_initialized or "libcuda.so" in maps:
        return "the CUDA driver is loaded in it (a forked child could not use the GPU)"
    return ""


def _state_unsafe() -> str:
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    return fork_unsafe(maps, threading.active_count(), cuda)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _child(sock: socket.socket, owned: list[int], request: dict[str, Any], log_fd: int) -> None:
    """In the forked child: become `python -m module args` with the request's environment. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in owned:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.chdir(request["cwd"])
        _retitle([sys.executable, "-I", "-m", request["module"], *request["args"]])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        # A preloaded package's __main__ runs afresh as __main__, as `python -m` would (runpy warns otherwise).
        sys.modules.pop(request["module"] + ".__main__", None)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the module raised goes to its log, as Python would print it
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the log may be gone; the exit code still says it
                pass
        os._exit(code)


def _retitle(argv: list[str]) -> None:
    """Show the command line exec would have given the child (`ps`, psutil, `nnd ps` users)."""
    setproctitle = sys.modules.get("setproctitle")  # imported at start, while argv and environ are as exec left them
    if setproctitle is not None:  # an optional nicety: the process works the same without it
        setproctitle.setproctitle(shlex.join(argv))
        setproctitle.setthreadtitle(os.path.basename(argv[0])[:15])  # the process's name (top, pgrep), as before


def _spawn(sock: socket.socket, owned: list[int]) -> None:
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
    if not data:
        raise EOFError
    try:
        request = json.loads(data)
        if len(fds) != 1:
            raise ValueError("a spawn request carries exactly one file descriptor (the child's log)")
    except ValueError as exc:
        for fd in fds:
            os.close(fd)
        _send(sock, {"error": f"malformed spawn request: {exc}"})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # What was preloaded lives as long as every child: frozen, no child's collections walk it (~400,000
    # objects, 100-250 ms a full collection), and collecting never writes to the pages children share.
    gc.freeze()
    try:
        with warnings.catch_warnings():  # 3.12+ warns of C threads (OpenBLAS's pools, fork-safe by their own handlers)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        os.close(fds[0])
        _send(sock, {"error": f"fork failed: {exc}"})
        return
    if pid == 0:
        _child(sock, owned, request, fds[0])
    os.close(fds[0])
    _send(sock, {"pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> None:
    """Answer spawn requests and report children's ends until the daemon closes its end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    owned = [wake_r, wake_w, selector.fileno()]
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                _reap(sock)
            else:
                try:
                    _spawn(sock, owned)
                except (EOFError, ConnectionError):
                    return  # the daemon has gone; so do we (children follow: parentwatch.py)


def main() -> None:
    parser = argparse.ArgumentParser(prog="nnd-forkserver", description=__doc__)
    parser.add_argument("--control", type=int, required=True, help="the daemon's end of a SOCK_SEQPACKET pair")
    ns = parser.parse_args()
    try:
        import setproctitle  # noqa: F401 - see _retitle
    except ImportError:
        pass
    sock = socket.socket(fileno=ns.control)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torch.cuda.is_available() asks NVML instead of the CUDA driver, so an import that calls it does not
    # load the driver here (a forked child could not use the GPU then); children get the daemon's env.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        first = sock.recv(MAX_MESSAGE)
    except ConnectionError:
        return
    if not first:
        return
    why = ""
    for name in json.loads(first).get("preload", []):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - without it the daemon execs as before
            why = f"importing {name} failed: {exc!r}"
            break
    why = why or _state_unsafe()
    try:
        _send(sock, {"ready": not why, "why": why})
        if not why:
            serve(sock)
    except (BrokenPipeError, ConnectionError):
        pass


if __name__ == "__main__":
    main()
