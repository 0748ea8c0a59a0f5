"""Faults against a real daemon: a worker killed mid-request, clients that go
away mid-request, a worker that stops answering, and a busy worker that must
not be mistaken for a hung one. The daemon stays up through all of them and
`nnd ps` says what happened.

The daemon here pings its workers every 0.5 s with a 1 s timeout, and calls a
worker hung after 3 misses (about 4.5 s); it re-dispatches a hung model once
per 10 minutes (--restart-limit 1). See docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psutil
import pytest
from daemonproc import Daemon, start_daemon

from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc

WATCHDOG = ["--watchdog-interval", "0.5", "--watchdog-timeout", "1", "--watchdog-misses", "3", "--restart-limit", "1"]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, long_gpt2: str) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("faults"), *WATCHDOG)
    d.cli("load", long_gpt2)
    d.cli("dispatch", long_gpt2)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def stub(faulty: Daemon) -> Iterator[nnd_pb2_grpc.NndStub]:
    with grpc.insecure_channel(faulty.address) as channel:
        yield nnd_pb2_grpc.NndStub(channel)


# ---------------------------------------------------------------- helpers


def _ids(k: int, n: int) -> nnd_pb2.Invoke:
    return nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[(7 * j + 13 * k) % 300 + 5 for j in range(n)]))


def _generation(model: str, invokes: int = 16, tokens: int = 1000) -> nnd_pb2.TraceRequest:
    """About ten seconds of generation, one Step message per token."""
    options = nnd_pb2.GenerateOptions(max_new_tokens=tokens, do_sample=True, seed=1)
    return nnd_pb2.TraceRequest(model=model, invokes=[_ids(k, 8) for k in range(invokes)], generate=options)


def _long_trace(model: str, invokes: int = 64, length: int = 1000) -> nnd_pb2.TraceRequest:
    """A forward of a few seconds that sends nothing until it is done, with a
    hook (where the engine notices a cancel) at every sub-module of every block."""
    graph = graph_pb2.Graph()
    paths = [f"transformer.h.{i}.{m}" for i in range(4) for m in ("ln_1", "attn", "ln_2", "mlp")]
    for i, path in enumerate(paths, start=1):
        graph.nodes.add(id=i, module=graph_pb2.ModuleValue(path=path, point=graph_pb2.OUTPUT))
    graph.nodes.add(id=100, op=graph_pb2.Op(name="sum", args=[graph_pb2.Arg(ref=len(paths))]))
    graph.nodes.add(id=101, save=graph_pb2.Save(value=graph_pb2.Arg(ref=100)))
    return nnd_pb2.TraceRequest(model=model, invokes=[_ids(k, length) for k in range(invokes)], graph=graph)


def _small_trace(model: str) -> nnd_pb2.TraceRequest:
    """The logits of a fixed prompt."""
    graph = graph_pb2.Graph()
    graph.nodes.add(id=1, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT))
    graph.nodes.add(id=2, save=graph_pb2.Save(value=graph_pb2.Arg(ref=1)))
    return nnd_pb2.TraceRequest(model=model, invokes=[_ids(0, 6)], graph=graph)


def _logits(stub: nnd_pb2_grpc.NndStub, model: str) -> bytes:
    out = list(stub.Trace(_small_trace(model), timeout=120))
    saved = [r.saved.value.tensor.data for r in out if r.HasField("saved")]
    assert len(saved) == 1 and saved[0]
    return saved[0]


def _outcome(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _model(stub: nnd_pb2_grpc.NndStub, name: str) -> nnd_pb2.ModelInfo:
    (info,) = [m for m in stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=30).models if m.name == name]
    return info


def _wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _running(stub: nnd_pb2_grpc.NndStub, request: nnd_pb2.TraceRequest) -> Any:
    """A long Generate, once its first step has come back (it has the model)."""
    call = stub.Generate(request, timeout=120)
    first = next(call)
    assert first.HasField("step"), first
    return call


# ---------------------------------------------------------------- a worker killed


def test_kill_9_fails_running_and_queued_requests_and_the_model_comes_back(faulty, stub, long_gpt2):
    model = long_gpt2
    before = _logits(stub, model)
    pid = _model(stub, model).worker_pids[0]
    with ThreadPoolExecutor(3) as pool:
        # A long forward holds the model (a generation would lend it between steps); two traces queue behind it.
        running = pool.submit(_outcome, lambda: list(stub.Trace(_long_trace(model), timeout=120)))
        _wait_for("the long trace running", lambda: [r.state for r in _model(stub, model).requests] == ["running"], 30)
        queued = [pool.submit(_outcome, lambda: list(stub.Trace(_small_trace(model), timeout=120))) for _ in range(2)]
        states = lambda: [r.state for r in _model(stub, model).requests]  # noqa: E731
        _wait_for("two traces queued", lambda: states() == ["running", "queued", "queued"], 30)
        os.kill(pid, signal.SIGKILL)
        code, text = running.result(timeout=60)
        print("\nrunning:", text)
        assert code == grpc.StatusCode.UNAVAILABLE, text
        assert "killed by SIGKILL" in text and "while running this request" in text, text
        for future in queued:
            code, text = future.result(timeout=60)
            assert code == grpc.StatusCode.UNAVAILABLE, text
            assert "killed by SIGKILL" in text and "before this request ran" in text and "safe to retry" in text, text
        print("queued:", text)

    assert faulty.proc.poll() is None  # the daemon stays up
    info = _wait_for("META", lambda: (m := _model(stub, model)).state == nnd_pb2.META and m, 10)
    assert "worker died: killed by SIGKILL" in info.last_error and not info.worker_pids
    table = faulty.cli("ps").stdout
    assert "META" in table and "worker died: killed by SIGKILL" in table, table

    # The next request dispatches it again, as it was, and gets the same numbers.
    assert _logits(stub, model) == before
    info = _model(stub, model)
    assert info.state == nnd_pb2.DISPATCHED and info.worker_pids[0] != pid
    assert info.last_error.startswith("re-dispatched") and "SIGKILL" in info.last_error, info.last_error


# ---------------------------------------------------------------- a client that goes away

CLIENT = """
import sys, grpc
from nnd.v1 import nnd_pb2, nnd_pb2_grpc
request = nnd_pb2.TraceRequest.FromString(sys.stdin.buffer.read())
stub = nnd_pb2_grpc.NndStub(grpc.insecure_channel(sys.argv[1]))
call = (stub.Generate if sys.argv[2] == "generate" else stub.Trace)(request, timeout=120)
print("sent", flush=True)
for _ in call:
    print("step", flush=True)
