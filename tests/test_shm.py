"""Results through shared memory (`shm=True`; daemon/worker/shm.py, nnd/_shm.py) against a real daemon.

Results land in a region the client owns and reuses (`TraceRequest.shm_region`,
what `_shm.attach` asks for once the client knows the sizes), never over a
result still alive; every region is gone after the client exits, killed or
not. Without a usable region (a client's first request, another language's
client, a region that is missing, too small or not a proper file) results are
streamed: the worker never creates shared memory of its own, so nothing of it
outlives a worker or a daemon killed with SIGKILL. What a request names is
checked: a malformed name is refused, and a file that is not a proper region
is never written. (tests/test_shm_users.py: a daemon of another user.)
"""

from __future__ import annotations

import gc
import glob
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import psutil
import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd
from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
from nnd.wire import _results, _shm

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")

BIG = 300_000  # float32 values: 1.2 MB, over the inline limit


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/nnd-{pid}-*")


def _worker_pid(d: Daemon, model: str) -> int:
    info = nnd.connect(d.address).call("GetModel", nnd_pb2.GetModelRequest(model=model))
    return int(info.worker_pids[0])


@pytest.fixture(scope="module")
def shm_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[Daemon]:
    """One daemon for the module: no test here changes daemon-wide state."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NND_SHM_REAP_S", "0.5")  # how often the worker reaps regions of dead clients
        d = start_daemon(tmp_path_factory.mktemp("shm"), in_process=True)
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

    streamed = run(False)
    for _ in range(2):  # the first learns the size (streamed), the second lands in a region
        mapped = run(True)
        for a, b in zip(streamed, mapped, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
    mapped[0][0] = 42.0  # writable
    assert _segments(_worker_pid(shm_daemon, tiny_models["gpt2"])) == []  # the worker made no shared memory


def test_without_a_region_results_are_streamed(shm_daemon: Daemon, tiny_models: dict[str, str]) -> None:
    """What a client of another language gets for `shm` alone: the results, streamed."""
    model = tiny_models["gpt2"]
    want, _ = _run(shm_daemon.address, model, "hello world", shm=False)
    request = _request(model, "hello world")
    request.shm = True
    responses = list(nnd_pb2_grpc.NndStub(grpc.insecure_channel(shm_daemon.address)).Trace(request))
    assert [r for r in responses if r.WhichOneof("kind") == "saved" and r.saved.value.tensor.shm] == []
    assert any(r.WhichOneof("kind") == "chunk" for r in responses)
    assert _equal(_results.collect(iter(responses), use_torch=True).saved, want)
    assert _segments(_worker_pid(shm_daemon, model)) == []


KEEPER = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [sys.argv[3], sys.argv[3] + "/support"]
    import test_shm
    address, model = sys.argv[1:3]
    kept = [test_shm._run(address, model, "hello world", shm=True) for _ in range(2)]  # the 2nd in a region
    print(kept[1][1], flush=True)
    sys.stdin.read()  # results kept alive until the test closes stdin
    """
)


