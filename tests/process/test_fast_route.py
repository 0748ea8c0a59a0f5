"""The route's fast socket (nnd.proto, Route.fast_address; daemon/worker/fastroute.py) against real
daemons: traces, generations and sessions go there and give the gRPC route's numbers (and a plain
PyTorch hook's); its errors read as the gRPC route's; it keeps the route's guards: file mode, the
daemon's token, connections bounded per uid (a refused client takes the gRPC route), a frame sent in
part is cut off after the request idle timeout, and a client that goes away mid-call cancels it."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import stat
import struct
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

import nnd
from nnd import errors
from nnd.v1 import contract, nnd_pb2
from nnd.wire.connection import Connection
from tests.support.daemonproc import Daemon, start_daemon
from tests.support.fastframes import frame as _frame
from tests.support.fastframes import reply as _reply

PROMPT = "The Eiffel Tower is in"
PER_UID = 4  # --max-waiting-calls of the module's daemon: the fast socket's connections per uid
IDLE_S = 2  # its --request-idle-timeout


@pytest.fixture(scope="module")
def fastd(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[tuple[Daemon, Any]]:
    d = start_daemon(
        tmp_path_factory.mktemp("fast"), "--max-waiting-calls", str(PER_UID), "--request-idle-timeout", str(IDLE_S)
    )
    model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
    yield d, model
    d.stop()


def _route(d: Daemon, model: str) -> nnd_pb2.Route:
    conn = Connection(d.address)
    try:
        return conn.call("GetRoute", nnd_pb2.RouteRequest(model=model), timeout=60)
    finally:
        conn.close()


def _path(address: str) -> str:
    assert address.startswith("unix://"), address
    return address[len("unix://") :]


@contextlib.contextmanager
def _over_grpc(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The model's calls take the gRPC route meanwhile (NND_FAST=0 as the route is fetched again)."""
    router = model._conn.router
    monkeypatch.setenv("NND_FAST", "0")
    router.close()  # forget the route: the next call fetches it again, without its fast socket
    fast, direct = router.fast_calls, router.direct_calls
    try:
        yield router
    finally:
        monkeypatch.delenv("NND_FAST")
        router.close()
    assert router.fast_calls == fast and router.direct_calls > direct


def _worker_log(d: Daemon, model: str) -> str:
    return d.cli("logs", model, "--bytes", "200000").stdout


def _connect(path: str) -> tuple[socket.socket, bytes]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    return sock, sock.recv(1)


def _call(method: str, request: Any, metadata: list[tuple[str, str]]) -> bytes:
    call = nnd_pb2.FastCall(method=method, metadata=[nnd_pb2.FastMetadata(key=k, value=v) for k, v in metadata])
    return _frame(call.SerializeToString(), request.SerializeToString())


def _closed(sock: socket.socket) -> bool:
    """Whether the worker closed the connection (within the socket's 30 s timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _hooked(path: str) -> dict[str, torch.Tensor]:
    """Plain transformers with forward hooks: block 1's output and the logits for PROMPT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    got: dict[str, torch.Tensor] = {}
    hf.transformer.h[1].register_forward_hook(lambda _m, _i, out: got.__setitem__("h1", out.detach().clone()))
    with torch.no_grad():
        got["logits"] = hf(**tok(PROMPT, return_tensors="pt")).logits
    return got


