"""Cross-client batching (daemon/worker/batching.py) against a real daemon.

Concurrent compatible Traces are merged into one forward. Batching changes the
matmul's batch size, and float32 kernels may then block the work differently:
results equal the same requests run one at a time up to ATOL/RTOL below
(measured: at most 3e-7 on the tiny GPT-2), not bit for bit.

That merging happened is read from the worker's log in the daemon's state
dir (`logs/`): the batcher logs "batched N requests ... in one forward".
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
import wire_results
from daemonproc import Daemon, start_daemon

from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
from nnd_daemon.engine import wire

ATOL = 1e-5
RTOL = 1e-5
# Long enough that threads started together always land in one gathering window.
WINDOW_MS = "400"
PROMPTS = ["hello world", "hello wordl", "hello worle", "hello worla"]  # one tokenized length


@pytest.fixture(scope="module")
def batching_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("batching"), "--batch-window-ms", WINDOW_MS, in_process=True)
    stub = nnd_pb2_grpc.NndStub(grpc.insecure_channel(d.address))
    stub.LoadModel(nnd_pb2.LoadModelRequest(model=tiny_models["gpt2"], dispatch=True), timeout=120)
    yield d
    d.stop()


def _stub(d: Daemon) -> Any:
    return nnd_pb2_grpc.NndStub(grpc.insecure_channel(d.address))


def _expanded_copy(g: graph_pb2.Graph, source: int, first_id: int, rows: int) -> int:
    """Nodes first_id, first_id + 1: `source` (1, n, 64) expanded to `rows` rows and made contiguous; returns the last id."""
    n = g.nodes.add(id=first_id)
    n.op.name = "expand"
    n.op.args.add().ref = source
    for size in (rows, -1, -1):
        n.op.args.add().value.int = size
    n = g.nodes.add(id=first_id + 1)
    n.op.name = "contiguous"
    n.op.args.add().ref = first_id
    return first_id + 1


def _request(model: str, text: str, *, extra: Callable[[graph_pb2.Graph], None] | None = None) -> Any:
    """Save h[0]'s output, its sum, and a 100x expanded copy (chunked: blob ids are renumbered)."""
    g = graph_pb2.Graph()
    n = g.nodes.add(id=3)
    n.module.path, n.module.point, n.module.invoke = "transformer.h.0", graph_pb2.OUTPUT, 0
    g.nodes.add(id=5).save.value.ref = 3
    n = g.nodes.add(id=7)
    n.op.name = "sum"
    n.op.args.add().ref = 3
    g.nodes.add(id=9).save.value.ref = 7
    g.nodes.add(id=13).save.value.ref = _expanded_copy(g, 3, 11, 100)
    if extra is not None:
        extra(g)
    request = nnd_pb2.TraceRequest(model=model, graph=g)
    request.invokes.add(text=text)
    return request


def _run(d: Daemon, request: Any) -> dict[int, Any] | grpc.RpcError:
    try:
        return wire_results.collect(_stub(d).Trace(request, timeout=120))
    except grpc.RpcError as err:
        return err


