"""A real `nnd serve` subprocess for tests: start it, drive it with the CLI, stop it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass, field

import warmfork

_PROCESSES = ("-m", "nnd.cli")  # nnd serve itself
_IN_PROCESS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "inprocess_daemon.py"),)


@dataclass
class Daemon:
    """A running `nnd serve` process."""

    address: str
    state_dir: str
    proc: subprocess.Popen | warmfork.Forked
    log_path: str
    args: list[str] = field(default_factory=list)

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `nnd ARGS --address <this daemon>`."""
        cmd = [sys.executable, "-m", "nnd.cli", *args, "--address", self.address]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def log(self) -> str:
        return pathlib.Path(self.log_path).read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def serve_args(tmp: pathlib.Path, *extra: str, state_dir: str | None = None) -> list[str]:
    """`nnd serve` on the socket tmp/run/nnd.sock with its state in `state_dir` (default tmp/state)."""
    state = state_dir or str(tmp / "state")
    return ["serve", "--address", f"unix://{tmp / 'run' / 'nnd.sock'}", "--state-dir", state, *extra]


def run_serve(
    tmp: pathlib.Path, *extra: str, state_dir: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run `nnd serve` where it is expected to exit by itself (a refused start): its exit status and output."""
    cmd = [sys.executable, "-m", "nnd.cli", *serve_args(tmp, *extra, state_dir=state_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def start_daemon(
    tmp: pathlib.Path,
    *extra: str,
    state_dir: str | None = None,
    ready_timeout: float = 60,
    prefix: tuple[str, ...] = (),
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    token: str = "",
    in_process: bool = False,
    ready: str = "info",
) -> Daemon:
    """Start `nnd serve` on a socket under `tmp` and wait until it is ready (`prefix`: a command that
    runs it, e.g. setpriv as another user; `env`: added to the environment; `token`: the one it answers to;
    `in_process`: its workers and helper run as threads of the daemon's process, nnd_daemon/inprocess.py;
    `ready`: "info" once GetServerInfo answers (with `token`), "health" once the health check (open to
    all) answers, "socket" as soon as the socket exists)."""
    tmp.mkdir(parents=True, exist_ok=True)
    state = state_dir or str(tmp / "state")
    args = serve_args(tmp, "--log-level", "INFO", *extra, state_dir=state)
    address = args[args.index("--address") + 1]
    log_path = str(tmp / "daemon.log")
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [*prefix, sys.executable, *(_IN_PROCESS if in_process else _PROCESSES), *args]
    proc: subprocess.Popen | warmfork.Forked
    if in_process:  # its semantics are the test's subject, not its process start: fork it warm
        proc = warmfork.popen(command, stdout=log_path, env=environ, cwd=cwd)
    else:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=cwd)
    d = Daemon(address=address, state_dir=state, proc=proc, log_path=log_path, args=args)
    answers = {"info": _info_answers, "health": _health_answers, "socket": _socket_exists}[ready]
    deadline = time.monotonic() + ready_timeout
    while not answers(address, token):
        if proc.poll() is not None:
            raise RuntimeError(f"nnd serve exited ({proc.returncode}):\n{d.log()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"nnd serve did not answer:\n{d.log()}")
        time.sleep(0.01 if ready == "socket" else 0.1)
    return d


def _info_answers(address: str, token: str) -> bool:
    import grpc

    from nnd.v1 import nnd_pb2, nnd_pb2_grpc

    auth = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        try:
            nnd_pb2_grpc.NndStub(channel).GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=1, metadata=auth)
        except grpc.RpcError:
            return False
    return True


def _health_answers(address: str, token: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return True


def _socket_exists(address: str, token: str) -> bool:
    return os.path.exists(address.removeprefix("unix://"))