"""


@pytest.fixture(scope="module")
def long_trace_s(stub: nnd_pb2_grpc.NndStub, long_gpt2: str) -> float:
    """How long the long trace takes to run to the end on this box now: the yardstick for
    "stopped early" below, so a loaded box (where everything is slower) is not a failure."""
    started = time.monotonic()
    list(stub.Trace(_long_trace(long_gpt2), timeout=300))
    return time.monotonic() - started


@pytest.mark.parametrize("kind", ["generate", "trace"])
def test_a_killed_client_frees_the_worker_at_once(faulty, stub, long_gpt2, long_trace_s, kind):
    """The daemon cancels the worker's call when its client goes away, even a
    Trace that has sent nothing yet; the engine stops at its next hook."""
    model = long_gpt2
    request = _generation(model) if kind == "generate" else _long_trace(model)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, faulty.address, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=False,
        env=env,
    )
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(request.SerializeToString())
    client.stdin.close()
    assert client.stdout.readline().strip() == b"sent"
    if kind == "generate":
        assert client.stdout.readline().strip() == b"step"  # it has the model
    else:
        time.sleep(1.0)  # a few seconds of forward still to go
    client.kill()
    client.wait()
    started = time.monotonic()
    _logits(stub, model)  # waits for the model: only as long as the cancelled request takes to stop
    waited = time.monotonic() - started
    print(f"\n{kind}: the worker was free {waited:.2f} s after its client was killed")
    # A generation stops at its next step (1000 steps take ten seconds or more); a trace at its next
    # hook: well before the rest of its forward (a third of a whole one, measured on this box now).
    bound = 1.5 if kind == "generate" else max(1.5, long_trace_s / 3)
    assert waited < bound, f"the worker went on with a dead client's {kind} for {waited:.1f} s (bound {bound:.1f} s)"
    assert faulty.proc.poll() is None


# ---------------------------------------------------------------- busy is not hung


def test_a_busy_worker_is_not_taken_for_a_hung_one(faulty, stub, long_gpt2):
    """Requests waiting for a model each hold a gRPC thread, in the daemon and in
    the worker. When they outnumbered the worker's threads, the watchdog's
    Status pings found none and a busy worker was killed as hung; when they
    outnumbered the daemon's, `nnd ps` and health checks got no answer."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    model = long_gpt2
    pid = _model(stub, model).worker_pids[0]
    running = _running(stub, _generation(model))
    with ThreadPoolExecutor(40) as pool:
        waiting = [pool.submit(_outcome, lambda: list(stub.Trace(_small_trace(model), timeout=120))) for _ in range(40)]
        time.sleep(1.0)
        # Starved of threads, these got no answer while the generation held the model: they must answer
        # while it still runs (checked after), however slowly a loaded machine answers.
        assert _model(stub, model).state == nnd_pb2.DISPATCHED  # `nnd ps` answers
        with grpc.insecure_channel(faulty.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert running.is_active(), "the generation ended first"
        time.sleep(5.0)  # longer than the watchdog takes to call a worker hung (3 x 1.5 s)
        running.cancel()
        outcomes = [w.result(timeout=60) for w in waiting]
    assert all(code == grpc.StatusCode.OK for code, _ in outcomes), outcomes
    info = _model(stub, model)
    assert info.state == nnd_pb2.DISPATCHED and info.worker_pids[0] == pid, info.last_error
    assert "hung" not in faulty.log()


# ---------------------------------------------------------------- a worker that stops answering


def test_a_hung_worker_is_replaced_until_the_restart_limit(faulty, stub, long_gpt2):
    model = long_gpt2
    before = _logits(stub, model)
    pid = _model(stub, model).worker_pids[0]
    with ThreadPoolExecutor(2) as pool:
        # A long forward holds the model (a generation would lend it between steps); a trace queues behind it.
        running = pool.submit(_outcome, lambda: list(stub.Trace(_long_trace(model), timeout=120)))
        states = lambda: [r.state for r in _model(stub, model).requests]  # noqa: E731
        _wait_for("the long trace running", lambda: states() == ["running"], 30)
        queued = pool.submit(_outcome, lambda: list(stub.Trace(_small_trace(model), timeout=120)))
        _wait_for("a trace queued", lambda: states() == ["running", "queued"], 30)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code, text = running.result(timeout=60)
        detected = time.monotonic() - stopped
        print(f"\nhung worker found after {detected:.1f} s: {text}")
        assert code == grpc.StatusCode.UNAVAILABLE and "hung" in text and "while running this request" in text, text
        assert detected > 2.5  # not before the watchdog missed its answers (no upper bound: that is load)
        code, text = queued.result(timeout=60)
        assert code == grpc.StatusCode.UNAVAILABLE and "hung" in text and "before this request ran" in text, text

    _wait_for("the hung worker to be gone", lambda: _gone(pid), 10)
    # Re-dispatched at once, with nobody asking. (Until the daemon has handled the exit it still
    # lists the dead worker as the model's: wait for a new one, not for any DISPATCHED.)
    info = _wait_for(
        "the re-dispatch",
        lambda: (m := _model(stub, model)).state == nnd_pb2.DISPATCHED and m.worker_pids[:1] not in ([], [pid]) and m,
        60,
    )
    assert info.last_error.startswith("re-dispatched") and "worker hung" in info.last_error, info.last_error
    assert "re-dispatched" in faulty.cli("ps").stdout
    assert _logits(stub, model) == before

    # Hung again within 10 minutes: past --restart-limit 1, it stays META and says why.
    pid = info.worker_pids[0]
    os.kill(pid, signal.SIGSTOP)
    info = _wait_for("META", lambda: (m := _model(stub, model)).state == nnd_pb2.META and m, 20)
    assert "worker hung" in info.last_error and "not re-dispatched" in info.last_error, info.last_error
    _wait_for("the hung worker to be gone", lambda: _gone(pid), 10)
    time.sleep(1.0)
    assert _model(stub, model).state == nnd_pb2.META
    assert _logits(stub, model) == before  # a request still brings it back
    assert faulty.proc.poll() is None