def _concurrently(d: Daemon, requests: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def one(i: int) -> None:
        channel = grpc.insecure_channel(d.address)
        grpc.channel_ready_future(channel).result(timeout=30)  # connected before the barrier: they arrive together
        stub = nnd_pb2_grpc.NndStub(channel)
        barrier.wait()
        try:
            out[i] = wire_results.collect(stub.Trace(requests[i], timeout=120))
        except grpc.RpcError as err:
            out[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _log(d: Daemon) -> str:
    """The workers' logs (an in-process daemon's workers log to the daemon's own)."""
    return d.log() + "".join(
        pathlib.Path(p).read_text(errors="replace") for p in glob.glob(os.path.join(d.state_dir, "logs", "*"))
    )


def _batched_counts(d: Daemon) -> list[int]:
    return [int(m) for m in re.findall(r"batched (\d+) requests", _log(d))]


def _slow(g: graph_pb2.Graph) -> None:
    """Adds ~0.3 s of work in the worker: sum over h[0] expanded to 400k rows (~300 MB) and copied."""
    copy = _expanded_copy(g, 3, 50, 400_000)
    n = g.nodes.add(id=52)
    n.op.name = "sum"
    n.op.args.add().ref = copy
    g.nodes.add(id=53).save.value.ref = 52


def _until(d: Daemon, model: str, check: Any, what: str, timeout: float = 120) -> None:
    """Until the states ("running", "queued") of the requests the worker of `model` holds pass
    `check` (polled: a slow trace takes 0.3 s or more)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(d.address) as channel:
        stub = nnd_pb2_grpc.NndStub(channel)
        while True:
            info = stub.GetModel(nnd_pb2.GetModelRequest(model=model), timeout=30)
            states = [r.state for r in info.requests]
            if check(states):
                return
            assert time.monotonic() < deadline, f"{what}: the worker holds {states}"
            time.sleep(0.005)


def _started_slow(d: Daemon, model: str) -> Any:
    """A slow trace in flight: the daemon's gathering queue for `model` is busy until it is done.
    Returned once the worker runs it, so what is sent next queues behind it."""
    call = _stub(d).Trace(_request(model, PROMPTS[0], extra=_slow), timeout=120)
    _until(d, model, lambda states: "running" in states, "the slow trace running")
    return call


def _queued(d: Daemon, requests: list[Any]) -> list[Any]:
    """`requests` sent together while a slow trace holds the model: they queue, and run merged after it."""
    slow = _started_slow(d, requests[0].model)
    out = _concurrently(d, requests)
    assert wire_results.collect(slow)[53].shape == ()
    return out


def _same(a: dict[int, Any], b: dict[int, Any]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=RTOL)


def test_concurrent_traces_are_merged_and_match_alone(batching_daemon: Daemon, tiny_models: dict[str, str]) -> None:
    requests = [_request(tiny_models["gpt2"], p) for p in PROMPTS]
    alone = [_run(batching_daemon, r) for r in requests]
    before = sum(_batched_counts(batching_daemon))
    together = _queued(batching_daemon, requests)
    for a, t in zip(alone, together, strict=True):
        assert isinstance(a, dict) and isinstance(t, dict), (a, t)
        _same(a, t)
        assert t[13].shape == (100, len(t[5][0]), 64)
    assert sum(_batched_counts(batching_daemon)) - before >= 2, "no request was merged with another"


def test_a_failing_request_fails_alone(batching_daemon: Daemon, tiny_models: dict[str, str]) -> None:
    def bad(g: graph_pb2.Graph) -> None:  # a shape error at run time: (1, n, 64) + (3,)
        n = g.nodes.add(id=20)
        n.op.name = "add"
        n.op.args.add().ref = 3
        n.op.args.add().value.tensor.CopyFrom(wire.Encoder().tensor(torch.ones(3)))
        g.nodes.add(id=21).save.value.ref = 20

    model = tiny_models["gpt2"]
    requests = [_request(model, PROMPTS[0]), _request(model, PROMPTS[1], extra=bad), _request(model, PROMPTS[2])]
    alone = [_run(batching_daemon, r) for r in requests]
    assert isinstance(alone[1], grpc.RpcError)
    before = _log(batching_daemon).count("batched run of 3 requests failed")
    together = _queued(batching_daemon, requests)
    assert _log(batching_daemon).count("batched run of 3 requests failed") == before + 1, "they were not merged"
    assert isinstance(together[1], grpc.RpcError)
    assert together[1].code() == alone[1].code()
    assert together[1].details() == alone[1].details()
    for i in (0, 2):
        assert isinstance(together[i], dict), together[i]
        _same(alone[i], together[i])


def test_requests_that_do_not_qualify_still_run_concurrently(
    batching_daemon: Daemon, tiny_models: dict[str, str]
) -> None:
    model = tiny_models["gpt2"]

    def whole_batch(g: graph_pb2.Graph) -> None:  # a RESULT read: the whole batch's output
        n = g.nodes.add(id=30)
        n.module.path, n.module.point = "", graph_pb2.RESULT
        g.nodes.add(id=31).save.value.ref = 30

    def stop(g: graph_pb2.Graph) -> None:
        g.nodes.add(id=40).stop.SetInParent()

    requests = [
        _request(model, PROMPTS[0]),
        _request(model, PROMPTS[1], extra=whole_batch),
        _request(model, PROMPTS[2], extra=stop),
        _request(model, "a much longer prompt than the others"),  # another length
        _request(model, PROMPTS[3]),
    ]
    alone = [_run(batching_daemon, r) for r in requests]
    together = _queued(batching_daemon, requests)
    for a, t in zip(alone, together, strict=True):
        assert isinstance(a, dict) and isinstance(t, dict), (a, t)
        assert sorted(a) == sorted(t)
        for k in (5, 9, 13):
            torch.testing.assert_close(a[k], t[k], atol=ATOL, rtol=RTOL)
    # The RESULT read came back whole (alone: its own row only).
    assert together[1][31]["logits"].shape[0] == 1


def test_zero_window_turns_batching_off(tmp_path: pathlib.Path, tiny_models: dict[str, str]) -> None:
    d = start_daemon(tmp_path, "--batch-window-ms", "0", in_process=True)
    try:
        stub = _stub(d)
        stub.LoadModel(nnd_pb2.LoadModelRequest(model=tiny_models["gpt2"], dispatch=True), timeout=120)
        together = _concurrently(d, [_request(tiny_models["gpt2"], p) for p in PROMPTS])
        assert all(isinstance(t, dict) for t in together)
        assert _batched_counts(d) == []
    finally:
        d.stop()


def test_a_request_that_leaves_the_queue_does_not_stall_the_others(batching_daemon: Daemon, tiny_models) -> None:
    """Requests queued behind a running one that time out or are cancelled do not hold up the queue;
    the ones after them still run, with the numbers they have alone."""
    model = tiny_models["gpt2"]
    expected = _run(batching_daemon, _request(model, PROMPTS[1]))
    assert isinstance(expected, dict)
    slow = _started_slow(batching_daemon, model)
    with pytest.raises(grpc.RpcError) as late:
        list(_stub(batching_daemon).Trace(_request(model, PROMPTS[1]), timeout=0.05))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cancelled = _stub(batching_daemon).Trace(_request(model, PROMPTS[2]), timeout=120)
    waiting = []
    thread = threading.Thread(target=lambda: waiting.append(_run(batching_daemon, _request(model, PROMPTS[1]))))
    thread.start()
    # Both queued behind the slow one (the one that timed out has left) before one of them is cancelled.
    _until(batching_daemon, model, lambda states: states.count("queued") >= 2, "two traces queued")
    cancelled.cancel()
    assert wire_results.collect(slow)[53].shape == ()
    thread.join(60)
    assert not thread.is_alive(), "a request queued behind a cancelled one never ran"
    assert isinstance(waiting[0], dict), waiting[0]
    _same(expected, waiting[0])
    with pytest.raises(grpc.RpcError) as gone:
        list(cancelled)
    assert gone.value.code() == grpc.StatusCode.CANCELLED
    _same(expected, _run(batching_daemon, _request(model, PROMPTS[1])))


def test_a_killed_worker_fails_the_whole_batch_and_says_it_was_running(tmp_path, tiny_models) -> None:
    d = start_daemon(tmp_path, "--batch-window-ms", WINDOW_MS)
    try:
        stub = _stub(d)
        model = tiny_models["gpt2"]
        stub.LoadModel(nnd_pb2.LoadModelRequest(model=model, dispatch=True), timeout=120)
        (info,) = stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=30).models
        # Four slow requests queue behind a fifth and then run merged (~4x its time); the kill lands mid-batch.
        slow = _started_slow(d, model)
        outcomes: list[Any] = []
        batch = threading.Thread(
            target=lambda: outcomes.extend(_concurrently(d, [_request(model, p, extra=_slow) for p in PROMPTS]))
        )
        batch.start()
        assert isinstance(wire_results.collect(slow)[53], torch.Tensor)  # the batch starts as this one ends
        time.sleep(0.2)
        os.kill(info.worker_pids[0], signal.SIGKILL)
        batch.join(60)
        assert len(PROMPTS) not in _batched_counts(d), "the slow batch finished before the worker was killed"
        for out in outcomes:
            assert isinstance(out, grpc.RpcError), "a request of the killed batch finished"
            assert out.code() == grpc.StatusCode.UNAVAILABLE, out.details()
            assert "killed by SIGKILL" in out.details() and "while running this request" in out.details(), out.details()
    finally:
        d.stop()


class _LeavesAtStart:
    """A queued request whose client cancels it at the worst moment: after the batcher has checked it
    is still there and before it is told it has the model. grpc's `send_initial_metadata` raises
    on a cancelled call, which is what `started` does here, and from then on it reads as cancelled."""

    def __init__(self) -> None:
        self.gone = False

    def cancelled(self) -> bool:
        return self.gone

    def started(self) -> None:
        self.gone = True
        raise grpc.RpcError()


@pytest.mark.parametrize("leader", ["leaving", "staying"])
def test_a_request_cancelled_as_its_batch_starts_does_not_strand_the_others(leader: str) -> None:
    """The race behind 'a request queued behind a cancelled one never ran': the cancelled member
    used to abort the whole group, so the others waited forever (or failed with its error)."""
    from nnd.v1 import worker_pb2
    from nnd_daemon import errors
    from nnd_daemon.worker import batching

    ran_alone: list[list[int]] = []

    def run_alone(request: Any, emit: Callable[[Any], None], cancelled: Callable[[], bool]) -> None:
        ran_alone.append(list(request.request.invokes[0].tokens.ids))
        emit(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone()))

    def run_merged(*_: Any) -> None:
        raise AssertionError("one member left: the other runs alone, not merged")

    run_lock = threading.Lock()
    batcher = batching.Batcher(run_lock, run_merged, run_alone, window_s=0)

    def member(ids: list[int], emit: Callable[[Any], None], cancelled: Callable[[], bool], started: Callable[[], None]):
        request = worker_pb2.WorkerRunRequest(request=nnd_pb2.TraceRequest(model="m"))
        request.request.invokes.add().tokens.ids.extend(ids)
        trace = batching.prepare(request, None)
        assert trace is not None
        return batching.Member(request, trace, emit, cancelled, started)

    leaving = _LeavesAtStart()
    staying_out: list[Any] = []
    leaving_member = member([1, 2], lambda r: None, leaving.cancelled, leaving.started)
    staying_member = member([3, 4], staying_out.append, lambda: False, lambda: None)
    # Both queue while the model is busy; the one named `leader` is already waiting, the other
    # arrives and takes the model as it is freed: it claims both, and runs the group on its thread.
    follower, first = (staying_member, leaving_member) if leader == "leaving" else (leaving_member, staying_member)
    outcomes: dict[str, BaseException | None] = {}

    def submit(name: str, m: Any) -> None:
        try:
            batcher.submit(m)
            outcomes[name] = None
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            outcomes[name] = exc

    run_lock.acquire()
    with batcher._cond:  # queued behind the busy model, before the leader comes
        batcher._pending.append(follower)
    follower_thread = threading.Thread(target=lambda: (follower.finished.wait(), None))
    follower_thread.start()
    run_lock.release()
    submit("first", first)
    follower_thread.join(30)  # a guard against a hang, far above the microseconds this takes
    assert not follower_thread.is_alive(), "a request batched with a cancelled one was never finished"
    assert ran_alone == [[3, 4]]
    assert [r.WhichOneof("kind") for r in staying_out] == ["done"]
    assert staying_member.error is None
    assert isinstance(leaving_member.error, errors.Cancelled)
    if first is staying_member:
        assert outcomes["first"] is None
    else:
        assert isinstance(outcomes["first"], errors.Cancelled)

def _four_members() -> list[Any]:
    """Four one-invoke traces of two tokens each, ready to submit."""
    from nnd.v1 import worker_pb2
    from nnd_daemon.worker import batching
    from nnd_daemon.worker.stop import Stop

    members = []
    for i in range(4):
        request = worker_pb2.WorkerRunRequest(request=nnd_pb2.TraceRequest(model="m"))
        request.request.invokes.add().tokens.ids.extend([i, i + 1])
        trace = batching.prepare(request, None)
        assert trace is not None
        members.append(batching.Member(request, trace, lambda r: None, lambda: False, lambda: None, stop=Stop()))
    return members


def test_members_claimed_into_a_run_never_take_the_model_themselves() -> None:
    """Requests queued behind a busy model are merged into the next run; they then wait for that run
    only. They used to wait for a turn too, so when the run ended the model went to each of them in
    turn (each woke, saw it was done, passed it on) before the next request could have it."""
    from nnd_daemon.worker.turns import Turns

    class CountingTurns(Turns):
        def __init__(self) -> None:
            super().__init__()
            self.taken = 0

        def acquire(self, *args: Any, **kwargs: Any) -> bool:
            got = super().acquire(*args, **kwargs)
            self.taken += got
            return got

    run_lock = CountingTurns()
    batcher, merged_runs = _merging_batcher(run_lock, 0, "every member is merged")
    members = _four_members()
    assert run_lock.acquire()  # the model is busy while all four queue
    threads = [threading.Thread(target=batcher.submit, args=(m,)) for m in members]
    for t in threads:
        t.start()
    while True:  # all four are in line for the model
        with batcher._cond:
            if len(batcher._pending) == 4 and run_lock.waiting() == 4:
                break
        threading.Event().wait(0.01)
    run_lock.release()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert merged_runs == [4] and all(m.finished.is_set() and m.error is None for m in members)
    assert run_lock.taken == 2  # this test's own turn, and the one run's: none by the merged members
    assert not run_lock.locked() and run_lock.waiting() == 0


def _run_queued(batcher: Any, run_lock: Any, members: list[Any]) -> None:
    """Submit `members` on threads of their own while the model is busy, free it once all of them are in
    line, and wait for every one to be done."""
    assert run_lock.acquire()
    threads = [threading.Thread(target=batcher.submit, args=(m,)) for m in members]
    for t in threads:
        t.start()
    _wait_until(lambda: run_lock.waiting() == len(members))
    run_lock.release()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def test_members_claimed_into_a_run_sleep_until_it_is_over() -> None:
    """A member claimed into another's run leaves the model's line at once, but its thread is woken only
    when the run is over: woken at the claim it only went back to sleep, a GIL hand-off per member a
    forward on the worker's busy core. Forced: the run itself looks at the line and the wake-ups."""
    from nnd_daemon.worker import batching
    from nnd_daemon.worker.turns import Turns

    class WatchedTurns(Turns):
        def __init__(self) -> None:
            super().__init__()
            self.woken = 0

        def _withdraw(self, ticket: Any) -> None:
            self.woken += 1
            super()._withdraw(ticket)

    run_lock = WatchedTurns()
    during: list[tuple[int, int]] = []

    def run_merged(merged: Any, emit: Callable[[Any], None], cancelled: Callable[[], bool]) -> None:
        during.append((run_lock.waiting(), run_lock.woken))
        emit(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone()))

    def run_alone(*_: Any) -> None:
        raise AssertionError("every member is merged")

    batcher = batching.Batcher(run_lock, run_merged, run_alone, window_s=0)
    members = _four_members()
    _run_queued(batcher, run_lock, members)
    # During the run: nobody in line (the three claimed left it), and none of them woken yet.
    assert during == [(0, 0)]
    assert run_lock.woken == 3  # each claimed member once, when the run was over
    assert all(m.finished.is_set() and m.error is None for m in members)
    assert not run_lock.locked() and run_lock.waiting() == 0


def test_merged_members_are_answered_by_the_run_before_they_wake() -> None:
    """A merged run answers its members from its own thread (which holds the GIL), all of them before it
    wakes any: woken to answer, eight members took the GIL in turns after every forward, a context switch
    per hand-off with their clients waiting; woken as each was answered, they unwound between the
    answers to the others. Each answer is sent once, with the member's own results."""
    from nnd_daemon.worker.turns import Turns

    run_lock = Turns()
    answers: list[tuple[int, int, bool, list[str]]] = []  # (member, thread, finished then, its responses)
    batcher, merged_runs = _merging_batcher(run_lock, 0, "every member is merged")
    members = _four_members()
    outs: list[list[Any]] = [[] for _ in members]
    for i, m in enumerate(members):
        m.emit = outs[i].append
        m.answer = lambda i=i, m=m: answers.append(
            (i, threading.get_ident(), any(x.finished.is_set() for x in members), [r.WhichOneof("kind") for r in outs[i]])
        )
    _run_queued(batcher, run_lock, members)
    assert merged_runs == [4]
    assert sorted(i for i, *_ in answers) == [0, 1, 2, 3]  # each member answered once
    assert len({thread for _, thread, *_ in answers}) == 1  # all by the one thread that ran them
    assert not any(finished for _, _, finished, _ in answers)  # all of them before any member was woken
    assert all(kinds and kinds == [r.WhichOneof("kind") for r in outs[i]] for i, _, _, kinds in answers)
    assert all(m.error is None for m in members)


def test_a_leader_waiting_for_returning_clients_is_woken_once_they_are_all_back() -> None:
    """The leader holding the model for the last run's clients (`_await_returning`) is woken when as
    many wait as it expects, not at every arrival (each wake-up only put it back to sleep)."""
    from nnd_daemon.worker.turns import Turns

    run_lock = Turns()
    batcher, merged_runs = _merging_batcher(run_lock, 60, "every member is merged")
    wakes: list[int] = []
    notify_all = batcher._cond.notify_all

    def counted(*args: Any) -> None:
        wakes.append(len(batcher._pending))
        notify_all(*args)

    batcher._cond.notify_all = counted
    batcher._expect = 4  # a run of four just ended: its clients come back one by one to an idle model
    batcher._overlap_at = time.monotonic()
    threads = [_submit_tokens(batcher, 2 * i) for i in range(4)]
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert merged_runs == [4]
    assert wakes == [4]


def _merging_batcher(run_lock: Any, window_s: float, alone: str) -> tuple[Any, list[int]]:
    """A Batcher whose merged runs record their invoke counts (the list returned) and whose lone runs
    fail the test with `alone`."""
    from nnd_daemon.worker import batching

    merged_runs: list[int] = []

    def run_merged(merged: Any, emit: Callable[[Any], None], cancelled: Callable[[], bool]) -> None:
        merged_runs.append(len(merged.invokes))
        emit(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone()))

    def run_alone(*_: Any) -> None:
        raise AssertionError(alone)

    return batching.Batcher(run_lock, run_merged, run_alone, window_s=window_s), merged_runs


