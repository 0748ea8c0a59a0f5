"""No client can hold a model: a paused run ends at the server's bounds, whatever the client asked
(issue #26), against real daemons.

A daemon with tight pause caps (`--max-pause`, `--max-paused-total`) and a small `--max-saved-bytes`
serves most tests; one whose only bound is `--deadline` shows the deadline waking a paused run. The
attacker speaks the wire protocol itself (raw Interact messages), as a hostile client would.
"""

from __future__ import annotations

import queue
import threading

import grpc
import numpy as np
import pytest
import torch
from daemonproc import start_daemon
from graphs import Graph  # noqa: E402

import nnd
from nnd.v1 import nnd_pb2, nnd_pb2_grpc

PROMPT = "Hello world"
MAX_PAUSE = 3
MAX_PAUSED_TOTAL = 6
MAX_SAVED = 64 * 1024


@pytest.fixture(scope="module")
def capped(tmp_path_factory, tiny_models):
    d = start_daemon(
        tmp_path_factory.mktemp("capped"),
        "--max-pause", str(MAX_PAUSE), "--max-paused-total", str(MAX_PAUSED_TOTAL),
        "--max-saved-bytes", str(MAX_SAVED),
    )
    model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
    yield d, model
    d.stop()


class Stream:
    """A raw Interact stream through the daemon: send bytes when told, read responses as they come."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        call = self.channel.stream_stream(
            "/nnd.v1.Nnd/Interact", request_serializer=lambda b: b, response_deserializer=nnd_pb2.TraceResponse.FromString
        )
        self.outbox: queue.Queue = queue.Queue()
        self.responses = call(iter(self.outbox.get, None))  # no timeout: the daemon's own bounds apply

    def send(self, raw: bytes) -> None:
        self.outbox.put(raw)

    def until_paused(self) -> list[nnd_pb2.TraceResponse]:
        got = []
        for msg in self.responses:
            got.append(msg)
            if msg.WhichOneof("kind") == "paused":
                return got
        raise AssertionError(f"the stream ended without a pause: {got}")

    def error(self) -> grpc.RpcError:
        """Read to the end; the status it ended with."""
        try:
            for _ in self.responses:
                pass
        except grpc.RpcError as exc:
            return exc
        raise AssertionError("the stream ended without an error")

    def close(self) -> None:
        self.outbox.put(None)
        self.channel.close()


def _pause_at_first_block(model: str, pause_timeout_s: float) -> bytes:
    """An InteractStart that pauses once h[0]'s sum exists, asking to wait up to `pause_timeout_s`."""
    g = Graph()
    total = g.op("sum", g.module("transformer.h.0"))
    request = g.request(PROMPT)
    request.model = model
    start = nnd_pb2.InteractStart(request=request, want=[total.id], pause_timeout_s=pause_timeout_s)
    return nnd_pb2.InteractRequest(start=start).SerializeToString()


def _requests(address: str) -> list[nnd_pb2.RequestInFlight]:
    with grpc.insecure_channel(address) as channel:
        models = nnd_pb2_grpc.NndStub(channel).ListModels(nnd_pb2.ListModelsRequest(), timeout=30).models
    return [r for m in models for r in m.requests]


def _logits(model, prompt=PROMPT):
    with model.trace(prompt):
        out = model.lm_head.output.save()
    return out


# ------------------------------------------------------------------ one pause, capped


def test_a_pause_asking_for_a_million_seconds_ends_at_max_pause_and_the_bystander_runs(capped, tiny_models, capsys):
    daemon, model = capped
    want = _logits(model)
    attacker = Stream(daemon.address)
    try:
        attacker.send(_pause_at_first_block(tiny_models["gpt2"], 1e6))
        attacker.until_paused()
        # While it is paused, `nnd ps` (ListModels) says so, with since when.
        paused = [r for r in _requests(daemon.address) if r.state == "paused"]
        assert len(paused) == 1 and paused[0].paused_since > 0
        # The bystander queues behind it, is told who holds the model, and runs once the cap ends the pause.
        got = _logits(model)
        assert torch.equal(got, want)
        assert "paused at a sync point by another client" in capsys.readouterr().err
        err = attacker.error()
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--max-pause" in err.details()
    finally:
        attacker.close()


def test_a_client_answering_each_pause_just_in_time_is_ended_by_the_budget(capped):
    _, model = capped
    # Each sync point answered well within --max-pause, for longer than --max-paused-total in all.
    seen = [0]  # a list: a failed block leaves the names it bound as they were (nnsight's rule)
    with pytest.raises(nnd.errors.DeadlineExceeded, match="--max-paused-total"):
        with model.trace(PROMPT, pause_timeout=1e6):
            h = model.transformer.h[0].output
            for _ in range(10 * MAX_PAUSED_TOTAL):
                float(h.sum())
                seen[0] += 1
                threading.Event().wait(MAX_PAUSE / 3)
    assert 0 < seen[0] < 10 * MAX_PAUSED_TOTAL
    assert torch.isfinite(_logits(model)).all()  # the model is free and computes as before


