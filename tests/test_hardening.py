"""Issue #22's medium, lab-box and low findings, each against a real daemon:
handler-thread exhaustion by stalled uploads, allow-list and upload shard
paths, unload racing a dispatch, one model per real path, the socket's
permission error, the state directory's modes, warm-up imports, names,
log files, argument errors, and `nnd serve`'s token options."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from daemonproc import Daemon, start_daemon

from nnd import _upload
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
    for _ in range(7):  # 3 uploads + 7 = the 10 slots
        gate._enter("Trace", "unix:")
    with pytest.raises(errors.ResourceExhausted, match="busy"):
        gate._enter("Trace", "unix:")
