"""Workers and helpers forked from the daemon's fork server (control/forking.py, nnd_daemon/forkserver).

A forked child must be what exec would have started: the same module, command line, environment,
working directory and log, its exit status and signals reported as Popen's, never outliving the fork
server or the daemon. Where the fork server cannot serve, starts fall back to exec; `--worker-start
exec` turns it off. The fork server's own environment never holds the workers' secrets.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd
from nnd_daemon.control import forking
from nnd_daemon.control.supervisor import TOKEN_ENV
from nnd_daemon.forkserver.__main__ import fork_unsafe

PROMPT = "The quick brown fox"
# Stdlib modules stand in for a worker: what a child ran, saw and exited with is visible from outside.
LIGHT = ("json",)


def _timeit(statement: str) -> list[str]:
    return ["-n", "1", "-r", "1", statement]


@pytest.fixture
def server(tmp_path) -> Iterator[forking.ForkServer]:
    (tmp_path / "logs").mkdir()
    forks = forking.ForkServer(str(tmp_path), str(tmp_path / "logs"), preload=LIGHT, start_timeout_s=60)
    forks.start()
    yield forks
    forks.close()


def _log(tmp_path, name: str = "child.log"):
    return open(tmp_path / name, "ab")


def test_a_child_runs_the_module_with_its_arguments_environment_and_directory(server, tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "in.json").write_text('{"b": [1, 2]}')
    check = (
        "import os, sys; "
        f"assert os.getcwd() == {str(tmp_path / 'work')!r}, os.getcwd(); "
        "assert os.environ['NND_TEST_VALUE'] == 'forty two'; assert 'PATH' not in os.environ; "
        "os._exit(int(os.environ['NND_TEST_CODE']))"
    )
    with _log(tmp_path) as log:
        child = server.spawn(
            "timeit", _timeit(check), env={"NND_TEST_VALUE": "forty two", "NND_TEST_CODE": "7"},
            cwd=str(tmp_path / "work"), log_fd=log.fileno(),
        )
        assert child is not None, server.why
        assert child.wait(30) == 7, (tmp_path / "child.log").read_text()
        assert child.poll() == 7
        # What the module prints goes to the log it was given: a relative path resolves in its directory.
        pretty = server.spawn("json.tool", ["in.json"], env={}, cwd=str(tmp_path / "work"), log_fd=log.fileno())
        assert pretty is not None and pretty.wait(30) == 0
    assert json.loads((tmp_path / "child.log").read_text()) == {"b": [1, 2]}
    assert server.forked == 2


def test_a_signalled_child_reads_as_popen_would_and_a_module_error_is_logged(server, tmp_path):
    with _log(tmp_path) as log:
        sleeper = server.spawn("timeit", _timeit("import time; time.sleep(120)"), env={}, cwd=str(tmp_path),
                               log_fd=log.fileno())
        assert sleeper is not None
        assert psutil.Process(sleeper.pid).ppid() == server.pid
        with pytest.raises(Exception, match="pid"):
            sleeper.wait(0.2)  # subprocess.TimeoutExpired, as Popen.wait raises it
        sleeper.kill()
        assert sleeper.wait(30) == -signal.SIGKILL
        sleeper.kill()  # a second signal to an ended child reaches nobody (pidfd: never a reused pid)
        broken = server.spawn("json.tool", ["missing.json"], env={}, cwd=str(tmp_path), log_fd=log.fileno())
        assert broken is not None and broken.wait(30) != 0
    assert "missing.json" in (tmp_path / "child.log").read_text()


def test_without_pidfds_a_child_is_signalled_by_pid(server, tmp_path, monkeypatch):
    def refused(pid: int, flags: int = 0) -> int:
        raise PermissionError(1, "Operation not permitted")  # as under a seccomp filter without pidfd_open

    monkeypatch.setattr(os, "pidfd_open", refused)
    with _log(tmp_path) as log:
        sleeper = server.spawn("timeit", _timeit("import time; time.sleep(120)"), env={}, cwd=str(tmp_path),
                               log_fd=log.fileno())
    assert sleeper is not None
    sleeper.terminate()
    assert sleeper.wait(30) == -signal.SIGTERM


def test_a_fork_server_that_cannot_serve_leaves_starts_to_exec(tmp_path):
    (tmp_path / "logs").mkdir()
    forks = forking.ForkServer(str(tmp_path), str(tmp_path / "logs"), preload=("no_such_module_here",))
    forks.start()
    try:
        with _log(tmp_path) as log:
            assert forks.spawn("json.tool", ["--help"], env={}, cwd=str(tmp_path), log_fd=log.fileno()) is None
            assert "no_such_module_here" in forks.why
            proc = forking.spawn(forks, [sys.executable, "-I", "-m", "json.tool", "--help"], env=None,
                                 cwd=str(tmp_path), logf=log)
            assert proc.wait(30) == 0 and psutil.Process().pid != proc.pid
        assert "json.tool" in (tmp_path / "child.log").read_text()
    finally:
        forks.close()


def test_a_fork_server_that_stops_answering_is_ended_and_starts_go_to_exec(server, tmp_path, monkeypatch):
    with _log(tmp_path) as log:
        assert server.spawn("json.tool", ["--help"], env={}, cwd=str(tmp_path), log_fd=log.fileno()) is not None
        monkeypatch.setattr(forking, "REPLY_TIMEOUT_S", 1.0)
        os.kill(server.pid, signal.SIGSTOP)  # stopped: it reads nothing, forks nothing
        assert server.spawn("json.tool", ["--help"], env={}, cwd=str(tmp_path), log_fd=log.fileno()) is None
    assert "did not answer" in server.why
    # Killed: a late fork could not start a worker nobody tracks. Already reaped is gone too (the
    # check used to fail when the kill and reap beat it).
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(server.pid).wait(10)
    with _log(tmp_path) as log:
        assert server.spawn("json.tool", ["--help"], env={}, cwd=str(tmp_path), log_fd=log.fileno()) is None


def test_state_that_must_not_be_forked_is_named():
    assert fork_unsafe("7f00 r-xp /usr/lib/libc.so.6\n", 1, False) == ""
    assert "2 Python threads" in fork_unsafe("", 2, False)
    assert "CUDA" in fork_unsafe("7f00 r-xp /usr/lib/x86_64-linux-gnu/libcuda.so.560.35\n", 1, False)
    assert "CUDA" in fork_unsafe("", 1, True)


# ---------------------------------------------------------------- through a daemon


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("forked")
    (tmp / "token").write_text("fork-secret\n")
    os.chmod(tmp / "token", 0o600)
    d = start_daemon(tmp, "--token-file", str(tmp / "token"), token="fork-secret")
    yield d
    d.stop()


def _fork_server(d: Daemon) -> psutil.Process:
    (server,) = [p for p in psutil.Process(d.proc.pid).children() if "nnd_daemon.forkserver" in p.cmdline()]
    return server


def _worker(d: Daemon) -> psutil.Process:
    (worker,) = [
        p for p in psutil.Process(d.proc.pid).children(recursive=True) if "-m nnd_daemon.worker" in " ".join(p.cmdline())
    ]
    return worker


def _reference(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    seen = {}
    hf.transformer.h[1].register_forward_hook(lambda m, i, o: seen.setdefault("h", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        hf(**AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt"))
    return seen["h"]


def _trace(d: Daemon, path: str) -> torch.Tensor:
    model = nnd.TransformersModel(path, address=d.address, device="cpu", token="fork-secret")
    with model.trace(PROMPT):
        h = model.transformer.h[1].output.save()
    return h


def test_a_forked_worker_serves_real_numbers_and_never_the_fork_server_holds_the_token(forked, tiny_models):
    path = tiny_models["gpt2"]
    torch.testing.assert_close(_trace(forked, path), _reference(path))
    server, worker = _fork_server(forked), _worker(forked)
    assert worker.ppid() == server.pid and server.ppid() == forked.proc.pid
    assert worker.cmdline()[1:4] == ["-I", "-m", "nnd_daemon.worker"]
    # The route's token reaches the worker in its environment (it answered above); the fork server,
    # which outlives every worker, never has it.
    with open(f"/proc/{server.pid}/environ", "rb") as f:
        assert TOKEN_ENV.encode() not in f.read()
    helpers = [p for p in server.children() if "nnd_daemon.helper" in p.cmdline()]
    assert helpers, "the helper forks from the fork server too"


def test_a_killed_fork_server_takes_its_workers_and_the_next_trace_starts_one_by_exec(forked, tiny_models):
    path = tiny_models["gpt2"]
    _trace(forked, path)
    server, worker = _fork_server(forked), _worker(forked)
    server.kill()
    gone, alive = psutil.wait_procs([worker], timeout=15)  # the worker follows its fork server (parentwatch)
    assert worker in gone, "a forked worker outlived its fork server"
    deadline = time.monotonic() + 15  # the daemon hears of it (the fork server's end), the model goes back to META
    while time.monotonic() < deadline:
        models = json.loads(forked.cli("ps", "--json", "--token", "fork-secret").stdout)
        if {m["name"]: m for m in models}[path]["state"] == "META":
            break
        time.sleep(0.2)
    torch.testing.assert_close(_trace(forked, path), _reference(path))
    assert _worker(forked).ppid() == forked.proc.pid  # exec'd, as before there was a fork server
    assert "workers start by exec" in forked.log()


def test_worker_start_exec_starts_workers_as_children_of_the_daemon(tmp_path, tiny_models):
    d = start_daemon(tmp_path, "--worker-start", "exec")
    try:
        path = tiny_models["gpt2"]
        model = nnd.TransformersModel(path, address=d.address, device="cpu")
        with model.trace(PROMPT):
            h = model.transformer.h[1].output.save()
        torch.testing.assert_close(h, _reference(path))
        assert _worker(d).ppid() == d.proc.pid
        assert not [p for p in psutil.Process(d.proc.pid).children() if "nnd_daemon.forkserver" in p.cmdline()]
    finally:
        d.stop()
