"""Fair turns on one model: a short request runs between two steps of a long generation, and the
generation computes exactly what it computes alone (its hooks set aside, its sampling untouched).

The interleaving is forced, not hoped for: the generation's step emitter blocks until the trace is
queued for the model, so the trace is certainly waiting when the generation reaches a step boundary.
"""

from __future__ import annotations

import threading
import time

import wire_results
from graphs import Graph
from torch.testing import assert_close

from nnd.v1 import contract, nnd_pb2, worker_pb2
from nnd_daemon.worker.service import WorkerService
from nnd_daemon.worker.turns import Turns

PROMPT = "The Eiffel Tower is"
OTHER = "Hello world, this is a tiny"
STEPS = 6


def _until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


# ------------------------------------------------------------------ the lock itself


def test_turns_are_handed_over_in_arrival_order():
    turns = Turns()
    order: list[int] = []
    turns.acquire()
    threads = []
    for i in range(4):
        t = threading.Thread(target=lambda i=i: (turns.acquire(), order.append(i), turns.release()))
        t.start()
        threads.append(t)
        _until(lambda i=i: turns.waiting() == i + 1, f"waiter {i} queued")
    turns.release()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3]
    assert not turns.locked()


def test_lend_lets_every_current_waiter_run_first_and_nobody_later():
    turns = Turns()
    log: list[str] = []
    turns.acquire()
    waiters = [threading.Thread(target=lambda n=n: (turns.acquire(), log.append(n), turns.release())) for n in "ab"]
    for i, t in enumerate(waiters):
        t.start()
        _until(lambda i=i: turns.waiting() == i + 1, "waiters queued")
    import contextlib

    @contextlib.contextmanager
    def set_aside():  # what the lender does while others hold the model (its hooks, its random state)
        log.append("aside")
        yield
        log.append("back")

    turns.lend(set_aside)  # returns once a and b have had their turn
    log.append("lender")
    assert log == ["aside", "a", "b", "back", "lender"] and turns.lent == 1
    turns.lend(set_aside)  # nobody waiting: returns at once, nothing set aside
    assert turns.lent == 1 and log[-1] == "lender"
    turns.release()
    assert not turns.locked()


def test_a_timed_out_waiter_leaves_the_queue():
    turns = Turns()
    turns.acquire()
    assert turns.acquire(timeout=0.01) is False and turns.waiting() == 0
    turns.release()
    assert turns.acquire(timeout=0.01) is True


# ------------------------------------------------------------------ a worker's requests


def _generation(gpt2) -> worker_pb2.WorkerRunRequest:
    g = Graph()
    scope = g.loop()
    g.save(g.module("transformer.h.1", scope=scope), scope=scope)
    g.save(g.module("", "result"))
    opts = nnd_pb2.GenerateOptions(max_new_tokens=STEPS, do_sample=True, seed=7, min_new_tokens=STEPS)
    return worker_pb2.WorkerRunRequest(request=g.request(PROMPT, generate=opts), generate=True)


def _trace() -> worker_pb2.WorkerRunRequest:
    g = Graph()
    h = g.module("transformer.h.0")
    g.op("setitem", h, (slice(None), -1, slice(None)), 0.0)  # an edit: the generation must not see it
    g.save(g.module("lm_head"))
    return worker_pb2.WorkerRunRequest(request=g.request(OTHER))


def _service(gpt2) -> WorkerService:
    svc = WorkerService()
    svc.model, svc.tokenizer = gpt2.model, gpt2.tokenizer
    return svc


def _alone(svc: WorkerService, request: worker_pb2.WorkerRunRequest) -> list[nnd_pb2.TraceResponse]:
    out: list[nnd_pb2.TraceResponse] = []
    svc._work(request, out.append, threading.Event(), lambda: None)
    return out


def _steps(msgs: list[nnd_pb2.TraceResponse]) -> list[list[int]]:
    return [list(m.step.ids) for m in msgs if m.WhichOneof("kind") == "step"]


def test_a_trace_runs_between_two_steps_of_a_generation(gpt2):
    svc = _service(gpt2)
    gen_alone, trace_alone = _alone(svc, _generation(gpt2)), _alone(svc, _trace())
    events: list[str] = []
    gen_out: list[nnd_pb2.TraceResponse] = []
    trace_out: list[nnd_pb2.TraceResponse] = []
    at_step = threading.Event()

    def gen_emit(msg: nnd_pb2.TraceResponse) -> None:
        gen_out.append(msg)
        if msg.WhichOneof("kind") != "step":
            return
        events.append(f"step {msg.step.step}")
        if msg.step.step == 1:
            at_step.set()
            _until(lambda: svc._run_lock.waiting() == 1, "the trace to queue for the model")

    def run_trace() -> None:
        svc._work(_trace(), trace_out.append, threading.Event(), lambda: None)
        events.append("trace done")

    gen = threading.Thread(target=svc._work, args=(_generation(gpt2), gen_emit, threading.Event(), lambda: None))
    gen.start()
    assert at_step.wait(60)
    trace = threading.Thread(target=run_trace)
    trace.start()
    gen.join(60)
    trace.join(60)
    # The trace took the model between step 1 and step 2, not after the whole generation.
    assert events.index("trace done") == events.index("step 1") + 1, events
    assert events[-1] == f"step {STEPS - 1}" and svc._run_lock.lent >= 1
    # Each computed what it computes alone: same sampled tokens, same per-step values, same logits.
    assert _steps(gen_out) == _steps(gen_alone)
    got, want = wire_results.collect(gen_out), wire_results.collect(gen_alone)
    assert got.keys() == want.keys()
    for key in want:
        assert_close(got[key], want[key], atol=0, rtol=0)
    got, want = wire_results.collect(trace_out), wire_results.collect(trace_alone)
    for key in want:
        assert_close(got[key], want[key], atol=0, rtol=0)
    assert not svc._run_lock.locked()


