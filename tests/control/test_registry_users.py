"""Per-user caps and ownership in the registry, in-process on fakes (registry_fakes.py): a user's
dispatched models and their estimated weight bytes are capped, another user's model is released only
with force, and what ended workers counted stays in the metrics' totals. The same against a real
daemon, with real uids: tests/test_ownership.py."""

from __future__ import annotations

import pytest
from registry_fakes import FakeClock, FakeGpus, FakeHelper, FakeLauncher

from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon import errors
from nnd_daemon.control import events
from nnd_daemon.control.registry import Registry
from nnd_daemon.control.settings import Settings, UserLimits

A, B, C = "org/model-a", "org/model-b", "org/model-c"


def _registry(tmp: str, users: UserLimits) -> Registry:
    settings = Settings(address=f"unix://{tmp}/nnd.sock", state_dir=tmp, users=users)
    return Registry(
        settings, start_worker=FakeLauncher(), gpu_query=FakeGpus([]), clock=FakeClock(),
        helper=FakeHelper(),  # type: ignore[arg-type]
        reap_every_s=0,
    )


def _dispatch(reg: Registry, name: str, user: str) -> None:
    for _ in reg.dispatch(name, user=user):
        pass


def test_a_user_may_dispatch_at_most_max_models_and_others_are_unaffected(tmp_path):
    reg = _registry(str(tmp_path), UserLimits(max_models=1))
    try:
        for name in (A, B, C):
            reg.load(nnd_pb2.LoadModelRequest(model=name), user="alice")
        _dispatch(reg, A, "alice")
        with pytest.raises(errors.ResourceExhausted, match=r"alice has 1 model\(s\) dispatched.*max_models_per_user=1"):
            _dispatch(reg, B, "alice")
        _dispatch(reg, B, "bob")  # another user's cap is their own
        assert reg.get(B).dispatched_by == "bob" and reg.get(A).dispatched_by == "alice"
        reg.release(A, user="alice")
        _dispatch(reg, C, "alice")  # room again
    finally:
        reg.shutdown()


def test_a_users_models_may_hold_at_most_max_memory_bytes(tmp_path):
    reg = _registry(str(tmp_path), UserLimits(max_memory_bytes=6000))  # the fakes' models are 4000 bytes each
    try:
        for name in (A, B):
            reg.load(nnd_pb2.LoadModelRequest(model=name))
        _dispatch(reg, A, "alice")
        with pytest.raises(errors.ResourceExhausted, match="max_memory_per_user=6000"):
            _dispatch(reg, B, "alice")
        assert reg.get(B).state == nnd_pb2.META
    finally:
        reg.shutdown()


def test_releasing_another_users_model_needs_force_and_tells_later_clients_who(tmp_path):
    reg = _registry(str(tmp_path), UserLimits())
    try:
        reg.load(nnd_pb2.LoadModelRequest(model=A))
        _dispatch(reg, A, "alice")
        epoch = reg.get(A).worker.epoch
        with pytest.raises(errors.FailedPrecondition, match="dispatched by alice"):
            reg.release(A, user="bob")
        with pytest.raises(errors.FailedPrecondition, match="dispatched by alice"):
            reg.unload(A, user="bob")
        assert reg.get(A).state == nnd_pb2.DISPATCHED
        reg.release(A, user="bob", force=True)
        lost = reg.route(A, failed_epoch=epoch).lost
        assert lost.startswith("was released by bob at ") and "UTC" in lost
        reg.release(A)  # the daemon's own releases (keep-alive) are never refused
    finally:
        reg.shutdown()


def _status(trace_ok: int, tokens: int) -> worker_pb2.WorkerStatus:
    status = worker_pb2.WorkerStatus()
    status.stats.requests.add(kind="trace", status="ok", count=trace_ok)
    lat = status.stats.latency.add(kind="trace")
    for h in (lat.queue_wait, lat.run):
        h.bounds.extend([0.1, 1.0])
        h.counts.extend([trace_ok, trace_ok])
        h.sum, h.count = 0.05 * trace_ok, trace_ok
    status.stats.tokens_generated = tokens
    status.stats.refusals["max_invokes"] = 1
    return status


def test_what_ended_workers_counted_is_added_to_the_next_ones():
    ev = events.Events()
    ev.retire("m", _status(2, 3))
    ev.retire("m", _status(5, 7))
    total = events.add_stats(ev.retired_stats("m"), _status(1, 1).stats)
    assert [(r.kind, r.status, r.count) for r in total.requests] == [("trace", "ok", 8)]
    assert total.tokens_generated == 11 and total.refusals["max_invokes"] == 3
    (lat,) = total.latency
    assert list(lat.run.counts) == [8, 8] and lat.run.count == 8 and lat.run.sum == pytest.approx(0.4)
