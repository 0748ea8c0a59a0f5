"""A real `nnd serve` subprocess for tests: start it, drive it with the CLI, stop it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass, field

_PROCESSES = ("-m", "nnd.cli")  # nnd serve itself
_IN_PROCESS = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "inprocess_daemon.py"),)


@dataclass
class Daemon:
    """A running `nnd serve` process."""

    address: str
    state_dir: str
    proc: subprocess.Popen
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
) -> Daemon:
    """Start `nnd serve` on a socket under `tmp` and wait until it answers (`prefix`: a command that
    runs it, e.g. setpriv as another user; `env`: added to the environment; `token`: the one it answers to;
    `in_process`: its workers and helper run as threads of the daemon's process, nnd_daemon/inprocess.py)."""
    import grpc

    from nnd.v1 import nnd_pb2, nnd_pb2_grpc

    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "run" / "nnd.sock"
    state = state_dir or str(tmp / "state")
    address = f"unix://{sock}"
    log_path = str(tmp / "daemon.log")
    args = ["serve", "--address", address, "--state-dir", state, "--log-level", "INFO", *extra]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, *(_IN_PROCESS if in_process else _PROCESSES), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=cwd,
        )
    deadline = time.monotonic() + ready_timeout
    channel = grpc.insecure_channel(address)
    stub = nnd_pb2_grpc.NndStub(channel)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nnd serve exited ({proc.returncode}):\n{pathlib.Path(log_path).read_text()}")
            try:
                auth = [("authorization", f"Bearer {token}")] if token else []
                stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=1, metadata=auth)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"nnd serve did not answer:\n{pathlib.Path(log_path).read_text()}") from None
                time.sleep(0.1)
    finally:
        channel.close()
    return Daemon(address=address, state_dir=state, proc=proc, log_path=log_path, args=args)