# ------------------------------------------------------------------ what `nnd ps` sees


class _Context:
    """The parts of a gRPC servicer context `WorkerService.run` uses."""

    def __init__(self, client: str) -> None:
        self.client = client

    def add_callback(self, fn) -> bool:
        return True

    def send_initial_metadata(self, md) -> None:
        pass

    def invocation_metadata(self):
        return (("nnd-client", self.client),)

    def peer(self) -> str:
        return "unix:"

    def is_active(self) -> bool:
        return True


def test_status_lists_requests_in_flight_with_their_step_and_place_in_line(gpt2):
    svc = _service(gpt2)
    at_step = threading.Event()
    seen: dict[str, list] = {}

    def run_generation() -> None:
        for msg in svc.run(_generation(gpt2), _Context("alice@box:1")):
            if msg.WhichOneof("kind") == "step" and msg.step.step == 1:
                at_step.set()

    # The generation's step 2 waits (in its emitter) until the trace has queued; the status is read then.
    def gen_emit_hook(msg: nnd_pb2.TraceResponse) -> None:
        if msg.WhichOneof("kind") == "step" and msg.step.step == 2:
            _until(lambda: svc._run_lock.waiting() == 1, "the trace to queue")
            seen["during"] = list(svc.Status(None, None).requests)

    original = svc._work

    def work(request, emit, stop, started):
        if request.generate:
            inner = emit

            def emit(msg, inner=inner):  # noqa: ANN001
                inner(msg)
                gen_emit_hook(msg)

        return original(request, emit, stop, started)

    svc._work = work
    gen = threading.Thread(target=run_generation)
    gen.start()
    assert at_step.wait(60)
    trace_msgs: list = []
    trace = threading.Thread(target=lambda: trace_msgs.extend(svc.run(_trace(), _Context("bob@box:2"))))
    trace.start()
    gen.join(60)
    trace.join(60)
    during = seen["during"]
    assert [(r.kind, r.state, r.client) for r in during] == [
        ("generate", "running", "alice@box:1"),
        ("trace", "queued", "bob@box:2"),
    ]
    assert during[0].steps == STEPS and 1 <= during[0].step <= 3 and during[1].position == 1
    # The trace's client heard at once why it waits: one request (the generation) ahead of it.
    assert trace_msgs[0].WhichOneof("kind") == "queued" and trace_msgs[0].queued.ahead == 1
    assert trace_msgs[-1].WhichOneof("kind") == "done"
    after = svc.Status(None, None)
    assert not after.requests and after.idle_since >= max(r.since for r in during)


class _MetadataContext(_Context):
    def __init__(self, client: str) -> None:
        super().__init__(client)
        self.metadata: list = []

    def send_initial_metadata(self, md) -> None:
        self.metadata.extend(md)


def test_a_trace_queued_behind_a_trace_says_nnd_queued_but_no_queued_message(gpt2):
    """Behind another trace a trace waits a forward or two: it still says `nnd-queued` (so a worker's death
    is reported as before it ran), then hears its turn (RUNNING) and gets its results, one message when it
    asked so; no Queued message, which behind many clients' traces was every trace's (and a printed line)."""
    from nnd_daemon.worker import service as service_mod

    svc = _service(gpt2)
    first_done = threading.Event()
    release = threading.Event()
    original = svc._execute

    def execute(request, emit, cancelled):  # the first trace holds the model until the second has queued
        if not first_done.is_set():
            first_done.set()
            assert release.wait(60)
        return original(request, emit, cancelled)

    svc._execute = execute
    first_out: list = []
    first = threading.Thread(target=lambda: first_out.extend(svc.run(_trace(), _Context("alice@box:1"))))
    first.start()
    assert first_done.wait(60)
    request = _trace()
    request.request.one_message = True
    ctx = _MetadataContext("bob@box:2")
    second_out: list = []
    second = threading.Thread(target=lambda: second_out.extend(svc.run(request, ctx)))
    second.start()
    _until(lambda: svc._run_lock.waiting() == 1, "the second trace to queue")
    release.set()
    first.join(60)
    second.join(60)
    assert (contract.QUEUED_KEY, "1") in ctx.metadata
    assert second_out[0] == service_mod.RUNNING
    whole = nnd_pb2.TraceResponse.FromString(second_out[1])
    assert len(second_out) == 2 and whole.WhichOneof("kind") == "results"
    got = wire_results.collect([nnd_pb2.TraceResponse(saved=s) for s in whole.results.saved])
    want = wire_results.collect(first_out)
    for key in want:
        assert_close(got[key], want[key], atol=0, rtol=0)
