"""Stand-ins for what the registry starts and asks (daemon/control/registry.py, `Registry(...)`):
workers that are objects, a clock that moves when told, a fixed GPU list, a helper that
describes a model without building it. In-process and deterministic: a test decides when a
worker dies, answers, or finishes loading."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from nnd.v1 import helper_pb2, nnd_pb2, worker_pb2
from nnd_daemon.control.supervisor import WorkerOrder

# Weight bytes the fake helper reports for every model, per dtype ("" = default).
ESTIMATE = {"": 4000, "float32": 4000, "bfloat16": 2000}


class FakeClock:
    """Unix time that only moves by `advance`."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeGpus:
    """The GPUs the registry may place on: their free bytes, in CUDA's order (None: unknown)."""

    def __init__(self, free: list[int | None]) -> None:
        self.free = free

    def count(self) -> int:
        return len(self.free)

    def free_bytes(self, index: int) -> int | None:
        return self.free[index] if 0 <= index < len(self.free) else None


class FakeHelper:
    """Describes any model as a two-module tree with the sizes in ESTIMATE; builds nothing."""

    def describe(self, ref: helper_pb2.HelperModel) -> helper_pb2.MetaDescription:
        return helper_pb2.MetaDescription(
            architecture="FakeForCausalLM",
            task="text-generation",
            num_parameters=1000,
            estimated_bytes=ESTIMATE,
            modules=[
                nnd_pb2.ModuleInfo(path="", type="FakeForCausalLM"),
                nnd_pb2.ModuleInfo(path="head", type="Linear"),
            ],
        )

    def check_upload(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("no uploads in these tests")

    def close(self) -> None:
        pass


class FakeWorker:
    """A started worker (supervisor.WorkerHandle) that records what the registry asks of it."""

    def __init__(
        self, order: WorkerOrder, pid: int, gate: threading.Event | None, load_error: Exception | None
    ) -> None:
        self.name = order.name
        self.epoch = order.epoch
        self.placement = order.placement
        self._on_exit = order.on_exit
        self.tp_size = 1
        self.fault = ""
        self.last_status: worker_pb2.WorkerStatus | None = None
        self.pids = [pid]
        self.public = f"/fake/m{pid}.sock"
        self.calls: list[str] = []  # what the registry asked, in order
        self.load_request: worker_pb2.WorkerLoadRequest | None = None
        # What the next status() answers; a test sets `active` to stand for requests sent to the route.
        self.answer = worker_pb2.WorkerStatus(dtype=order.placement.dtype or "float32")
        self.exit_reason = ""
        self.stopped = False
        self._gate = gate  # load() waits on it when set: a test holds a dispatch in DISPATCHING
        self._load_error = load_error  # load() fails with it (weights that cannot be read)
        self.loading = threading.Event()

    @property
    def address(self) -> str:
        return "unix://" + self.public

    @property
    def fast_address(self) -> str:
        return ""

    def configure(self, config: worker_pb2.WorkerConfig) -> None:
        self.calls.append("configure")

    def load(self, request: worker_pb2.WorkerLoadRequest) -> Iterator[nnd_pb2.DispatchProgress]:
        self.calls.append("load")
        self.load_request = request
        self.loading.set()
        if self._gate is not None:
            assert self._gate.wait(30), "the test never let the load finish"
        if self._load_error is not None:
            raise self._load_error
        yield nnd_pb2.DispatchProgress(stage="loading", message="weights", done=1, total=1)
        yield nnd_pb2.DispatchProgress(stage="ready", message="loaded")

    def status(self) -> worker_pb2.WorkerStatus | None:
        self.calls.append("status")
        if self.stopped or self.exit_reason:
            return None
        self.last_status = worker_pb2.WorkerStatus()
        self.last_status.CopyFrom(self.answer)
        return self.last_status

    def watch(self, interval: float, timeout: float, misses: int) -> None:
        self.calls.append("watch")

    def wait_exit(self, timeout: float) -> str:
        return self.exit_reason

    def stop(self) -> None:
        self.calls.append("stop")
        self.stopped = True

    def forward(self, *args: object, **kwargs: object) -> Iterator[bytes]:
        raise AssertionError("the registry forwards nothing")

    def interact(self, *args: object, **kwargs: object) -> Iterator[bytes]:
        raise AssertionError("the registry forwards nothing")

    def die(self, reason: str, *, hung: bool = False) -> None:
        """End unasked, as a crash does (or the watchdog's kill, with `hung`): the registry hears it."""
        if hung:
            self.fault = reason
        self.exit_reason = reason
        self._on_exit(self, reason)


class FakeLauncher:
    """A WorkerFactory that starts FakeWorkers and keeps them, in start order."""

    def __init__(self) -> None:
        self.workers: list[FakeWorker] = []
        self.fail: Exception | None = None  # raised by the next start (a worker that exits at start)
        self.load_error: Exception | None = None  # the next worker's load fails with it
        self.gate: threading.Event | None = None  # handed to the workers started next
        self._started = threading.Condition()
        self._pids = iter(range(40_000, 50_000))

    def __call__(self, order: WorkerOrder) -> FakeWorker:
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        worker = FakeWorker(order, next(self._pids), self.gate, self.load_error)
        self.load_error = None
        with self._started:
            self.workers.append(worker)
            self._started.notify_all()
        return worker

    def of(self, name: str) -> list[FakeWorker]:
        return [w for w in self.workers if w.name == name]

    def wait_started(self, n: int, timeout: float = 30.0) -> FakeWorker:
        """The n-th worker (1-based), once started (by a background re-dispatch, say)."""
        with self._started:
            assert self._started.wait_for(lambda: len(self.workers) >= n, timeout), f"{n} workers never started"
            return self.workers[n - 1]