def test_traces_generations_and_sessions_take_the_fast_socket_with_the_grpc_routes_numbers(
    fastd, tiny_models, monkeypatch
):
    d, model = fastd
    router = model._conn.router
    before = (router.fast_calls, router.once_calls)
    with model.trace(PROMPT):
        h1 = model.transformer.h[1].output.save()
        logits = model.lm_head.output.save()
    assert (router.fast_calls, router.once_calls) == (before[0] + 1, before[1] + 1)  # a TraceOnce, framed
    want = _hooked(tiny_models["gpt2"])
    torch.testing.assert_close(h1, want["h1"], rtol=1e-5, atol=1e-6)  # one torch thread there, more here
    torch.testing.assert_close(logits, want["logits"], rtol=1e-5, atol=1e-6)


    def run() -> tuple[torch.Tensor, ...]:  # an edit, a generation with a save per step, and a session
        with model.trace(PROMPT):
            model.transformer.h[0].output[:] = 0
            edited = model.lm_head.output.save()
            # over 256 KiB: the fast socket's answer goes out gathered (onemessage.Gathered), gRPC's joined
            big = model.transformer.h[1].output.expand(2000, -1, -1).save()
        steps: list[torch.Tensor] = []
        with model.generate(PROMPT, max_new_tokens=4) as tracer:
            for _ in tracer.iter[:]:
                steps.append(model.transformer.h[1].output[0, -1].save())
            tokens = model.generator.output.save()
        with model.session():
            with model.trace(PROMPT):
                first = model.transformer.h[1].output.save()
            with model.trace(PROMPT):
                model.transformer.h[1].output[:] = first * 2
                doubled = model.lm_head.output.save()
        return edited, torch.stack(list(steps)), tokens, doubled, big

    fast = run()
    assert router.fast_calls >= before[0] + 4
    with _over_grpc(model, monkeypatch):
        slow = run()
    for ours, theirs in zip(fast, slow, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert len(fast[1]) == 4


def test_sync_points_take_the_fast_socket_with_the_grpc_routes_numbers(fastd, monkeypatch):
    d, model = fastd
    router = model._conn.router

    def run() -> tuple[float, torch.Tensor, float]:
        seen: list[float] = []
        with model.trace(PROMPT):
            first = model.transformer.h[0].output[0, -1, 0].item()  # a sync point: the run pauses here
            seen.append(first)
            if first > 0:  # Python on a real value, then more edits at later hooks
                model.transformer.h[1].output[:] *= 2
            else:
                model.transformer.h[1].output[:] *= -1
            logits = model.lm_head.output.save()
            seen.append(model.lm_head.output[0, -1].argmax().item())  # a second pause, in the same run
        return seen[0], logits, seen[1]

    before = router.fast_calls
    fast = run()
    assert router.fast_calls == before + 1  # one Interact call, both pauses on it
    again = run()  # the connection is reused after the stream ended
    assert router.fast_calls == before + 2
    with _over_grpc(model, monkeypatch):
        slow = run()
    for ours, other, theirs in zip(fast, again, slow, strict=True):
        torch.testing.assert_close(torch.as_tensor(ours), torch.as_tensor(theirs), rtol=0, atol=0)
        torch.testing.assert_close(torch.as_tensor(other), torch.as_tensor(theirs), rtol=0, atol=0)


def test_the_fast_socket_is_guarded_as_the_grpc_route_is(fastd):
    d, model = fastd
    route = _route(d, model.name)
    fast, slow = _path(route.fast_address), _path(route.address)
    assert os.path.dirname(fast) == os.path.dirname(slow)  # the daemon group's directory
    assert stat.S_ISSOCK(os.stat(fast).st_mode) and stat.S_IMODE(os.stat(fast).st_mode) == 0o660


def test_errors_and_deadlines_read_as_the_grpc_routes(fastd, monkeypatch):
    d, model = fastd

    def fail() -> BaseException:
        with pytest.raises(Exception) as err:
            with model.trace(PROMPT):
                model.transformer.h[0].output.save()
                model.transformer.h[0].output[:, :, :7] = torch.zeros(3)  # a shape mismatch, at the hook
        return err.value

    fast = fail()
    with _over_grpc(model, monkeypatch):
        slow = fail()
    assert type(fast) is type(slow) and str(fast) == str(slow)
    # A stale epoch: refused before anything ran, with the same trailer, over both.
    route = _route(d, model.name)
    request = nnd_pb2.TraceRequest(model=model.name, invokes=[nnd_pb2.Invoke(text=PROMPT)])
    meta = [(contract.EPOCH_KEY, str(route.epoch + 1000))]
    sock, admitted = _connect(_path(route.fast_address))
    try:
        assert admitted == b"\x01"
        sock.sendall(_call("TraceOnce", request, meta))
        header, _ = _reply(sock)
    finally:
        sock.close()
    assert header.end and header.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert (contract.ROUTE_KEY, contract.STALE) in [(m.key, m.value) for m in header.trailing_metadata]
    assert "stale route" in header.details
    # A client's timeout ends the call as a gRPC deadline would.
    with pytest.raises(errors.DeadlineExceeded):
        with model.generate(PROMPT, max_new_tokens=100, timeout=0.05):
            model.lm_head.output.save()


def test_connections_are_bounded_per_uid_and_a_refused_client_takes_the_grpc_route(fastd):
    d, model = fastd
    with model.trace(PROMPT):
        want = model.lm_head.output.save()
    model._conn.router.close()  # this client's own connections closed: the raw ones below fill the bound
    path = _path(_route(d, model.name).fast_address)
    held: list[socket.socket] = []
    try:
        # The worker sees the client's closes when it gets to them, so a refusal may still come from those:
        # raw connections are retried until PER_UID of them are held, and only then is the bound all theirs.
        deadline = time.monotonic() + 30
        while len(held) < PER_UID:
            sock, answer = _connect(path)
            if answer == b"\x01":
                held.append(sock)
                continue
            sock.close()
            assert time.monotonic() < deadline, "the worker never saw this client's own connections close"
            time.sleep(0.05)
        sock, answer = _connect(path)
        held.append(sock)
        assert answer == b"\x00" and _closed(sock)  # refused, before anything was sent
        router = model._conn.router
        counts = router.fast_calls, router.direct_calls, router.fallbacks
        with model.trace(PROMPT):
            got = model.lm_head.output.save()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # Refused at the fast socket before anything was sent: the gRPC route took it, no fallback.
        assert (router.fast_calls, router.direct_calls, router.fallbacks) == (counts[0], counts[1] + 1, counts[2])
    finally:
        for sock in held:
            sock.close()
    for _ in range(60):  # a fresh route's fast socket takes this client again once the worker saw the closes
        router.close()
        with model.trace(PROMPT):
            model.lm_head.output.save()
        if router.fast_calls > counts[0]:
            break
        time.sleep(0.5)
    assert router.fast_calls == counts[0] + 1


def test_a_frame_sent_in_part_is_cut_off_and_a_bad_one_at_once(fastd):
    d, model = fastd
    path = _path(_route(d, model.name).fast_address)
    sock, admitted = _connect(path)
    try:
        assert admitted == b"\x01"
        sock.sendall(b"\x10\x00")  # two bytes of a header's length, and no more
        started = time.monotonic()
        assert _closed(sock)
        assert time.monotonic() - started >= IDLE_S * 0.9
    finally:
        sock.close()
    assert "sent part of a frame and no more" in _worker_log(d, model.name)
    sock, _ = _connect(path)
    try:
        sock.sendall(struct.pack("<I", 1 << 30))  # a header of a GiB
        assert _closed(sock)
    finally:
        sock.close()
    sock, _ = _connect(path)
    try:
        sock.sendall(_frame(b"\xff\xff\xff", b""))  # not a FastCall
        assert _closed(sock)
    finally:
        sock.close()
    sock, _ = _connect(path)
    try:  # a request of a TiB, announced: refused as over the message limit, before any of it is read
        call = nnd_pb2.FastCall(method="TraceOnce").SerializeToString()
        sock.sendall(struct.pack("<I", len(call)) + call + struct.pack("<Q", 1 << 40))
        header, _ = _reply(sock)
        assert header.end and header.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], header
        assert "nothing ran" in header.details
    finally:
        sock.close()
    with model.trace(PROMPT):  # the worker serves on
        assert model.lm_head.output.save() is not None


