"""The registry's lifecycle bookkeeping, in-process: load -> dispatch -> keep-alive expiry, the LRU
cap, worker death and re-dispatch (a new epoch), a hung worker's restart limit, placement checks
against the GPU list, and unload. Workers, clock, GPUs and helper are fakes (registry_fakes.py), so
each step happens when the test says: no process, no sleeping. What a real worker process does
(crash isolation, memory coming back, the watchdog's pings) is tested against a daemon in
tests/test_faults.py, tests/test_lifecycle.py and tests/test_placement.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from registry_fakes import ESTIMATE, FakeClock, FakeGpus, FakeHelper, FakeLauncher

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.control import statefile
from nnd_daemon.control.registry import Registry
from nnd_daemon.control.settings import Limits, Settings

META, DISPATCHED = nnd_pb2.META, nnd_pb2.DISPATCHED
A, B, C = "org/model-a", "org/model-b", "org/model-c"


class World:
    """A registry on fakes, and the fakes, for one test."""

    def __init__(self, tmp: str, gpus: list[int | None], **settings: object) -> None:
        self.settings = Settings(address=f"unix://{tmp}/nnd.sock", state_dir=tmp, **settings)
        self.clock = FakeClock()
        self.launcher = FakeLauncher()
        self.registry = Registry(
            self.settings,
            start_worker=self.launcher,
            gpu_query=FakeGpus(gpus),
            clock=self.clock,
            helper=FakeHelper(),  # type: ignore[arg-type]
            reap_every_s=0,  # keep-alive is checked when a test calls reap()
        )

    def load(self, *names: str) -> None:
        for name in names:
            self.registry.load(nnd_pb2.LoadModelRequest(model=name))

    def dispatch(self, name: str, placement: nnd_pb2.Placement | None = None, keep_alive: str = "") -> list[str]:
        """Dispatch; the progress stages it reported."""
        return [p.stage for p in self.registry.dispatch(name, placement, keep_alive)]

    def ps(self) -> dict[str, nnd_pb2.ModelInfo]:
        """What ListModels (`nnd ps`) answers, by model."""
        return {e.name: self.registry.info(e) for e in self.registry.entries()}

    def wait(self, check: Callable[[], bool]) -> None:
        """Until a state change the registry announces makes `check` true (a background re-dispatch)."""
        reg = self.registry
        with reg._changed:
            assert reg._changed.wait_for(check, 30), "the registry never reached the state"


@pytest.fixture
def world(tmp_path) -> Iterator[World]:
    w = World(str(tmp_path), gpus=[])
    yield w
    w.registry.shutdown()


def test_load_is_meta_and_dispatch_starts_one_configured_worker(world):
    world.load(A)
    info = world.ps()[A]
    assert info.state == META and not info.worker_pids and not info.route.address
    assert info.estimated_bytes == ESTIMATE[""] and info.architecture == "FakeForCausalLM"
    assert world.launcher.workers == []  # META costs no process

    stages = world.dispatch(A, nnd_pb2.Placement(dtype="bfloat16"))
    assert stages == ["starting", "loading"]  # "ready" is the servicer's to send, with the model
    [worker] = world.launcher.workers
    # Configured (aliases, edits) before its weights load, so no request can reach it unconfigured.
    assert worker.calls[:2] == ["configure", "load"] and "watch" in worker.calls
    assert worker.load_request.model == A and worker.load_request.placement.dtype == "bfloat16"
    info = world.ps()[A]
    assert info.state == DISPATCHED and list(info.worker_pids) == worker.pids
    assert info.dtype == "bfloat16" and info.dispatched_placement.dtype == "bfloat16"
    assert (info.route.address, info.route.epoch) == (worker.address, worker.epoch)
    assert world.registry.route(A).epoch == worker.epoch
    [record] = statefile.read(world.settings.state_file)  # what a restarted daemon brings back
    assert record.dispatched and record.placement["dtype"] == "bfloat16"

    world.dispatch(A)  # already dispatched: no second worker
    assert len(world.launcher.workers) == 1 and not worker.stopped

    world.registry.release(A)
    assert worker.stopped and world.ps()[A].state == META and not world.ps()[A].worker_pids
    assert not statefile.read(world.settings.state_file)[0].dispatched


def test_keep_alive_expiry_releases_an_idle_worker_and_spares_a_busy_one(world):
    world.load(A)
    world.dispatch(A, keep_alive="10s")
    [worker] = world.launcher.workers
    start = world.clock.now
    assert world.ps()[A].expires_at == start + 10

    world.clock.advance(9)
    world.registry.reap()
    assert world.ps()[A].state == DISPATCHED and not worker.stopped

    # Past expiry, but the worker counts a request sent to its route directly: not released,
    # and that activity restarts the keep-alive.
    world.clock.advance(2)
    worker.answer.active = 1
    worker.answer.accepted = 1
    world.registry.reap()
    assert world.ps()[A].state == DISPATCHED and not worker.stopped
    assert world.ps()[A].expires_at == world.clock.now + 10

    worker.answer.active = 0
    worker.answer.idle_since = world.clock.now
    world.clock.advance(10.5)
    world.registry.reap()
    info = world.ps()[A]
    assert worker.stopped and info.state == META and info.expires_at == 0 and not info.last_error


def test_keep_alive_zero_releases_when_the_last_request_is_done(world):
    world.load(A)
    entry = world.registry.acquire(A, auto_dispatch=True, keep_alive="0")
    [worker] = world.launcher.workers
    assert world.ps()[A].state == DISPATCHED
    world.registry.done(entry)
    assert worker.stopped and world.ps()[A].state == META


def test_lru_cap_releases_the_least_recently_used_idle_model(tmp_path):
    w = World(str(tmp_path), gpus=[], limits=Limits(max_dispatched_models=2))
    try:
        w.load(A, B, C)
        w.dispatch(A)
        w.clock.advance(1)
        w.dispatch(B)
        w.clock.advance(1)
        w.dispatch(A)  # touches A: B is now the least recently used
        w.clock.advance(1)
        w.dispatch(C)
        a, b, c = (w.launcher.of(n)[0] for n in (A, B, C))
        ps = w.ps()
        assert b.stopped and not a.stopped and not c.stopped
        assert ps[B].state == META and "make room for org/model-c (cap 2)" in ps[B].last_error
        assert ps[A].state == DISPATCHED and ps[C].state == DISPATCHED

        # A request on A's route (the worker's last Status says so) keeps A from being the victim,
        # though it was used less recently than C.
        a.answer.active = 1
        a.status()
        w.clock.advance(1)
        w.dispatch(B)
        assert c.stopped and not a.stopped and w.ps()[B].state == DISPATCHED

        # Every dispatched model busy: refused, and no worker is started or stopped.
        held = [w.registry.acquire(n, auto_dispatch=False) for n in (A, B)]
        started = len(w.launcher.workers)
        with pytest.raises(errors.ResourceExhausted, match="none is idle"):
            w.dispatch(C)
        assert len(w.launcher.workers) == started and w.ps()[C].state == META
        assert not any(x.stopped for x in (a, w.launcher.of(B)[-1]))
        for entry in held:
            w.registry.done(entry)
    finally:
        w.registry.shutdown()


def test_a_dead_worker_puts_its_model_back_and_the_next_request_redispatches_it_in_a_new_epoch(world):
    world.load(A)
    world.dispatch(A, nnd_pb2.Placement(dtype="bfloat16"))
    [first] = world.launcher.workers
    first.die("killed by SIGKILL")

    info = world.ps()[A]
    assert info.state == META and info.last_error == "worker died: killed by SIGKILL"
    assert not info.worker_pids and not info.route.address
    # A client whose call failed on the old route learns why; no worker was started for a death.
    assert world.registry.route(A, failed_epoch=first.epoch).lost == "killed by SIGKILL"
    assert len(world.launcher.workers) == 1
    with pytest.raises(errors.FailedPrecondition, match="not dispatched"):
        world.registry.acquire(A, auto_dispatch=False)

    entry = world.registry.acquire(A, auto_dispatch=True)  # the next request: same placement
    second = world.launcher.workers[-1]
    assert second is not first and second.epoch > first.epoch
    assert second.placement.dtype == "bfloat16"
    info = world.ps()[A]
    assert info.state == DISPATCHED and info.route.epoch == second.epoch
    assert info.last_error.startswith("re-dispatched") and "killed by SIGKILL" in info.last_error
    world.registry.done(entry)

    # An explicit placement is not overridden by the one before the death.
    second.die("exit code 1")
    world.dispatch(A, nnd_pb2.Placement(dtype="float32"))
    assert world.launcher.workers[-1].placement.dtype == "float32"


def test_a_hung_worker_is_redispatched_until_the_restart_limit(tmp_path):
    w = World(str(tmp_path), gpus=[], restart_limit=1)
    try:
        w.load(A)
        w.dispatch(A)
        first = w.launcher.workers[0]
        first.die("hung: 3 status ping(s) in a row got no answer", hung=True)
        second = w.launcher.wait_started(2)  # re-dispatched by the registry itself, at once
        entry = w.registry.get(A)
        w.wait(lambda: entry.state == DISPATCHED)
        assert second.epoch > first.epoch and w.ps()[A].route.epoch == second.epoch

        second.die("hung again", hung=True)  # the second within the window: over the limit
        info = w.ps()[A]
        assert info.state == META and "not re-dispatched: 1 restart(s)" in info.last_error
        assert len(w.launcher.workers) == 2

        w.dispatch(A)  # a request or `nnd dispatch` brings it back
        w.clock.advance(w.settings.restart_window_s + 1)  # the one restart is out of the window now
        w.launcher.workers[2].die("hung a third time", hung=True)
        fourth = w.launcher.wait_started(4)
        w.wait(lambda: entry.state == DISPATCHED)
        assert w.ps()[A].route.epoch == fourth.epoch
    finally:
        w.registry.shutdown()


def test_a_worker_that_fails_to_start_or_load_leaves_the_model_meta_with_the_reason(world):
    world.load(A)
    world.launcher.fail = errors.Unavailable("worker for org/model-a exited at start: exit code 1")
    with pytest.raises(errors.Unavailable):
        world.dispatch(A)
    info = world.ps()[A]
    assert info.state == META and "exited at start" in info.last_error and not info.worker_pids

    assert world.launcher.workers == []

    world.launcher.load_error = errors.NndError("no weights found")
    with pytest.raises(errors.NndError, match="no weights found"):
        world.dispatch(A)
    [broken] = world.launcher.workers
    info = world.ps()[A]
    assert broken.stopped and info.state == META and info.last_error == "no weights found"

    world.dispatch(A)  # the reason stays until a dispatch succeeds
    assert world.ps()[A].state == DISPATCHED and not world.ps()[A].last_error


def test_unload_during_dispatch_stops_the_worker_it_started(world):
    import threading

    world.load(A)
    world.launcher.gate = threading.Event()
    outcome: list[BaseException | None] = []

    def dispatch() -> None:
        try:
            world.dispatch(A)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    t = threading.Thread(target=dispatch)
    t.start()
    worker = world.launcher.wait_started(1)
    assert worker.loading.wait(30)
    entry = world.registry.get(A)
    u = threading.Thread(target=world.registry.unload, args=(A,))
    u.start()
    world.wait(lambda: entry.gone)  # unloaded while its weights load
    world.launcher.gate.set()
    t.join(30)
    u.join(30)
    assert isinstance(outcome[0], errors.Unavailable) and "unloaded" in str(outcome[0])
    assert worker.stopped and A not in world.ps()
    with pytest.raises(errors.NotFound):
        world.registry.get(A)
    assert statefile.read(world.settings.state_file) == []


def test_unload_of_a_dispatched_model_stops_its_worker(world):
    world.load(A, B)
    world.dispatch(A)
    [worker] = world.launcher.workers
    world.registry.unload(A)
    assert worker.stopped and list(world.ps()) == [B]
    assert [r.name for r in statefile.read(world.settings.state_file)] == [B]


def test_placement_is_checked_against_the_gpus_before_any_worker_starts(tmp_path):
    big = ESTIMATE[""]
    w = World(str(tmp_path), gpus=[big * 10, big // 2])
    try:
        w.load(A)
        with pytest.raises(errors.FailedPrecondition, match="sees 2 GPUs"):
            w.dispatch(A, nnd_pb2.Placement(device="cuda:2"))
        with pytest.raises(errors.ResourceExhausted, match="free memory of cuda:1"):
            w.dispatch(A, nnd_pb2.Placement(device="cuda:1"))
        assert w.launcher.workers == [] and w.ps()[A].state == META
        w.dispatch(A, nnd_pb2.Placement(device="cuda:1", dtype="bfloat16"))  # half the bytes: fits
        assert w.launcher.workers[0].placement.device == "cuda:1"
    finally:
        w.registry.shutdown()


def test_no_placement_means_the_first_gpu_when_there_is_one(tmp_path):
    w = World(str(tmp_path), gpus=[ESTIMATE[""] // 2])
    try:
        w.load(A)
        with pytest.raises(errors.ResourceExhausted, match="free memory of cuda:0"):
            w.dispatch(A)
        assert w.launcher.workers == []
    finally:
        w.registry.shutdown()
    # Without a GPU the same model goes to the CPU (host memory is far above its estimate).
    w = World(str(tmp_path / "cpu"), gpus=[])
    try:
        w.load(A)
        w.dispatch(A)
        assert w.ps()[A].state == DISPATCHED
    finally:
        w.registry.shutdown()
