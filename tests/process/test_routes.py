"""Routes: a local client sends Trace/Generate/Session straight to the model's
worker, the daemon only steers (protos/nnd/v1/nnd.proto, Route). Against real
daemons: the daemon carries no data request of a route-following client, a
client that does not follow routes still works through it, a killed worker or
a restarted daemon is re-routed around with nothing run twice, the worker's
socket is guarded like the daemon's (file mode, token), and keep-alive and
`nnd ps` see traffic that never passed through the daemon."""

from __future__ import annotations

import os
import pathlib
import signal
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import tinymodels
from daemonproc import Daemon, start_daemon

from nnd import errors
from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
from nnd.wire.connection import Connection

TOKEN = "route-token-for-tests"


def _ids(k: int, n: int) -> nnd_pb2.Invoke:
    return nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[(7 * k + i) % 50 + 1 for i in range(n)]))


def _trace(model: str) -> nnd_pb2.TraceRequest:
    """The logits of a fixed prompt."""
    graph = graph_pb2.Graph()
    graph.nodes.add(id=1, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT))
    graph.nodes.add(id=2, save=graph_pb2.Save(value=graph_pb2.Arg(ref=1)))
    return nnd_pb2.TraceRequest(model=model, invokes=[_ids(0, 6)], graph=graph)


def _saved(responses: Any) -> bytes:
    saved = [r.saved.value.tensor.data for r in responses if r.HasField("saved")]
    assert len(saved) == 1 and saved[0]
    return saved[0]


def _info(conn: Connection, model: str) -> nnd_pb2.ModelInfo:
    return conn.call("GetModel", nnd_pb2.GetModelRequest(model=model), timeout=60)


def _wait_for(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _path(address: str) -> str:
    assert address.startswith("unix://"), address
    return address[len("unix://") :]


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("routes"))
    d.cli("load", tiny_models["gpt2"])
    d.cli("dispatch", tiny_models["gpt2"])
    yield d
    assert d.stop() == 0


def test_route_is_followed_and_the_daemon_carries_no_trace(routed, tiny_models):
    model = tiny_models["gpt2"]
    conn = Connection(routed.address)
    try:
        route = _info(conn, model).route
        assert route.address and route.epoch
        direct = [_saved(conn.stream("Trace", _trace(model), timeout=60)) for _ in range(3)]
        assert conn.router.direct_calls == 3
        assert "forwarding" not in routed.log()  # nothing passed through the daemon
        assert _info(conn, model).worker_requests == 3  # the worker counted them, once each

        # A client that does not follow routes (a plain stub on the daemon) gets the same bytes, forwarded.
        channel = grpc.insecure_channel(routed.address)
        forwarded = _saved(nnd_pb2_grpc.NndStub(channel).Trace(_trace(model), timeout=60))
        channel.close()
        assert direct == [forwarded] * 3
        assert "forwarding Trace" in routed.log()
        assert _info(conn, model).worker_requests == 4

        # The worker checks what the daemon checked: limits, edits, aliases.
        with pytest.raises(errors.InvalidRequest, match="has no input"):
            list(conn.stream("Trace", nnd_pb2.TraceRequest(model=model), timeout=60))
        with pytest.raises(errors.ModelNotFound, match="no stored edit"):
            list(conn.stream("Trace", nnd_pb2.TraceRequest(model=model, invokes=[_ids(0, 3)], edits=["nope"])))
        aliased = _trace(model)
        aliased.graph.nodes[0].module.path = "layers.1"  # the standard alias of transformer.h.1
        aliased.graph.nodes[0].module.point = graph_pb2.OUTPUT
        assert _saved(conn.stream("Trace", aliased, timeout=60))
    finally:
        conn.close()