def _submit_tokens(batcher: Any, i: int) -> threading.Thread:
    """A trace of token ids [i, i+1] submitted to `batcher` on a thread of its own (a client's request)."""
    from nnd.v1 import worker_pb2
    from nnd_daemon.worker import batching
    from nnd_daemon.worker.stop import Stop

    request = worker_pb2.WorkerRunRequest(request=nnd_pb2.TraceRequest(model="m"))
    request.request.invokes.add().tokens.ids.extend([i, i + 1])
    trace = batching.prepare(request, None)
    assert trace is not None
    member = batching.Member(request, trace, lambda r: None, lambda: False, lambda: None, stop=Stop())
    thread = threading.Thread(target=batcher.submit, args=(member,))
    thread.start()
    return thread


def _wait_until(done: Callable[[], bool]) -> None:
    while not done():
        threading.Event().wait(0.01)


def test_a_request_that_takes_the_model_from_a_run_waits_for_that_runs_clients() -> None:
    """Clients in a loop used to split into two cohorts taking turns (each forward half of them): the
    request that takes the model from a run that just ended now waits (up to `returning_s`) for that
    run's clients to send again, and one forward carries them all. The window here is long; the wait
    ends when they are back, so the test takes no time, and the interleaving is forced, not timed."""
    from nnd_daemon.worker import batching
    from nnd_daemon.worker.turns import Turns

    merged_runs: list[int] = []
    first_may_end = threading.Event()

    def run_merged(merged: Any, emit: Callable[[Any], None], cancelled: Callable[[], bool]) -> None:
        merged_runs.append(len(merged.invokes))
        assert first_may_end.wait(30)
        emit(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone()))

    def run_alone(*_: Any) -> None:
        raise AssertionError("the request that took the model ran alone instead of waiting for the others")

    run_lock = Turns()
    batcher = batching.Batcher(run_lock, run_merged, run_alone, window_s=60)
    taker_thread: list[threading.Thread] = []
    # Only the taker's wait: the first run's leader waits too (for nobody), and a signal from it
    # would let the returning requests arrive before that run has counted whom to expect.
    waiting = _spy_returning(batcher, lambda: threading.current_thread() in taker_thread)

    # A run of two, queued behind a busy model; it holds the model until told to end.
    first = _two_queued(batcher, run_lock)
    _wait_until(lambda: merged_runs == [2])
    # One more request queues behind that run; when the run ends it takes the model, and waits...
    taker = _submit_tokens(batcher, 4)
    taker_thread.append(taker)  # before the first run ends: the taker cannot wait for anyone until then
    _wait_until(lambda: run_lock.waiting() == 1)
    first_may_end.set()
    assert waiting.wait(30), "the request that took the model did not wait for the last run's clients"
    # ...for the run's two clients, who come back now: one forward carries all three.
    back = [_submit_tokens(batcher, 6), _submit_tokens(batcher, 8)]
    threads = [*first, taker, *back]
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert merged_runs == [2, 3]