# ------------------------------------------------------------------ what a request may be sent


def test_max_saved_bytes_counts_every_pause_and_the_result(capped, tiny_models):
    _, model = capped
    want = _logits(model)
    one = want.numel() * want.element_size()
    assert one * 2 < MAX_SAVED, "the prompt's logits must fit the limit twice"
    # Two values in all are within the limit...
    with model.trace(PROMPT):
        first = nnd.save(np.asarray(model.lm_head.output))
        last = model.lm_head.output.save()
    assert np.array_equal(first, want.numpy()) and torch.equal(last, want)
    # ...but many pauses of one value each are not: the limit holds for the whole request.
    pauses = MAX_SAVED // one + 1
    got = [0]  # a list: a failed block leaves the names it bound as they were (nnsight's rule)
    with pytest.raises(nnd.errors.LimitExceeded, match="max_saved_bytes"):
        with model.trace(PROMPT):
            for _ in range(pauses):
                np.asarray(model.lm_head.output)
                got[0] += 1
    assert 0 < got[0] and got[0] * one <= MAX_SAVED


@pytest.mark.parametrize(
    "garbage, says",
    [
        (b"\xff\xff\xff", "not a valid nnd.v1.InteractRequest"),
        (None, "not a second InteractStart"),
        (b"", "not an empty InteractRequest"),
    ],
)
def test_a_garbage_continuation_ends_the_run_as_invalid_argument(capped, tiny_models, garbage, says):
    daemon, model = capped
    start = _pause_at_first_block(tiny_models["gpt2"], 60)
    stream = Stream(daemon.address)
    try:
        stream.send(start)
        stream.until_paused()
        stream.send(start if garbage is None else garbage)
        err = stream.error()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in err.details()
    finally:
        stream.close()
    assert torch.isfinite(_logits(model)).all()


# ------------------------------------------------------------------ the deadline wakes a paused run


def test_the_daemons_deadline_ends_a_paused_run(tmp_path, tiny_models):
    daemon = start_daemon(tmp_path, "--deadline", "20", "--max-pause", "0", "--max-paused-total", "0")
    try:
        model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
        want = _logits(model)
        attacker = Stream(daemon.address)
        try:
            attacker.send(_pause_at_first_block(tiny_models["gpt2"], 1e6))
            attacker.until_paused()
            from nnd.cli import _progress

            paused = [r for r in _requests(daemon.address) if r.state == "paused"]
            assert len(paused) == 1 and "at a sync point" in _progress(paused[0])
            err = attacker.error()
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "deadline" in err.details() and "paused at a sync point" in err.details()
        finally:
            attacker.close()
        assert torch.equal(_logits(model), want)
    finally:
        daemon.stop()


# ------------------------------------------------------------------ the worker's byte budget


def test_the_worker_holds_queued_requests_to_max_inflight_bytes(tmp_path, tiny_models):
    daemon = start_daemon(
        tmp_path, "--max-inflight-bytes", "2MiB", "--max-pause", "0", "--max-paused-total", "0"
    )
    try:
        model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
        with grpc.insecure_channel(daemon.address) as channel:
            route = nnd_pb2_grpc.NndStub(channel).GetRoute(nnd_pb2.RouteRequest(model=model.name), timeout=30)
        worker = grpc.insecure_channel(route.address)
        trace = worker.unary_stream(
            "/nnd.v1.Nnd/Trace", request_serializer=lambda b: b, response_deserializer=nnd_pb2.TraceResponse.FromString
        )
        big = nnd_pb2.TraceRequest(model=model.name, invokes=[nnd_pb2.Invoke(text="a" * 900_000)]).SerializeToString()
        attacker = Stream(daemon.address)  # holds the model, paused, until the test lets go
        queued = []
        try:
            attacker.send(_pause_at_first_block(tiny_models["gpt2"], 1e6))
            attacker.until_paused()
            for _ in range(2):  # two fit in 2 MiB beside each other
                call = trace(big, timeout=300, metadata=[("nnd-epoch", str(route.epoch))])
                queued.append(call)
                threading.Thread(target=lambda c=call: list(_swallow(c)), daemon=True).start()
            while sum(r.state == "queued" for r in _requests(daemon.address)) < 2:
                threading.Event().wait(0.05)
            with pytest.raises(grpc.RpcError) as refused:
                list(trace(big, timeout=60, metadata=[("nnd-epoch", str(route.epoch))]))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_bytes" in refused.value.details() and "the worker" in refused.value.details()
        finally:
            attacker.close()
            for call in queued:
                call.cancel()
            worker.close()
        assert torch.isfinite(_logits(model)).all()
    finally:
        daemon.stop()


def _swallow(call):
    try:
        yield from call
    except grpc.RpcError:
        return