def test_worker_socket_is_guarded_like_the_daemons(routed, tiny_models):
    conn = Connection(routed.address)
    try:
        path = _path(_info(conn, tiny_models["gpt2"]).route.address)
    finally:
        conn.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o777 == 0o750
    dirs = {p.name: stat.S_IMODE(p.stat().st_mode) for p in pathlib.Path(os.path.dirname(path)).iterdir() if p.is_dir()}
    assert dirs.pop("private") == 0o700  # the Worker service: the daemon's only
    assert all(not mode & 0o022 for mode in dirs.values()), dirs  # empty working directories: no one else writes


def test_a_route_out_of_reach_falls_back_to_the_daemon(routed, tiny_models):
    """A worker socket this client cannot reach (moved out of its sight; the worker still serves
    it): the route is fetched again, fails again, and the request goes through the daemon, which
    forwards it; later calls of that epoch go there at once. Same bytes; run once each."""
    model = tiny_models["gpt2"]
    conn = Connection(routed.address)
    try:
        want = _saved(conn.stream("Trace", _trace(model), timeout=60))  # direct, opens the route
        before = _info(conn, model).worker_requests
        route = _info(conn, model).route
        socks = [_path(route.address), _path(route.fast_address)]  # both out of sight, as in another namespace
        conn.router.close()  # an open connection would survive the move
        for sock in socks:
            os.rename(sock, sock + ".away")
        try:
            got = [_saved(conn.stream("Trace", _trace(model), timeout=60)) for _ in range(2)]
        finally:
            for sock in socks:
                os.rename(sock + ".away", sock)
        assert got == [want, want]
        assert conn.router.fallbacks == 1 and conn.router.direct_calls == 3  # 1 direct, 2 failed tries, then none
        assert f"forwarding Trace of {model}" in routed.log()
        assert _info(conn, model).worker_requests == before + 2
    finally:
        conn.close()


def test_stale_epoch_is_refused_before_anything_runs(routed, tiny_models):
    model = tiny_models["gpt2"]
    conn = Connection(routed.address)
    try:
        route = _info(conn, model).route
        before = _info(conn, model).worker_requests
        channel = grpc.insecure_channel(route.address)
        with pytest.raises(grpc.RpcError) as caught:
            list(
                nnd_pb2_grpc.NndStub(channel).Trace(
                    _trace(model), metadata=[("nnd-epoch", str(route.epoch - 1))], timeout=60
                )
            )
        channel.close()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("nnd-route", "stale") in tuple(caught.value.trailing_metadata())
        assert _info(conn, model).worker_requests == before
    finally:
        conn.close()


def test_killed_worker_is_rerouted_with_nothing_run_twice(routed, tmp_path, tiny_models):
    # The module's daemon, with a model no other test uses: what is killed and counted is its own.
    model = tinymodels.private_copy(tiny_models["gpt2"], tmp_path)
    d = routed
    conn = Connection(d.address)
    try:
        d.cli("load", model)
        d.cli("dispatch", model)
        first = _info(conn, model)
        before = _saved(conn.stream("Trace", _trace(model), timeout=60))
        os.kill(first.worker_pids[0], signal.SIGKILL)
        _wait_for("META", lambda: _info(conn, model).state == nnd_pb2.META)
        # The cached route is dead: the client asks the daemon again, which dispatches the model.
        assert _saved(conn.stream("Trace", _trace(model), timeout=120)) == before
        again = _info(conn, model)
        assert again.state == nnd_pb2.DISPATCHED and again.route.epoch != first.route.epoch
        assert again.worker_requests == 1  # run once, on the new worker
        assert _saved(conn.stream("Trace", _trace(model), timeout=60)) == before
        assert _info(conn, model).worker_requests == 2  # and the next one goes to it directly
    finally:
        conn.close()
        d.cli("unload", model, check=False)


