"""Results through shared memory (`shm=True`; daemon/worker/shm.py, nnd/_shm.py) against a real daemon.

Whatever happens to the client, its segments are gone afterwards: it unlinks
them itself when it takes the results; a client that exits or is killed
without taking them has them unlinked by the worker after NND_SHM_GRACE_S;
a worker killed with its segments still there has them removed by the daemon.
"""

from __future__ import annotations

import glob
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd
from nnd.v1 import nnd_pb2

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")

BIG = 300_000  # float32 values: 1.2 MB, over the inline limit


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/nnd-{pid}-*")


def _worker_pid(d: Daemon, model: str) -> int:
    info = nnd.connect(d.address).call("GetModel", nnd_pb2.GetModelRequest(model=model))
    return int(info.worker_pids[0])


def _wait_gone(pid: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while _segments(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _segments(pid)


@pytest.fixture
def shm_daemon(
    tmp_path: pathlib.Path, tiny_models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Daemon]:
    monkeypatch.setenv("NND_SHM_GRACE_S", "1")
    d = start_daemon(tmp_path)
    nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
    yield d
    d.stop()


def test_shm_results_equal_streamed_ones_and_leave_nothing(shm_daemon: Daemon, tiny_models: dict[str, str]) -> None:
    model = nnd.TransformersModel(tiny_models["gpt2"], address=shm_daemon.address)

    def run(shm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with model.trace("hello world", shm=shm):
            h = model.transformer.h[0].output
            big = h[0, 0, 0].expand(BIG).clone().save()
            half = h.to(torch.bfloat16).expand(600, -1, -1).contiguous().save()  # bf16, over the limit too
            small = h.save()
        return big, half, small

    streamed, mapped = run(False), run(True)
    for a, b in zip(streamed, mapped, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    mapped[0][0] = 42.0  # writable, and private to this client
    pid = _worker_pid(shm_daemon, tiny_models["gpt2"])
    assert _segments(pid) == []  # taken (unlinked) by the client at once


CLIENT = textwrap.dedent(
    """
    import os, signal, sys
    import grpc
    from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
    address, model, how = sys.argv[1:]
    g = graph_pb2.Graph()
    n = g.nodes.add(id=1)
    n.module.path, n.module.point, n.module.invoke = "transformer.h.0", graph_pb2.OUTPUT, 0
    n = g.nodes.add(id=2)
    n.op.name = "expand"
    n.op.args.add().ref = 1
    for size in (2000, -1, -1):
        n.op.args.add().value.int = size
    n = g.nodes.add(id=3)
    n.op.name = "contiguous"
    n.op.args.add().ref = 2
    g.nodes.add(id=4).save.value.ref = 3
    request = nnd_pb2.TraceRequest(model=model, graph=g, shm=True)
    request.invokes.add(text="hello world")
    stub = nnd_pb2_grpc.NndStub(grpc.insecure_channel(address))
    names = [r.saved.value.tensor.shm for r in stub.Trace(request) if r.WhichOneof("kind") == "saved"]
    print(" ".join(names), flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_segments_a_client_never_took_are_unlinked(shm_daemon: Daemon, tiny_models: dict[str, str], how: str) -> None:
    """A client that got the names but never mapped them (it exited, or was SIGKILLed)."""
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, shm_daemon.address, tiny_models["gpt2"], how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == (-signal.SIGKILL if how == "kill" else 0), proc.stderr
    names = proc.stdout.split()
    assert names and all(n.startswith("nnd-") for n in names)
    pid = _worker_pid(shm_daemon, tiny_models["gpt2"])
    assert _wait_gone(pid, 30) == []


def test_a_killed_worker_leaves_no_segment(
    tmp_path: pathlib.Path, tiny_models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NND_SHM_GRACE_S", "600")  # the worker's own timer would not fire in time
    d = start_daemon(tmp_path)
    try:
        nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
        proc = subprocess.run(
            [sys.executable, "-c", CLIENT, d.address, tiny_models["gpt2"], "exit"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        pid = _worker_pid(d, tiny_models["gpt2"])
        assert len(_segments(pid)) == 1
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone(pid, 30) == []
    finally:
        d.stop()