def test_a_client_that_goes_away_mid_call_cancels_it(fastd, long_gpt2):
    d, _ = fastd
    model = nnd.TransformersModel(long_gpt2, address=d.address, device="cpu", dispatch=True)
    route = _route(d, model.name)
    options = nnd_pb2.GenerateOptions(max_new_tokens=1000, do_sample=True, seed=1)
    invokes = [nnd_pb2.Invoke(text=PROMPT) for _ in range(16)]
    long = nnd_pb2.TraceRequest(model=model.name, invokes=invokes, generate=options)
    sock, admitted = _connect(_path(route.fast_address))
    try:
        assert admitted == b"\x01"
        sock.sendall(_call("Generate", long, [(contract.EPOCH_KEY, str(route.epoch)), (contract.CLIENT_KEY, "leaver")]))
        header, body = _reply(sock)
        # The `started` header, then the first step; `queued` first when an earlier test's run still
        # held the model (its cancellation unwinding on a loaded machine).
        while header.initial_metadata or (not header.end and nnd_pb2.TraceResponse.FromString(body).HasField("queued")):
            header, body = _reply(sock)
        assert not header.end and nnd_pb2.TraceResponse.FromString(body).HasField("step")
    finally:
        sock.close()
    deadline = time.monotonic() + 120
    while "generate from leaver cancelled while running" not in _worker_log(d, model.name):
        assert time.monotonic() < deadline, "the worker never saw the client go"
        time.sleep(0.2)
    with model.trace(PROMPT):  # the model is free again
        assert model.lm_head.output.save() is not None
    model.release()