def test_a_killed_daemon_leaves_no_shared_memory(tmp_path: pathlib.Path, tiny_models: dict[str, str]) -> None:
    """SIGKILL of the daemon while a client holds results in shared memory; then a restart."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    old = f"/dev/shm/nnd-{int(dead.stdout)}-1-abcdef01"  # what an older worker left behind, by a pid now gone
    with open(old, "wb") as f:
        f.write(b"x" * 4096)
    d = start_daemon(tmp_path)
    client = None
    try:
        nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
        pid = _worker_pid(d, tiny_models["gpt2"])
        client = subprocess.Popen(
            [sys.executable, "-c", KEEPER, d.address, tiny_models["gpt2"], os.path.dirname(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout is not None
        region = client.stdout.readline().strip()
        assert region and os.path.exists(f"/dev/shm/{region}")  # a result outstanding, in the client's region
        family = psutil.Process(d.proc.pid).children(recursive=True)  # fork server, helper, worker
        assert len(family) >= 3 and any("nnd_daemon.forkserver" in p.cmdline() for p in family)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        deadline = time.monotonic() + 30
        while _shm.alive(pid, 0) and time.monotonic() < deadline:  # the worker follows its daemon
            time.sleep(0.1)
        assert not _shm.alive(pid, 0)
        _, alive = psutil.wait_procs(family, timeout=30)  # and so does every process it started
        assert not alive, [p.cmdline()[:4] for p in alive]
        d = start_daemon(tmp_path, state_dir=d.state_dir)
        assert not os.path.exists(old)  # removed at the start
        assert _segments(pid) == [] and _segments(d.proc.pid) == []
        assert os.path.exists(f"/dev/shm/{region}")  # the live client's region is the client's
    finally:
        if client is not None:
            client.communicate("", timeout=60)
        d.stop()
        if os.path.exists(old):
            os.unlink(old)
    assert client.returncode == 0
    assert not os.path.exists(f"/dev/shm/{region}")  # and it removed it at exit


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
    lease = _shm.attach(request, address) if shm else None
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
    directory = f"nnd-c{os.getpid()}-{start}-{os.urandom(4).hex()}"
    file = f"9{len(kind)}-{os.urandom(16).hex()}"
    target = tmp_path / "target"
    target.mkdir()
    (target / file).write_bytes(b"keep" * 2**18)
    if kind == "linked-directory":
        os.symlink(target, f"/dev/shm/{directory}")
        return f"{directory}/{file}"
    os.mkdir(f"/dev/shm/{directory}", 0o700)
    path = f"/dev/shm/{directory}/{file}"
    if kind == "symlink":
        os.symlink(target / file, path)
    elif kind == "open-directory":  # others could swap the region for a file of theirs
        (pathlib.Path(path)).write_bytes(b"keep" * 2**18)
        os.chmod(f"/dev/shm/{directory}", 0o777)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if kind == "sparse":  # sized but not allocated: a write could SIGBUS on a full /dev/shm
            os.ftruncate(fd, 2**20)
        else:  # "small": allocated, but the results do not fit
            os.posix_fallocate(fd, 0, 4096)
        os.close(fd)
    return f"{directory}/{file}"


@pytest.mark.parametrize("kind", ["symlink", "linked-directory", "open-directory", "sparse", "small"])
def test_an_unusable_region_is_never_written(
    shm_daemon: Daemon, tiny_models: dict[str, str], tmp_path: pathlib.Path, kind: str
) -> None:
    address, model = shm_daemon.address, tiny_models["gpt2"]
    want, _ = _run(address, model, "hello world", shm=False)
    name = _region(tmp_path, kind)
    directory = name.split("/")[0]
    try:
        before = pathlib.Path(f"/dev/shm/{name}").read_bytes()
        request = _request(model, "hello world")
        request.shm, request.shm_region = True, name
        responses = list(nnd_pb2_grpc.NndStub(grpc.insecure_channel(address)).Trace(request))
        places = [r.saved.value.tensor.shm for r in responses if r.WhichOneof("kind") == "saved"]
        assert not any(places)  # streamed instead
        assert pathlib.Path(f"/dev/shm/{name}").read_bytes() == before
        assert _equal(_results.collect(iter(responses), use_torch=True).saved, want)
    finally:
        if os.path.islink(f"/dev/shm/{directory}"):
            os.unlink(f"/dev/shm/{directory}")
        else:
            shutil.rmtree(f"/dev/shm/{directory}")


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "nnd-c1-1-1-abcdef01",  # a region name of older clients
        "nnd-c1-1-abcdef01/../../etc/passwd",
        "nnd-c1-1-abcdef01/1-" + "z" * 32,
        "x" * 300,
    ],
)
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
    sys.path[:0] = [sys.argv[4], sys.argv[4] + "/support"]
    import test_shm
    from nnd.wire import _shm
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
