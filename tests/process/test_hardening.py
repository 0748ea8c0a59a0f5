"""Issue #22's medium, lab-box and low findings, each against a real daemon:
handler-thread exhaustion by stalled uploads, allow-list and upload shard
paths, unload racing a dispatch, one model per real path, the socket's
permission error, the state directory's modes, warm-up imports, names,
log files, argument errors, and `nnd serve`'s token options."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from daemonproc import Daemon, run_serve, start_daemon

from nnd.models import _upload
from nnd.v1 import nnd_pb2, nnd_pb2_grpc


def _stub(d: Daemon) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(d.address)
    return channel, nnd_pb2_grpc.NndStub(channel)


def _code(fn: Any, *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _payload(files: dict[str, bytes]) -> _upload.Payload:
    return _upload.Payload("transformers", list(files.items()))


def _send(stub: Any, payload: _upload.Payload) -> nnd_pb2.UploadResponse:
    return stub.Upload(payload.messages([0]), timeout=60)


# ---------------------------------------------------------------- handler threads


def _stalled(payload: _upload.Payload, release: threading.Event) -> Iterator[nnd_pb2.UploadRequest]:
    yield nnd_pb2.UploadRequest(header=payload.header())
    release.wait(120)


def test_stalled_uploads_are_capped_and_timed_out_while_control_calls_answer(tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    d = start_daemon(tmp_path, "--upload-idle-timeout", "3")
    channel, stub = _stub(d)
    release = threading.Event()
    payload = _payload({"config.json": b'{"model_type": "gpt2"}', "model.safetensors": b"x" * 100})
    try:
        calls = [stub.Upload.future(_stalled(payload, release), timeout=120) for _ in range(40)]
        refused = [
            c for c in calls if c.exception(timeout=60) is not None and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ]
        # One client (the unix socket) may hold 4 uploads; the other 36 are refused at once.
        assert len(refused) == 36, [c.code() for c in calls if c.done()]
        assert "uploads in progress" in refused[0].details()
        # The control calls still answer while the stalled uploads hold their threads.
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(5):
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                == health_pb2.HealthCheckResponse.SERVING
            )
            stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=1)
            stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=1)
        stalled = [c for c in calls if c not in refused]
        for call in stalled:  # cancelled after 3 s without a message
            assert call.exception(timeout=60) is not None
            assert call.code() == grpc.StatusCode.CANCELLED, call.details()
        assert d.log().count("nothing sent for 3 s") == 4
        # Their slots are free again: the next upload is taken on (and stored).
        assert _send(
            stub, _payload({"config.json": b'{"model_type": "gpt2"}', "model.safetensors": _safetensors()})
        ).sha256
    finally:
        release.set()
        channel.close()
        d.stop()


def _safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0\0\0\0"


def test_upload_caps_count_per_client_and_in_all():
    from nnd_daemon import errors
    from nnd_daemon.control.admission import Admission

    gate = Admission(slow_slots=10, uploads_total=3, uploads_per_client=2, upload_idle_s=0)
    gate._enter("Upload", "ipv4:10.0.0.1:5000")
    gate._enter("Upload", "ipv4:10.0.0.1:5001")  # another connection, the same client
    with pytest.raises(errors.ResourceExhausted, match="this client"):
        gate._enter("Upload", "ipv4:10.0.0.1:5002")
    gate._enter("Upload", "ipv4:10.0.0.2:5000")
    with pytest.raises(errors.ResourceExhausted, match="3 uploads"):
        gate._enter("Upload", "ipv4:10.0.0.3:5000")
    gate._leave("Upload", "ipv4:10.0.0.1:5000")
    gate._enter("Upload", "ipv4:10.0.0.3:5000")
    for i in range(7):  # 3 uploads + 7 = the 10 slots (seven clients: each within its share)
        gate._enter("Trace", "unix:", f"client {i}")
    with pytest.raises(errors.ResourceExhausted, match="busy"):
        gate._enter("Trace", "unix:", "client 7")


def test_a_flooding_client_is_refused_beyond_its_share_and_bystanders_are_not():
    from nnd_daemon import errors
    from nnd_daemon.control.admission import Admission

    gate = Admission(slow_slots=40, uploads_total=3, uploads_per_client=2, upload_idle_s=0)
    assert gate.per_client == 10
    refused = 0
    for _ in range(230):  # one client resubmitting Scans from 230 threads
        try:
            gate._enter("Scan", "unix:", "unix: flood@box:1")
        except errors.ResourceExhausted as exc:
            assert "this client" in str(exc)
            refused += 1
    assert refused == 220
    for i in range(30):  # every bystander's call still finds a slot
        gate._enter(["GetRoute", "Trace", "Dispatch", "Tokenize"][i % 4], "unix:", f"unix: user{i}@box:{i}")
    with pytest.raises(errors.ResourceExhausted, match="busy"):
        gate._enter("Trace", "unix:", "unix: late@box:9")


def test_the_helper_serves_waiting_clients_in_turn():
    from nnd_daemon.control.fairgate import FairGate

    gate = FairGate()
    gate.acquire("holder")
    order: list[str] = []
    threads = []
    for who in ["flood"] * 5 + ["bystander"]:  # five of the flooder's calls queue before the bystander's one
        t = threading.Thread(target=lambda w=who: (gate.acquire(w), order.append(w), gate.release()))
        t.start()
        threads.append(t)
        while gate.waiting() != len(threads):
            threading.Event().wait(0.001)
    gate.release()
    for t in threads:
        t.join(10)
    assert order[:2] == ["flood", "bystander"]  # the bystander's turn comes second, not sixth
    assert order.count("flood") == 5


# ---------------------------------------------------------------- paths, names, allow-list


@pytest.fixture(scope="module")
def box(tmp_path_factory, tiny_models) -> Iterator[tuple[Daemon, pathlib.Path]]:
    """A daemon that allows the models inside `root/allowed/` only."""
    root = tmp_path_factory.mktemp("box")
    (root / "allowed").mkdir()
    shutil.copytree(tiny_models["gpt2"], root / "allowed" / "gpt2")
    shutil.copytree(tiny_models["llama"], root / "other")
    os.symlink(root / "other", root / "allowed" / "link")
    d = start_daemon(root, "--allow-model", f"{root}/allowed/*")
    yield d, root
    d.stop()


def _load(stub: Any, model: str, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    return _code(stub.LoadModel, nnd_pb2.LoadModelRequest(model=model, **kwargs), timeout=120)


def test_allow_list_compares_real_paths(box):
    d, root = box
    channel, stub = _stub(d)
    with channel:
        for escape in (f"{root}/allowed/../other", f"{root}/allowed/link", f"{root}/allowed/./../other"):
            code, details = _load(stub, escape)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (escape, code, details)
            assert "allow-list" in details
        assert _load(stub, f"{root}/allowed/gpt2")[0] == grpc.StatusCode.OK


def test_one_folder_is_one_model_whatever_path_reaches_it(box):
    d, root = box
    real = str(root / "allowed" / "gpt2")
    os.symlink(root / "allowed" / "gpt2", root / "allowed" / "gpt2-link")
    channel, stub = _stub(d)
    with channel:
        for path in (real, f"{root}/allowed/gpt2-link", f"/proc/self/root{real}", f"{root}/allowed/gpt2/../gpt2"):
            code, details = _load(stub, path)
            assert code == grpc.StatusCode.OK, (path, details)
        names = [m.name for m in stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=10).models]
        assert names.count(real) == 1 and len(names) == 1, names
        # Any of those paths names the same model.
        assert stub.GetModel(nnd_pb2.GetModelRequest(model=f"{root}/allowed/gpt2-link"), timeout=10).name == real
        stub.Unload(nnd_pb2.UnloadRequest(model=real), timeout=60)


def _gpt2_config(root: pathlib.Path) -> bytes:
    return (root / "allowed" / "gpt2" / "config.json").read_bytes()


def test_upload_shards_must_be_the_uploads_own_files(box):
    d, root = box
    secret = root / "other" / "model.safetensors"
    channel, stub = _stub(d)
    with channel:
        for target in (str(secret), "../other/model.safetensors", "missing.safetensors"):
            index = json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": target}}).encode()
            files = {
                "config.json": _gpt2_config(root),
                "model-00001-of-00001.safetensors": _safetensors(),
                "model.safetensors.index.json": index,
            }
            code, details = _code(_send, stub, _payload(files))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (target, code, details)
            assert "only the upload's own files" in details
        tok = json.dumps({"tokenizer_file": str(root / "other" / "tokenizer.json")}).encode()
        files = {"config.json": _gpt2_config(root), "model.safetensors": _safetensors(), "tokenizer_config.json": tok}
        code, details = _code(_send, stub, _payload(files))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details.startswith("tokenizer_config.json names"), details


@pytest.mark.parametrize("name", ["-x", "--help", "a\0b", "tab\there", "x" * 5000])
def test_model_names_no_repo_or_path_has_are_invalid(box, name):
    d, root = box
    channel, stub = _stub(d)
    with channel:
        code, details = _load(stub, name, upload="0" * 64)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        code, details = _load(stub, name)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)


# ---------------------------------------------------------------- unload during a dispatch


def _trace(model: str) -> nnd_pb2.TraceRequest:
    from nnd.v1 import graph_pb2

    graph = graph_pb2.Graph()
    graph.nodes.add(id=1, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT))
    graph.nodes.add(id=2, save=graph_pb2.Save(value=graph_pb2.Arg(ref=1)))
    return nnd_pb2.TraceRequest(
        model=model, invokes=[nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[5, 6, 7]))], graph=graph
    )


def _workers(daemon_pid: int) -> list[Any]:
    import psutil

    out = []
    for child in psutil.Process(daemon_pid).children(recursive=True):
        try:
            if "nnd_daemon.worker" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def test_unload_during_an_auto_dispatch_leaves_no_worker(fresh_daemon, tiny_models):
    import psutil

    d = fresh_daemon
    model = tiny_models["gpt2"]
    channel, stub = _stub(d)
    outcomes: dict[str, tuple[grpc.StatusCode, str]] = {}

    def run(key: str, fn: Any, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=lambda: outcomes.__setitem__(key, _code(fn, *args)))
        thread.start()
        return thread

    # Hold the dispatch halfway, whatever the box's speed: the fork server the worker forks from is
    # stopped, so the dispatch waits for its worker until the test lets it go (well within the daemon's
    # 30 s for a spawn's answer, control/forking.py).
    (forks,) = [p for p in psutil.Process(d.proc.pid).children() if "nnd_daemon.forkserver" in p.cmdline()]
    with channel:
        stub.LoadModel(nnd_pb2.LoadModelRequest(model=model), timeout=120)
        forks.suspend()
        try:
            first = run("first", lambda: list(stub.Trace(_trace(model), timeout=120)))
            while stub.GetModel(nnd_pb2.GetModelRequest(model=model), timeout=10).state != nnd_pb2.DISPATCHING:
                threading.Event().wait(0.01)
            second = run("second", lambda: list(stub.Trace(_trace(model), timeout=120)))
            unload = run("unload", lambda: stub.Unload(nnd_pb2.UnloadRequest(model=model), timeout=120))
            # Gone from `nnd ps` at once, while its dispatch is still held.
            for _ in range(200):
                if not stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=10).models:
                    break
                threading.Event().wait(0.05)
            assert not stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=10).models
            assert not _workers(d.proc.pid)  # held before its worker existed
        finally:
            forks.resume()
        for thread in (first, second, unload):
            thread.join(120)
    assert outcomes["unload"][0] == grpc.StatusCode.OK, outcomes
    for key in ("first", "second"):
        code, details = outcomes[key]
        assert (code == grpc.StatusCode.UNAVAILABLE and "was unloaded" in details) or (
            code == grpc.StatusCode.NOT_FOUND and "not loaded" in details
        ), (key, code, details)
    # No worker is left behind: the held one, forked once the fork server went on, was ended before the
    # trace that asked for it heard "was unloaded" (registry: an orphaned dispatch); none was started for
    # the waiting request.
    gone, alive = psutil.wait_procs(_workers(d.proc.pid), timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert "dispatched" not in d.log()


# ---------------------------------------------------------------- the state directory


def _serve_refused(tmp: pathlib.Path, state: pathlib.Path) -> str:
    sock = tmp / "run" / "nnd.sock"
    res = run_serve(tmp, state_dir=str(state))
    err = res.stderr.strip()
    assert res.returncode == 1 and err.startswith("nnd: ") and len(err.splitlines()) == 1, (res.returncode, err)
    assert not sock.exists()
    return err


def test_a_state_directory_others_can_write_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    assert "writable by other users (mode 0777)" in _serve_refused(tmp_path, state)
    os.chmod(state, 0o750)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    os.symlink(elsewhere, state / "logs")  # logs/ moved aside for a link
    assert "logs/" in _serve_refused(tmp_path, state) and "symbolic link" in _serve_refused(tmp_path, state)
    assert not list(elsewhere.iterdir())


def test_under_umask_0_nothing_is_writable_by_others_and_logs_do_not_collide(tmp_path, tiny_models):
    # Two folders whose names sanitise alike ("m_1"): each model keeps its own log.
    for name in ("m-1", "m_1"):
        shutil.copytree(tiny_models["gpt2"], tmp_path / "models" / name)
    old = os.umask(0)
    try:
        d = start_daemon(tmp_path, state_dir=str(tmp_path / "deep" / "state"))
    finally:
        os.umask(old)
    try:
        for name in ("m-1", "m_1"):
            d.cli("load", str(tmp_path / "models" / name))
            d.cli("dispatch", str(tmp_path / "models" / name))
        state = pathlib.Path(d.state_dir)
        made = [state.parent, state, state / "logs", state / "uploads", state / "registry.json"]
        logs = sorted((state / "logs").iterdir())
        # one per model, beside the helpers' and the fork server's
        assert len([p for p in logs if not p.name.startswith(("helper", "forkserver"))]) == 2, logs
        for path in made + logs:
            mode = stat.S_IMODE(path.lstat().st_mode)
            assert not mode & 0o022, (path, oct(mode))
            assert not path.is_symlink()
    finally:
        d.stop()


# ---------------------------------------------------------------- a lab box's users


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_user_outside_the_sockets_group_is_told_so():
    import tempfile

    # As on a lab box: the way to the socket's 0750 directory is open to everyone (pytest's tmp is not).
    base = pathlib.Path(tempfile.mkdtemp(prefix="nnd-lab-", dir="/tmp"))
    os.chmod(base, 0o755)
    # Ready once its socket answers the health check: nothing here needs the helper, whose start (the
    # fork server importing torch and transformers, ~7 s of CPU) the stop then cuts short.
    daemon = start_daemon(base, ready="health")
    try:
        _told_permission_denied(daemon)
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def _told_permission_denied(daemon: Daemon) -> None:
    import grp

    group = grp.getgrgid(os.stat(os.path.dirname(daemon.address.removeprefix("unix://"))).st_gid).gr_name
    # Imports first (the interpreter's files may be private to root), then become uid 54321, in no group.
    script = (
        "import os, sys\n"
        "from nnd.wire.connection import Connection\n"
        "from nnd.errors import DaemonUnavailable\n"
        "from nnd.v1 import nnd_pb2\n"
        "conn = Connection(sys.argv[1])  # connects lazily, at the first call\n"
        "os.setgroups([]); os.setgid(54321); os.setuid(54321)\n"
        "try:\n"
        "    conn.call('ListModels', nnd_pb2.ListModelsRequest(), timeout=10)\n"
        "except DaemonUnavailable as exc:\n"
        "    print(exc)\n"
    )
    res = subprocess.run([sys.executable, "-c", script, daemon.address], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    text = res.stdout.strip()
    assert text.startswith("permission denied on the nnd daemon's socket"), text
    assert f"group {group!r}" in text and "is `nnd serve` running" not in text, text


# ---------------------------------------------------------------- `nnd serve`'s token options


def _serve_exit(tmp: pathlib.Path, *extra: str) -> str:
    sock = tmp / "run" / "nnd.sock"
    res = run_serve(tmp, *extra)
    err = res.stderr.strip()
    assert res.returncode == 1 and err.startswith("nnd: ") and len(err.splitlines()) == 1, (res.returncode, err)
    assert not sock.exists()
    return err


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_the_clients_token_option(tmp_path):
    assert "--token-file" in _serve_exit(tmp_path, "--token", "s3cret")


def test_a_host_name_starting_with_127_is_not_loopback(tmp_path):
    from nnd.wire import _address

    err = _serve_exit(tmp_path, "--listen", f"127.0.0.1.nip.io:{_port()}", "--insecure")
    assert "only allowed on a loopback address" in err
    assert _address.is_loopback("127.0.0.2:1") and _address.is_loopback("[::1]:1")
    assert not _address.is_loopback("127.evil.example:1") and not _address.is_loopback("10.0.0.1:1")


def test_plaintext_token_off_loopback_warns_and_refusals_do_not_flood_the_log(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-for-hardening\n")
    os.chmod(token, 0o600)
    d = _serve_until_healthy(tmp_path, "--listen", f"0.0.0.0:{_port()}", "--token-file", str(token))
    try:
        assert "in plaintext: the token and every request can be read on the network" in d.log()
        channel, stub = _stub(d)
        with channel:
            for _ in range(30):
                code, _ = _code(stub.ListModels, nnd_pb2.ListModelsRequest(), timeout=10)
                assert code == grpc.StatusCode.UNAUTHENTICATED
        d.stop()
        assert d.log().count("refused /nnd.v1.Nnd/ListModels") == 1, d.log()
    finally:
        d.stop()


def _serve_until_healthy(tmp: pathlib.Path, *extra: str) -> Daemon:
    """`nnd serve` with a token: ready once its health check (open to all) answers."""
    return start_daemon(tmp, *extra, ready="health", ready_timeout=120)


# ---------------------------------------------------------------- the client's mistakes are INVALID_ARGUMENT


def _config_only(box_root: pathlib.Path, name: str, change: dict[str, Any]) -> str:
    import tinymodels

    config = json.loads((box_root / "allowed" / "gpt2" / "config.json").read_text())
    config.update(change)
    return str(tinymodels.write_config_only(box_root / "allowed" / name, config))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"architectures": ["pipeline"]}, "not a transformers model class"),
        ({"architectures": ["AutoTokenizer"]}, "not a transformers model class"),
        ({"architectures": ["GPT2LMHeadModel"], "vocab_size": 2**70}, "cannot build GPT2LMHeadModel"),
    ],
)
def test_configs_nothing_can_be_built_from_are_invalid(box, change, says):
    d, root = box
    path = _config_only(root, f"bad-{abs(hash(json.dumps(change)))}", change)
    channel, stub = _stub(d)
    with channel:
        code, details = _load(stub, path)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, (code, details)


def test_out_of_range_token_ids_and_unknown_points_are_invalid(box):
    from nnd.v1 import graph_pb2

    d, root = box
    model = str(root / "allowed" / "gpt2")
    channel, stub = _stub(d)
    with channel:
        assert _load(stub, model)[0] == grpc.StatusCode.OK
        for ids in ([2**62], [-1], [5, 2**32]):
            request = nnd_pb2.DecodeRequest(model=model, ids=[nnd_pb2.TokenIds(ids=ids)])
            code, details = _code(stub.Decode, request, timeout=30)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in details, (ids, code, details)
        assert stub.Decode(nnd_pb2.DecodeRequest(model=model, ids=[nnd_pb2.TokenIds(ids=[5, 6])]), timeout=30).texts
        scan = _trace(model)
        scan.graph.nodes[0].module.point = 99
        code, details = _code(lambda: list(stub.Scan(scan, timeout=60)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown point 99" in details, (code, details)
        scan.graph.nodes[0].module.point = graph_pb2.OUTPUT
        assert list(stub.Scan(scan, timeout=60))  # the same scan with a real point runs


# ---------------------------------------------------------------- start-up imports


def test_loads_sent_the_moment_the_socket_appears_all_succeed(tmp_path, tiny_models):
    """The warm-up imports transformers in the background; calls wait for it instead of importing alongside."""

    d = start_daemon(tmp_path, ready="socket")
    try:
        channel, stub = _stub(d)
        with channel:
            models = [tiny_models[k] for k in ("gpt2", "llama", "bert")]
            calls = [
                stub.LoadModel.future(nnd_pb2.LoadModelRequest(model=m), timeout=300, wait_for_ready=True)
                for m in models
            ]
            calls.append(stub.GetServerInfo.future(nnd_pb2.GetServerInfoRequest(), timeout=300, wait_for_ready=True))
            for call in calls:
                assert call.exception() is None, call.exception()
            assert sorted(m.name for m in stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=10).models) == sorted(
                models
            )
        assert "ImportError" not in d.log()
    finally:
        d.stop()