def test_worker_killed_mid_request_is_reported_not_rerun(routed, tmp_path, long_gpt2):
    model = tinymodels.private_copy(long_gpt2, tmp_path)  # the module's daemon, a model of its own
    d = routed
    conn = Connection(d.address)
    try:
        d.cli("load", model)
        d.cli("dispatch", model)
        pid = _info(conn, model).worker_pids[0]
        options = nnd_pb2.GenerateOptions(max_new_tokens=1000, do_sample=True, seed=1)
        long = nnd_pb2.TraceRequest(model=model, invokes=[_ids(k, 8) for k in range(16)], generate=options)
        running = conn.stream("Generate", long, timeout=120)
        assert next(running).HasField("step")  # it runs on the worker, sent there directly
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(errors.DaemonUnavailable) as caught:
            list(running)
        text = str(caught.value)
        assert "killed by SIGKILL" in text and "while running this request" in text, text
        assert conn.router.direct_calls == 1  # reported, not resent
        # The next request finds no worker, goes to the daemon, which dispatches the model again.
        assert _saved(conn.stream("Trace", _trace(model), timeout=120))
        assert _info(conn, model).worker_requests == 1
    finally:
        conn.close()
        d.cli("unload", model, check=False)


def test_restarted_daemon_is_rerouted(tmp_path, tiny_models):
    model = tiny_models["gpt2"]
    # Workers as threads of the daemon: they end with it all the same, and a dispatch starts no process.
    d = start_daemon(tmp_path, in_process=True)
    conn = Connection(d.address)
    try:
        d.cli("load", model)
        d.cli("dispatch", model)
        epoch = _info(conn, model).route.epoch
        before = _saved(conn.stream("Trace", _trace(model), timeout=60))
        assert d.stop() == 0  # its workers end with it
        d = start_daemon(tmp_path, state_dir=d.state_dir, in_process=True)  # same socket; restores and re-dispatches
        assert _saved(conn.stream("Trace", _trace(model), timeout=120)) == before
        info = _info(conn, model)
        assert info.route.epoch != epoch and info.worker_requests == 1
    finally:
        conn.close()
        assert d.stop() == 0


def test_worker_socket_needs_the_daemons_token(tmp_path, tiny_models):
    model = tiny_models["gpt2"]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    d = start_daemon(tmp_path, "--token-file", str(token_file), token=TOKEN, in_process=True)
    conn = Connection(d.address, token=TOKEN)
    try:
        conn.call("LoadModel", nnd_pb2.LoadModelRequest(model=model, dispatch=True), timeout=120)
        route = _info(conn, model).route
        channel = grpc.insecure_channel(route.address)
        stub = nnd_pb2_grpc.NndStub(channel)
        for metadata in ([], [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Trace(_trace(model), metadata=metadata, timeout=60))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        assert _info(conn, model).worker_requests == 0
        assert _saved(conn.stream("Trace", _trace(model), timeout=60))
        assert conn.router.direct_calls == 1 and _info(conn, model).worker_requests == 1
    finally:
        conn.close()
        assert d.stop() == 0


def test_keep_alive_and_idle_time_see_direct_traffic(tmp_path, tiny_models):
    model = tiny_models["gpt2"]
    d = start_daemon(tmp_path, "--keep-alive", "3s", in_process=True)
    conn = Connection(d.address)
    try:
        d.cli("load", model)
        d.cli("dispatch", model)
        # The worker's epoch, not its pid: these workers are threads of the daemon (the pid is the daemon's).
        epoch = _info(conn, model).route.epoch
        _wait_for("an idle second", lambda: _info(conn, model).idle_s > 1.0)
        start = time.time()
        # Traffic that never passes through the daemon, for longer than the keep-alive:
        # the model stays dispatched on the same worker.
        while time.time() - start < 5:
            assert _saved(conn.stream("Trace", _trace(model), timeout=60))
        info = _info(conn, model)
        assert info.state == nnd_pb2.DISPATCHED and info.route.epoch == epoch
        assert info.idle_s <= time.time() - start  # idle since the last direct trace, not since dispatch
        assert "forwarding" not in d.log()
        # Once traffic stops, the keep-alive still ends it.
        _wait_for("keep-alive expiry", lambda: _info(conn, model).state == nnd_pb2.META, timeout=60)
    finally:
        conn.close()
        assert d.stop() == 0
