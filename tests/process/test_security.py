"""Who may reach a real daemon, and how it stops: socket permissions, bearer
tokens on TCP and the socket, TLS and mTLS, the refusals `nnd serve` makes at
start, model allow-lists, and the SIGTERM drain."""

from __future__ import annotations

import datetime
import grp
import ipaddress
import json
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from daemonproc import Daemon, start_daemon

from nnd import errors
from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
from nnd.wire.connection import Connection

TOKEN = "s3cret-token-for-tests"


# ---------------------------------------------------------------- helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nnd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NND_")}
    return subprocess.run(
        [sys.executable, "-m", "nnd.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environ, **(env or {})},
    )


def _one_line_error(res: subprocess.CompletedProcess, text: str) -> None:
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    err = res.stderr.strip()
    assert err.startswith("nnd: ") and text in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def _health(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status


def _serve(tmp: pathlib.Path, *extra: str, ready_timeout: float = 60) -> Daemon:
    """`nnd serve` on a socket under `tmp`, ready once its health check (which
    needs no token) answers on the socket."""
    return start_daemon(tmp, *extra, ready_timeout=ready_timeout, ready="health")


def _refused(tmp: pathlib.Path, *extra: str) -> str:
    """`nnd serve ARGS` must exit non-zero at once with one line, binding nothing."""
    sock = tmp / "run" / "nnd.sock"
    res = _nnd("serve", "--address", f"unix://{sock}", "--state-dir", str(tmp / "state"), *extra, timeout=30)
    assert res.returncode != 0, res.stderr
    err = res.stderr.strip()
    assert err.startswith("nnd: ") and len(err.splitlines()) == 1, err
    assert not sock.exists()
    return err


def _socket_group() -> grp.struct_group:
    """A group we may chown to that is not simply our primary group."""
    candidates = [g for g in os.getgroups() if g != os.getgid()]
    if os.geteuid() == 0:
        candidates += [g.gr_gid for g in grp.getgrall() if g.gr_gid != os.getgid()]
    return grp.getgrgid(candidates[0] if candidates else os.getgid())


def _pki(root: pathlib.Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client one."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name: str, issuer: tuple | None, *, ca: bool = False, san: list | None = None, usage=None) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, issuer_key = (subject, key) if issuer is None else (issuer[0].subject, issuer[1])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        cert = builder.sign(issuer_key, hashes.SHA256())
        cert_path, key_path = root / f"{name}.crt", root / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return cert, key, str(cert_path), str(key_path)

    ca = make("nnd-test-ca", None, ca=True)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = make("server", ca, san=san, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = make("client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return {"ca": ca[2], "cert": server[2], "key": server[3], "client_cert": client[2], "client_key": client[3]}


def _token_file(root: pathlib.Path, token: str = TOKEN) -> str:
    path = root / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


# ---------------------------------------------------------------- daemons


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_models) -> tuple[Daemon, int, grp.struct_group]:
    """No token: a socket-group socket, loopback TCP with --insecure, an
    allow-list holding only the tiny gpt2."""
    tmp = tmp_path_factory.mktemp("plain")
    group, port = _socket_group(), _free_port()
    d = _serve(
        tmp,
        "--socket-group",
        group.gr_name,
        "--listen",
        f"127.0.0.1:{port}",
        "--insecure",
        "--allow-model",
        tiny_models["gpt2"],
        # Others in the socket group may call it: without a root it would read only world-readable files.
        "--model-root",
        os.path.dirname(tiny_models["gpt2"]),
    )
    yield d, port, group
    d.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_models) -> tuple[Daemon, int]:
    """A token on loopback TCP (and so on the socket too); remote code allowed."""
    tmp = tmp_path_factory.mktemp("guarded")
    port = _free_port()
    root = os.path.dirname(tiny_models["gpt2"])
    args = ["--token-file", _token_file(tmp), "--allow-remote-code", "--model-root", root]
    d = _serve(tmp, "--listen", f"127.0.0.1:{port}", *args)
    yield d, port
    d.stop()


# ---------------------------------------------------------------- the socket


def test_socket_is_0660_in_a_0750_directory(plain):
    d, _, group = plain
    path = d.address[len("unix://") :]
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
    assert st.st_gid == group.gr_gid
    dst = os.stat(os.path.dirname(path))
    assert stat.S_IMODE(dst.st_mode) == 0o750, oct(dst.st_mode)
    assert dst.st_gid == group.gr_gid


def test_second_daemon_on_a_live_socket_is_refused(plain, tmp_path):
    d, _, _ = plain
    res = _nnd("serve", "--address", d.address, "--state-dir", str(tmp_path / "state"), timeout=30)
    assert res.returncode != 0
    assert "already listening" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert _health(d.address) == 1  # the first one still serves


def test_insecure_loopback_tcp_needs_no_token(plain):
    _, port, _ = plain
    res = _nnd("ps", "--address", f"127.0.0.1:{port}")
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- tokens


def test_tcp_without_token_is_unauthenticated(guarded):
    _, port = guarded
    _one_line_error(_nnd("ps", "--address", f"127.0.0.1:{port}"), "needs a token")
    with pytest.raises(errors.Unauthenticated, match="needs a token"):
        Connection(f"127.0.0.1:{port}", token="").call("ListModels", nnd_pb2.ListModelsRequest())


def test_wrong_token_is_refused(guarded):
    _, port = guarded
    _one_line_error(_nnd("ps", "--address", f"127.0.0.1:{port}", "--token", "nope"), "token was refused")
    _one_line_error(_nnd("ps", "--address", f"127.0.0.1:{port}", env={"NND_TOKEN": TOKEN + "x"}), "refused")
    with pytest.raises(errors.Unauthenticated):
        Connection(f"127.0.0.1:{port}", token=TOKEN[:-1]).call("ListModels", nnd_pb2.ListModelsRequest())


def test_right_token_is_accepted(guarded):
    _, port = guarded
    assert _nnd("ps", "--address", f"127.0.0.1:{port}", env={"NND_TOKEN": TOKEN}).returncode == 0
    res = _nnd("info", "--address", f"127.0.0.1:{port}", "--token", TOKEN)
    assert res.returncode == 0 and "nnd.v1" in res.stdout, res.stderr
    conn = Connection(f"127.0.0.1:{port}", token=TOKEN)
    assert conn.call("ListModels", nnd_pb2.ListModelsRequest()) is not None


def test_socket_wants_the_token_once_one_is_set(guarded):
    d, _ = guarded
    _one_line_error(_nnd("ps", "--address", d.address), "needs a token")
    assert _nnd("ps", "--address", d.address, "--token", TOKEN).returncode == 0


def test_health_is_open_and_reflection_is_not(guarded):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, port = guarded
    address = f"127.0.0.1:{port}"
    assert _health(address) == 1  # SERVING, without a token
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = list(
            stub.ServerReflectionInfo(iter([request]), timeout=5, metadata=[("authorization", f"Bearer {TOKEN}")])
        )
        names = {s.name for s in answer[0].list_services_response.service}
        assert "nnd.v1.Nnd" in names


# ---------------------------------------------------------------- refusals at start


def test_listen_without_token_refuses_to_start(tmp_path):
    err = _refused(tmp_path, "--listen", f"127.0.0.1:{_free_port()}")
    assert "without authentication" in err and "--token-file" in err


def test_insecure_off_loopback_refuses_to_start(tmp_path):
    err = _refused(tmp_path, "--listen", f"0.0.0.0:{_free_port()}", "--insecure")
    assert "loopback" in err


def test_tls_half_configured_refuses_to_start(tmp_path):
    err = _refused(tmp_path, "--listen", f"127.0.0.1:{_free_port()}", "--insecure", "--tls-cert", "/nonexistent")
    assert "--tls-key" in err


# ---------------------------------------------------------------- TLS


def test_tls_with_the_ca_connects_and_plaintext_fails(tmp_path):
    pki = _pki(tmp_path)
    port = _free_port()
    tls_args = ["--tls-cert", pki["cert"], "--tls-key", pki["key"]]
    d = _serve(tmp_path, "--listen", f"127.0.0.1:{port}", "--token-file", _token_file(tmp_path), *tls_args)
    try:
        request = nnd_pb2.ListModelsRequest()
        conn = Connection(f"tls://127.0.0.1:{port}", token=TOKEN, tls_ca=pki["ca"])
        assert conn.tls and conn.call("ListModels", request, timeout=10) is not None
        res = _nnd("ps", "--address", f"tls://127.0.0.1:{port}", env={"NND_TOKEN": TOKEN, "NND_TLS_CA": pki["ca"]})
        assert res.returncode == 0, res.stderr
        with pytest.raises(errors.DaemonUnavailable):
            Connection(f"127.0.0.1:{port}", token=TOKEN).call("ListModels", request, timeout=5)
        # TLS, but without our CA: the self-signed chain is not trusted.
        with pytest.raises(errors.DaemonUnavailable):
            Connection(f"tls://127.0.0.1:{port}", token=TOKEN).call("ListModels", request, timeout=5)
    finally:
        assert d.stop() == 0


def test_mtls_needs_a_client_certificate(tmp_path):
    pki = _pki(tmp_path)
    port = _free_port()
    tls_args = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-client-ca", pki["ca"]]
    d = _serve(tmp_path, "--listen", f"127.0.0.1:{port}", *tls_args)  # the certificate stands in for a token
    try:
        request = nnd_pb2.ListModelsRequest()
        address = f"tls://127.0.0.1:{port}"
        with pytest.raises(errors.DaemonUnavailable):
            Connection(address, tls_ca=pki["ca"]).call("ListModels", request, timeout=5)
        conn = Connection(address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
        assert conn.call("ListModels", request, timeout=10) is not None
    finally:
        assert d.stop() == 0


# ---------------------------------------------------------------- what may be loaded


def test_trust_remote_code_is_refused_by_default(plain, tiny_models):
    d, _, _ = plain
    res = _nnd("load", tiny_models["gpt2"], "--trust-remote-code", "--address", d.address)
    _one_line_error(res, "trust_remote_code is refused")
    assert "--allow-remote-code" in res.stderr


def test_trust_remote_code_allowed_with_the_flag(guarded, tiny_models):
    d, _ = guarded
    res = _nnd("load", tiny_models["gpt2"], "--trust-remote-code", "--json", "--address", d.address, "--token", TOKEN)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["state"] == "META"


def test_allow_list_refuses_other_models(plain, tiny_models):
    d, _, _ = plain
    _one_line_error(_nnd("load", tiny_models["llama"], "--address", d.address), "not in this daemon's allow-list")
    assert _nnd("load", tiny_models["gpt2"], "--address", d.address).returncode == 0


# ---------------------------------------------------------------- SIGTERM


def _big_trace(model: str) -> nnd_pb2.TraceRequest:
    """A trace whose saved values (~30 MB) outgrow gRPC's flow-control
    window, so the call stays in flight while the client does not read."""
    graph = graph_pb2.Graph()
    for i, path in enumerate(["lm_head", "transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]):
        graph.nodes.add(id=2 * i + 1, module=graph_pb2.ModuleValue(path=path, point=graph_pb2.OUTPUT))
        graph.nodes.add(id=2 * i + 2, save=graph_pb2.Save(value=graph_pb2.Arg(ref=2 * i + 1)))
    invokes = [
        nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[(7 * k + j) % 300 + 5 for j in range(120)])) for k in range(64)
    ]
    return nnd_pb2.TraceRequest(model=model, invokes=invokes, graph=graph)


def test_sigterm_drains_in_flight_calls_then_exits_zero(tmp_path, tiny_models):
    d = _serve(tmp_path, "--grace", "20")
    model = tiny_models["gpt2"]
    d.cli("load", model)
    d.cli("dispatch", model)
    pid = json.loads(d.cli("ps", "--json").stdout)[0]["worker_pids"][0]
    worker = psutil.Process(pid)
    assert worker.is_running()

    with grpc.insecure_channel(d.address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub = nnd_pb2_grpc.NndStub(channel)
        call = stub.Trace(_big_trace(model), timeout=60)
        first = next(call)  # in flight; the rest waits for us to read
        assert first.WhichOneof("kind")
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert d.proc.poll() is None  # draining, not gone
        with grpc.insecure_channel(d.address) as other:  # new calls are turned away
            with pytest.raises(grpc.RpcError):
                nnd_pb2_grpc.NndStub(other).ListModels(nnd_pb2.ListModelsRequest(), timeout=5)
        received = [first, *call]  # the in-flight call finishes
        assert call.code() == grpc.StatusCode.OK
        assert sum(m.ByteSize() for m in received) >= 64 * 120 * (320 + 2 * 256) * 4

    assert d.proc.wait(30) == 0
    gone, _ = psutil.wait_procs([worker], timeout=10)
    assert gone or worker.status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(d.address[len("unix://") :])
    assert "stopped" in d.log()


def test_refused_token_is_logged_without_the_secret(guarded):
    d, port = guarded
    _nnd("ps", "--address", f"127.0.0.1:{port}", "--token", "leaked-guess")
    deadline = time.monotonic() + 5
    while "refused /nnd.v1.Nnd/ListModels" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "refused /nnd.v1.Nnd/ListModels" in d.log()
    assert "leaked-guess" not in d.log() and TOKEN not in d.log()


# ---------------------------------------------------------------- the state directory


def test_a_second_daemon_on_one_state_directory_refuses_and_a_killed_one_blocks_nothing(tmp_path):
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    first = _serve(tmp_path / "a")
    state = first.state_dir
    registry = pathlib.Path(state) / "registry.json"
    before = registry.read_bytes() if registry.exists() else None
    sock = tmp_path / "b" / "run" / "nnd.sock"
    res = _nnd("serve", "--address", f"unix://{sock}", "--state-dir", state, timeout=60)
    assert res.returncode != 0
    err = res.stderr.strip()
    assert err.startswith("nnd: ") and len(err.splitlines()) == 1, err
    assert f"pid {first.proc.pid}" in err and first.address in err, err
    assert not sock.exists()
    assert (registry.read_bytes() if registry.exists() else None) == before
    assert _health(first.address) == 1
    first.proc.kill()  # SIGKILL: no cleanup ran; the kernel drops the lock with the process
    first.proc.wait()
    again = _serve(tmp_path / "c", "--state-dir", state)
    try:
        assert _health(again.address) == 1
    finally:
        again.stop()
