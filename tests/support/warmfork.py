"""Python subprocesses of the suite, forked from a warm process instead of exec'd.

An nnsight reference run or an in-process daemon spends about 5 s of its CPU importing torch and
transformers before its first line of work; the suite starts about thirty of them on 2 cores. One
warm process per pytest process (warmfork_server.py) imports those once and forks each child from
that state, as the daemon's fork server does for workers.

A forked child is what `python SCRIPT ARGS` would be: the script's folder first on sys.path, its own
argv, environment, folder, stdout and stderr, non-daemon threads and atexit handlers run at its end,
and its exit status as Popen reports it (-N for signal N). It is exec'd as before whenever forking
could change what runs: a command that is not `sys.executable SCRIPT.py ...`, an environment that
differs from the warm process's in anything but `_FREE` (the rest may be read at import time), or a
warm process that did not start or is unsafe to fork.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

# The daemon's Popen-like handle on a fork server's child: the same relation as ours to the warm process's.
from nnd_daemon.control.forking import ForkedProcess as Forked

_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warmfork_server.py")
# What the forked scripts import: nnsight's references, inprocess_daemon.py. nnsight itself is not
# preloaded (its import patches torch, and daemons fork from here too); it adds 0.1 s to a reference.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "grpc",
    "nnd.cli",
    "nnd_daemon.control.cli_serve",
    "nnd_daemon.inprocess",
)
# Environment a child may differ in: applied after the fork, or read by no import (pytest sets one per
# test; torch sets the inductor cache folder in this process, and reads it only when it compiles).
_FREE = frozenset({"OMP_NUM_THREADS", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


class _Warm:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.asking = threading.Lock()  # one spawn in flight: its reply is the next one read
        self.table = threading.Lock()  # children and early, shared with the reader
        self.replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.children: dict[int, Forked] = {}  # reported by the warm process, which reaps them
        self.early: dict[int, int] = {}  # exits read before their spawn's reply was handed over
        self.next_id = 0
        self.proc = subprocess.Popen(
            [sys.executable, _SERVER, json.dumps(PRELOAD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,  # a test's killpg of its own group leaves it alone
        )
        assert self.proc.stdout is not None
        first = json.loads(self.proc.stdout.readline() or b'{"ready": false, "why": "it exited"}')
        self.ready: bool = first["ready"]
        self.started = self.ready  # it came up (`ready` goes False again if it dies)
        self.why: str = first["why"]
        if self.ready:
            threading.Thread(target=self._read, name="warmfork", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if "code" in message:
                with self.table:
                    child = self.children.pop(message["pid"], None)
                    if child is None:
                        self.early[message["pid"]] = message["code"]
                if child is not None:
                    child._exited(message["code"])
            else:
                self.replies.put(message)
        self.ready = False  # it died (its children would be orphans no one reaps for us): end them
        with self.table:
            orphans, self.children = list(self.children.values()), {}
        for child in orphans:
            child.kill()
            child._exited(-signal.SIGKILL)

    def forkable(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        return not self.why_not(argv, env)

    def why_not(self, argv: Sequence[str], env: Mapping[str, str]) -> str:
        """Why `argv` with `env` would be exec'd instead of forked ("" if it would be forked)."""
        if not self.ready:
            return f"the warm process is gone (exit status {self.proc.poll()})"
        if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
            return "not `python SCRIPT.py ...`"
        differ = sorted(k for k in (set(env) | set(self.env)) - _FREE if env.get(k) != self.env.get(k))
        return f"its environment differs from the warm process's in {differ}" if differ else ""

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout: str, stderr: str | None) -> Forked:
        request = {
            "script": argv[1],
            "args": list(argv[2:]),
            "env": dict(env),
            "cwd": cwd,
            "stdout": stdout,
            "stderr": stderr,
        }
        with self.asking:
            self.next_id += 1
            request["id"] = self.next_id
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self.replies.get(timeout=60)
            if "error" in reply:
                raise OSError(reply["error"])
            child = Forked(reply["pid"])
            with self.table:
                code = self.early.pop(child.pid, None)
                if code is None:
                    self.children[child.pid] = child
        if code is not None:
            child._exited(code)
        return child


class _Off:
    """NND_TEST_WARMFORK=0: every subprocess exec'd (to compare, or to rule the fork out)."""

    ready = False
    why = "NND_TEST_WARMFORK=0"

    def forkable(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        return False

    def why_not(self, argv: Sequence[str], env: Mapping[str, str]) -> str:
        return self.why


_warm: _Warm | _Off | None = None
_start = threading.Lock()


def _the_warm() -> _Warm | _Off:
    global _warm
    with _start:
        if _warm is None:
            _warm = _Warm() if os.environ.get("NND_TEST_WARMFORK", "1") != "0" else _Off()
            if not _warm.ready:
                print(f"warmfork: subprocesses exec ({_warm.why})", file=sys.stderr)
        return _warm


def popen(
    argv: Sequence[str], *, stdout: str, stderr: str | None = None, env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> Forked | subprocess.Popen:
    """Start `argv` with its output appended to the file `stdout` (and `stderr`, default: the same)."""
    environ = dict(os.environ if env is None else env)
    warm = _the_warm()
    if warm.forkable(argv, environ):
        return warm.spawn(argv, environ, cwd or os.getcwd(), stdout, stderr)
    with open(stdout, "ab") as out:
        if stderr is None:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=cwd)
        with open(stderr, "ab") as err:
            return subprocess.Popen(argv, stdout=out, stderr=err, env=environ, cwd=cwd)


def run(
    argv: Sequence[str], *, timeout: float, check: bool = False, text: bool = False,
    env: Mapping[str, str] | None = None, cwd: str | None = None,
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, ...)`, forked where it can be."""
    with tempfile.TemporaryDirectory(prefix="warmfork-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = popen(argv, stdout=out, stderr=err, env=env, cwd=cwd)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
        output: Any = open(out, "rb").read()
        errors: Any = open(err, "rb").read()
    if text:
        output, errors = output.decode(errors="replace"), errors.decode(errors="replace")
    result = subprocess.CompletedProcess(list(argv), code, output, errors)
    if check:
        result.check_returncode()
    return result
