"""Shared fixtures: tiny local models, and a real `nnd serve` subprocess on a
temporary unix socket."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tinymodels  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny gpt2, llama and bert models with real tokenizers."""
    root = tmp_path_factory.mktemp("models")
    return {kind: str(tinymodels.build(kind, root / kind)) for kind in ("gpt2", "llama", "bert")}


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


def start_daemon(tmp: pathlib.Path, *extra: str, state_dir: str | None = None, ready_timeout: float = 60) -> Daemon:
    """Start `nnd serve` on a socket under `tmp` and wait until it answers."""
    import grpc

    from nnd.v1 import nnd_pb2, nnd_pb2_grpc

    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "run" / "nnd.sock"
    state = state_dir or str(tmp / "state")
    address = f"unix://{sock}"
    log_path = str(tmp / "daemon.log")
    args = ["serve", "--address", address, "--state-dir", state, "--log-level", "INFO", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nnd.cli", *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + ready_timeout
    channel = grpc.insecure_channel(address)
    stub = nnd_pb2_grpc.NndStub(channel)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nnd serve exited ({proc.returncode}):\n{pathlib.Path(log_path).read_text()}")
            try:
                stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"nnd serve did not answer:\n{pathlib.Path(log_path).read_text()}") from None
                time.sleep(0.1)
    finally:
        channel.close()
    return Daemon(address=address, state_dir=state, proc=proc, log_path=log_path, args=args)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the whole session (tests that kill or restart it use
    `start_daemon` for their own)."""
    d = start_daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(tmp_path: pathlib.Path) -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that change daemon-wide state."""
    d = start_daemon(tmp_path)
    yield d
    d.stop()