def test_the_fast_socket_needs_the_daemons_token(tmp_path, tiny_models):
    token = "fast-route-token-for-tests"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    d = start_daemon(tmp_path, "--token-file", str(token_file), token=token, in_process=True)
    try:
        model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True, token=token)
        with model.trace(PROMPT):
            model.lm_head.output.save()
        assert model._conn.router.fast_calls == 1
        route = model._conn.call("GetRoute", nnd_pb2.RouteRequest(model=model.name), timeout=60)
        request = nnd_pb2.TraceRequest(model=model.name, invokes=[nnd_pb2.Invoke(text=PROMPT)])
        sock, admitted = _connect(_path(route.fast_address))
        try:
            assert admitted == b"\x01"
            sock.sendall(_call("TraceOnce", request, [(contract.EPOCH_KEY, str(route.epoch))]))
            header, _ = _reply(sock)
        finally:
            sock.close()
        assert header.end and header.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    finally:
        d.stop()


def test_request_bodies_being_read_are_held_to_the_workers_inflight_budget(tmp_path, tiny_models):
    """Connections that announce big requests and send them slowly cannot make the worker hold more
    than max_inflight_bytes of them: one over the budget is refused before any of it is read."""
    d = start_daemon(tmp_path, "--max-inflight-bytes", "1MiB", "--request-idle-timeout", "300", in_process=True)
    try:
        model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
        path = _path(model._conn.call("GetRoute", nnd_pb2.RouteRequest(model=model.name), timeout=60).fast_address)
        call = nnd_pb2.FastCall(method="TraceOnce").SerializeToString()
        announce = struct.pack("<I", len(call)) + call + struct.pack("<Q", 700_000)
        socks = [_connect(path)[0], _connect(path)[0]]
        try:
            # 700 kB announced on each, 1 kB of it sent: whichever the worker reads first holds room for
            # its body, and the other is over the 1 MiB budget. Only the refused one answers.
            for sock in socks:
                sock.sendall(announce + b"\0" * 1000)
            answered, _, _ = select.select(socks, [], [], 30)
            assert len(answered) == 1, answered
            header, _ = _reply(answered[0])
            assert header.end and header.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], header
            assert "max_inflight_bytes" in header.details and "nothing ran" in header.details
        finally:
            for sock in socks:
                sock.close()
        with model.trace(PROMPT):  # the room comes back with the slow connection's end
            assert model.lm_head.output.save() is not None
        assert model._conn.router.fast_calls >= 1
    finally:
        d.stop()