def _spy_returning(batcher: Any, when: Callable[[], bool]) -> threading.Event:
    """An event set when the batcher starts waiting for returning clients while `when()` holds."""
    waiting = threading.Event()
    await_returning = batcher._await_returning

    def spied() -> None:
        if when():
            waiting.set()
        await_returning()

    batcher._await_returning = spied
    return waiting


def _two_queued(batcher: Any, run_lock: Any) -> list[threading.Thread]:
    """Two requests queued behind a busy model (held here), then the model let go: they run as one."""
    assert run_lock.acquire()
    first = [_submit_tokens(batcher, 0), _submit_tokens(batcher, 2)]
    _wait_until(lambda: run_lock.waiting() == 2)
    run_lock.release()
    return first


def test_a_request_at_an_idle_model_waits_for_the_last_runs_clients_not_the_window() -> None:
    """Between two runs the model is idle for a moment, and the first of the last run's clients to come
    back finds it so. Sleeping the whole window there took the model with only the clients back by
    then (5 of 8 a forward on GPT-2 4x64). It now waits for the others as a request queued behind the
    run does, and ends as soon as they are here: with a 60 s window this test takes no time."""
    from nnd_daemon.worker.turns import Turns

    run_lock = Turns()
    batcher, merged_runs = _merging_batcher(run_lock, 60, "a returning client ran alone instead of with the others")
    waiting = _spy_returning(batcher, lambda: bool(merged_runs))  # the second run's leader

    # Two clients overlap behind a busy model and run as one.
    first = _two_queued(batcher, run_lock)
    for t in first:
        t.join(30)
    assert merged_runs == [2] and not run_lock.locked()
    # Both come back, one at a time, to an idle model: the first waits for the second.
    back = [_submit_tokens(batcher, 4)]
    assert waiting.wait(30), "the first client back did not wait for the other"
    back.append(_submit_tokens(batcher, 6))
    for t in back:
        t.join(30)
    assert not any(t.is_alive() for t in back)
    assert merged_runs == [2, 2]


def test_the_wait_for_returning_clients_is_half_the_last_run_within_the_window_and_ten_windows() -> None:
    """A notebook that overlapped with another once must not wait long for it: the wait for the last
    run's clients is the window, or half the last run when longer, and never more than ten windows."""
    from nnd_daemon.worker import batching

    batcher = batching.Batcher(threading.Lock(), lambda *_: None, lambda *_: None, window_s=0.002)
    for last_run_s, bound_s in ((0.001, 0.002), (0.010, 0.005), (0.030, 0.015), (2.0, 0.020)):
        batcher._last_run_s = last_run_s
        assert batcher.returning_s() == pytest.approx(bound_s)
