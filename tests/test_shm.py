"""Results through shared memory (`shm=True`; daemon/worker/shm.py, nnd/_shm.py) against a real daemon.

Two ways in. With a region (`TraceRequest.shm_region`, what `_shm.attach`
asks for once the client knows the sizes): results land in memory the client
owns and reuses, never over a result still alive, and every region is gone
after the client exits, killed or not. Without one (a client's first request,
or another language's client): one fresh segment per tensor, which the client
unlinks itself when it takes the results; a client that exits or is killed
without taking them has them unlinked by the worker after NND_SHM_GRACE_S; a
worker killed with its segments still there has them removed by the daemon.
What a request names is checked: a malformed name is refused, and a file that
is not a proper region is never written.
"""

from __future__ import annotations

import gc
import glob
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd
from nnd import _results, _shm
from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc

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
    monkeypatch.setenv("NND_SHM_REAP_S", "0.5")  # how often the worker reaps regions of dead clients
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


# ------------------------------------------------------------------ client regions


def _request(model: str, text: str, copies: int = 600) -> nnd_pb2.TraceRequest:
    """Saves h0.expand(copies, -1, -1) as float32 (saved by node 7, ~300 KB) and as bfloat16 (node 5), and h0 (node 6)."""
    g = graph_pb2.Graph()
    n = g.nodes.add(id=1)
    n.module.path, n.module.point, n.module.invoke = "transformer.h.0", graph_pb2.OUTPUT, 0
    n = g.nodes.add(id=2)
    n.op.name = "expand"
    n.op.args.add().ref = 1
    for size in (copies, -1, -1):
        n.op.args.add().value.int = size
    n = g.nodes.add(id=3)
    n.op.name = "contiguous"
    n.op.args.add().ref = 2
    n = g.nodes.add(id=4)
    n.op.name = "bfloat16"
    n.op.args.add().ref = 3
    g.nodes.add(id=5).save.value.ref = 4
    g.nodes.add(id=6).save.value.ref = 1
    g.nodes.add(id=7).save.value.ref = 3
    request = nnd_pb2.TraceRequest(model=model, graph=g)
    request.invokes.add(text=text)
    return request


def _run(address: str, model: str, text: str, *, shm: bool) -> tuple[dict[int, torch.Tensor], str]:
    """The saved values by node id, and the region the request named ("" if none), as the tracer runs it."""
    request = _request(model, text)
    request.shm = shm
    lease = _shm.attach(request) if shm else None
    results = _results.collect(nnd.connect(address).stream("Trace", request), use_torch=True, lease=lease)
    return results.saved, request.shm_region


def _equal(got: dict[int, torch.Tensor], want: dict[int, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
    )


def _leased(name: str) -> bool:
    pool = _shm.pool()
    return name in pool.regions and name not in {r.name for r in pool.free}


def test_results_land_in_a_reused_region_never_over_a_live_one(shm_daemon: Daemon, tiny_models: dict[str, str]) -> None:
    address, model = shm_daemon.address, tiny_models["gpt2"]
    want_a, _ = _run(address, model, "hello world", shm=False)
    want_b, _ = _run(address, model, "world hello", shm=False)
    assert not torch.equal(want_a[7], want_b[7])
    _run(address, model, "hello world", shm=True)  # the pool learns how much room results take

    a, region_a = _run(address, model, "hello world", shm=True)
    assert region_a and _equal(a, want_a)
    assert _leased(region_a)  # a's tensors are views of it: it stays out of the pool while they live
    b, region_b = _run(address, model, "world hello", shm=True)
    assert region_b and region_b != region_a
    assert _equal(b, want_b) and _equal(a, want_a)  # b did not overwrite a

    a[7][0, 0, 0] = 42.0  # writable
    del a, b
    gc.collect()
    assert not _leased(region_a) and not _leased(region_b)
    again, region = _run(address, model, "hello world", shm=True)
    assert region in (region_a, region_b)  # reused: memory already faulted in, on both sides
    assert _equal(again, want_a)
    assert _segments(_worker_pid(shm_daemon, model)) == []  # everything fit: no fresh segment


def _region(tmp_path: pathlib.Path, kind: str) -> str:
    """A file under a valid region name of this (live) process that is not a usable region."""
    start = _shm.process_start(os.getpid()) or 0
    name = f"nnd-c{os.getpid()}-{start}-9{len(kind)}-{os.urandom(4).hex()}"
    path = f"/dev/shm/{name}"
    if kind == "symlink":
        target = tmp_path / "target"
        target.write_bytes(b"keep" * 2**18)
        os.symlink(target, path)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if kind == "sparse":  # sized but not allocated: a write could SIGBUS on a full /dev/shm
            os.ftruncate(fd, 2**20)
        else:  # "small": allocated, but the results do not fit
            os.posix_fallocate(fd, 0, 4096)
        os.close(fd)
    return name


@pytest.mark.parametrize("kind", ["symlink", "sparse", "small"])
def test_an_unusable_region_is_never_written(
    shm_daemon: Daemon, tiny_models: dict[str, str], tmp_path: pathlib.Path, kind: str
) -> None:
    address, model = shm_daemon.address, tiny_models["gpt2"]
    want, _ = _run(address, model, "hello world", shm=False)
    name = _region(tmp_path, kind)
    try:
        before = pathlib.Path(f"/dev/shm/{name}").read_bytes()
        request = _request(model, "hello world")
        request.shm, request.shm_region = True, name
        responses = list(nnd_pb2_grpc.NndStub(grpc.insecure_channel(address)).Trace(request))
        places = [r.saved.value.tensor.shm for r in responses if r.WhichOneof("kind") == "saved"]
        assert name not in places and any(places)  # fresh segments instead
        assert pathlib.Path(f"/dev/shm/{name}").read_bytes() == before
        assert _equal(_results.collect(iter(responses), use_torch=True).saved, want)
    finally:
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("name", ["../../etc/passwd", "nnd-c1-1-1-zzzzzzzz", "nnd-1-2-abcdef01", "x" * 300])
def test_a_malformed_region_name_is_refused(shm_daemon: Daemon, tiny_models: dict[str, str], name: str) -> None:
    request = _request(tiny_models["gpt2"], "hello world")
    request.shm, request.shm_region = True, name
    with pytest.raises(grpc.RpcError) as err:
        list(nnd_pb2_grpc.NndStub(grpc.insecure_channel(shm_daemon.address)).Trace(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shm_region" in err.value.details()


REGION_CLIENT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[4])
    import test_shm
    from nnd import _shm
    address, model, how = sys.argv[1:4]
    kept = [test_shm._run(address, model, "hello world", shm=True) for _ in range(3)]  # 2 regions in use
    print(os.getpid(), " ".join(region for _, region in kept), flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_regions_are_gone_after_the_client_exits(shm_daemon: Daemon, tiny_models: dict[str, str], how: str) -> None:
    """Unlinked at exit by the client; after a SIGKILL by the worker's janitor (NND_SHM_REAP_S)."""
    proc = subprocess.run(
        [sys.executable, "-c", REGION_CLIENT, shm_daemon.address, tiny_models["gpt2"], how, os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == (-signal.SIGKILL if how == "kill" else 0), proc.stderr
    pid, *regions = proc.stdout.split()
    assert len([r for r in regions if r]) == 2
    left = f"/dev/shm/nnd-c{pid}-*"
    if how == "exit":
        assert glob.glob(left) == []
    else:
        deadline = time.monotonic() + 30
        while glob.glob(left) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert glob.glob(left) == []
