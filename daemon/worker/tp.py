"""A tensor-parallel worker group: N ranks started by torchrun run one model in lockstep.

Rank 0 serves the private Worker service to the daemon, and the model's route
(clients' Trace, Generate and Session on its public socket), exactly like a
single-process worker. Every Load and Run it receives is broadcast to the other
ranks (a small int64 header -- kind, sequence number, seed, length -- and the
request's protobuf bytes, over gloo); all ranks then load or run the engine
together, and only rank 0 emits results.

Lockstep is kept by construction and checked after every request:
- every rank seeds torch with the seed rank 0 sends along (a fresh one per
  request), so sampling and unseeded random ops agree;
- cancellation is decided by all ranks together (an all-reduce of rank 0's flag
  at each point the engine polls), so no rank leaves a collective the others
  are in;
- at the end, a monitored barrier with a timeout and an exchange of outcomes:
  a rank that does not arrive in time, or that ended differently from rank 0,
  means the group is no longer in lockstep. Rank 0 then answers UNAVAILABLE
  with the reason, writes it next to its socket for the daemon, and exits;
  torchrun stops the other ranks, and the daemon returns the model to META.
A rank that dies is seen by torchrun, which stops the whole group.

Sync points (Interact) run the same way: rank 0 sends the run and how it
starts (WorkerInteract), every rank runs it and pauses at the same hook (the
plan and the whole values are the same on every rank), and only rank 0 sends
the value to the client. Whatever then ends rank 0's wait -- the client's
next message (WorkerInteractContinue), its going away, the pause timeout, or
a bad message -- rank 0 passes to the other ranks before acting on it, so all
continue, or fail with the same status, together. The other ranks wait for
it on `idle`, which has no hang timeout there: a pause may last as long as its
own timeout allows, and rank 0 always ends it (at the latest when that
timeout expires), so no rank stays blocked. A failure on one rank alone
(the others paused or in a collective) breaks lockstep: the end-of-request
handshake or the collective's hang timeout ends the group, as above.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
import psutil
import torch
import torch.distributed as dist

from nnd.v1 import nnd_pb2, worker_pb2, worker_pb2_grpc
from nnd_daemon import errors, tpgroup
from nnd_daemon.engine import interact, sharding
from nnd_daemon.worker import listen, loader, tplayout
from nnd_daemon.worker.service import WorkerService

log = logging.getLogger("nnd.worker.tp")

LOAD, RUN, STOP, INTERACT = 1, 2, 3, 4
# What ended a pause, passed from rank 0 to the others (interact.Receive's answers).
MORE, GONE, TIMEOUT, FAILED = 5, 6, 7, 8
# Requests wait idle between rank 0's broadcasts for as long as the model stays dispatched.
IDLE_TIMEOUT = timedelta(days=365)


def _code(exc: BaseException | None) -> int:
    if exc is None:
        return 0
    if isinstance(exc, errors.NndError):
        return int(exc.code.value[0]) if hasattr(exc.code, "value") else 2
    return 2  # grpc UNKNOWN: anything unforeseen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Group:
    """This rank's view of the group: its rank, the control groups, and the lockstep protocol."""

    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.timeout_s = tpgroup.timeout_s()
        self.gpu = torch.cuda.is_available()
        timeout = timedelta(seconds=self.timeout_s)
        if self.gpu:
            torch.cuda.set_device(self.local_rank)
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", self.local_rank))
        else:
            dist.init_process_group("gloo", timeout=timeout)
        # Requests travel on `idle`: the other ranks may wait there days for the next one, but rank 0's
        # send gives up after the hang timeout (a timeout is each process's own). The per-request
        # handshakes and cancellation votes go on `sync`, whose timeout is the hang timeout everywhere.
        self.idle = dist.new_group(backend="gloo", timeout=timeout if self.rank == 0 else IDLE_TIMEOUT)
        self.sync = dist.new_group(backend="gloo", timeout=timeout)
        self.seq = 0
        self.lock = threading.Lock()
        self.broken = ""
        self.pids, self.devices = self._exchange_pids()

    def _exchange_pids(self) -> tuple[list[int], list[str]]:
        """Every rank's pid and device, in rank order (for `nnd ps`)."""
        parts = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        mine = torch.tensor([os.getpid(), self.local_rank if self.gpu else -1], dtype=torch.int64)
        dist.all_gather(parts, mine, group=self.sync)
        return [int(p[0]) for p in parts], [f"cuda:{int(p[1])}" if p[1] >= 0 else "cpu" for p in parts]

    def bound_collectives(self) -> None:
        """Give every process group but `idle` the hang timeout: the device mesh transformers builds for
        the model makes its own groups, with torch's default timeout (30 min on gloo)."""
        from torch.distributed import distributed_c10d as c10d

        timeout = timedelta(seconds=self.timeout_s)
        for pg in list(c10d._world.pg_map):
            if pg is self.idle and self.rank != 0:
                continue
            try:
                c10d._set_pg_timeout(timeout, pg)
            except Exception as exc:  # noqa: BLE001 - a private API; without it hangs last longer
                log.warning("cannot set the collective timeout of a process group: %s", exc)

    # -- messages (rank 0 -> all)
    def publish(self, kind: int, seed: int, payload: bytes) -> None:
        header = torch.tensor([kind, self.seq, seed, len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.idle)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.idle)

    def receive(self) -> tuple[int, int, bytes]:
        header = torch.zeros(4, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.idle)
        kind, seq, seed, size = (int(x) for x in header)
        self.seq = seq
        payload = b""
        if size:
            buf = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(buf, src=0, group=self.idle)
            payload = buf.numpy().tobytes()
        return kind, seed, payload

    # -- sync points
    def relay(self, receive: interact.Receive) -> interact.Receive:
        """Rank 0: the client's answer at a pause, passed to every rank before this one acts on it."""

        def relayed(timeout: float) -> Any:
            msg = receive(timeout)
            if isinstance(msg, nnd_pb2.InteractContinue):
                msg = worker_pb2.WorkerInteractContinue(more=msg)
            if isinstance(msg, worker_pb2.WorkerInteractContinue):
                kind, code, payload = MORE, 0, msg.SerializeToString()
            elif msg is interact.GONE:
                kind, code, payload = GONE, 0, b""
            elif msg is None:
                kind, code, payload = TIMEOUT, 0, b""
            else:  # an NndError: a bad later message
                kind, code, payload = FAILED, _code(msg), str(msg).encode()
            try:
                self.publish(kind, code, payload)
            except Exception as exc:  # noqa: BLE001 - a rank that does not take it is stuck or gone
                reason = f"a rank did not take the continuation of request {self.seq} ({_first_line(exc)})"
                self.fail(reason)
                raise errors.Unavailable(f"tensor-parallel group stopped: {reason}") from None
            return msg

        return relayed

    def relayed(self, timeout: float) -> Any:
        """Ranks > 0: what ended rank 0's wait at this pause (rank 0 bounds the wait, not `timeout`)."""
        kind, code, payload = self.receive()
        if kind == MORE:
            return worker_pb2.WorkerInteractContinue.FromString(payload)
        if kind == GONE:
            return interact.GONE
        if kind == TIMEOUT:
            return None
        if kind == FAILED:
            return errors.relayed(code, payload.decode(errors="replace"))
        raise errors.Unavailable(f"rank {self.rank}: expected a continuation from rank 0, got message kind {kind}")

    # -- lockstep
    def vote(self, local: Callable[[], bool]) -> Callable[[], bool]:
        """A `cancelled` every rank answers alike: true when rank 0's own flag is set."""

        def cancelled() -> bool:
            flag = torch.tensor([1 if (self.rank == 0 and local()) else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.sync)
            return bool(flag.item())

        return cancelled

    def finish(self, outcome: BaseException | None) -> str:
        """End-of-request handshake; returns why the group is out of lockstep, or ''."""
        try:
            dist.monitored_barrier(group=self.sync, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
            parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(parts, torch.tensor([_code(outcome)], dtype=torch.int64), group=self.sync)
        except Exception as exc:  # noqa: BLE001 - a missing rank is the answer
            return f"a rank did not finish request {self.seq} within {self.timeout_s:.0f} s ({_first_line(exc)})"
        codes = [int(p) for p in parts]
        odd = [r for r, c in enumerate(codes) if c != codes[0]]
        if odd:
            return (
                f"rank {odd[0]} ended request {self.seq} differently from rank 0 (status {codes[odd[0]]} vs "
                f"{codes[0]}); the ranks are no longer in lockstep (see the worker log)"
            )
        return ""

    def lead(self, kind: int, payload: bytes, work: Callable[[int], None]) -> None:
        """Rank 0: send a request to all ranks, do it here too, check the group afterwards."""
        with self.lock:
            if self.broken:
                raise errors.Unavailable(f"the tensor-parallel group is stopping: {self.broken}")
            self.seq += 1
            seed = secrets.randbits(62)
            try:
                self.publish(kind, seed, payload)
            except Exception as exc:  # noqa: BLE001 - a rank that does not take the request is stuck or gone
                reason = f"a rank did not take request {self.seq} within {self.timeout_s:.0f} s ({_first_line(exc)})"
                self.fail(reason)
                raise errors.Unavailable(f"tensor-parallel group stopped: {reason}") from None
            error: BaseException | None = None
            try:
                work(seed)
            except BaseException as exc:  # noqa: BLE001 - re-raised below once the group agrees
                error = exc
            reason = self.finish(error)
            if reason:
                self.fail(reason)
                raise errors.Unavailable(f"tensor-parallel group stopped: {reason}") from error
            if error is not None:
                raise error

    def follow(self, runner: Runner) -> None:
        """Ranks > 0: do what rank 0 sends until told to stop."""
        while True:
            try:
                kind, seed, payload = self.receive()
            except Exception as exc:  # noqa: BLE001 - rank 0 is gone; torchrun ends us
                log.error("rank %d: lost rank 0 (%s); exiting", self.rank, exc)
                os._exit(1)
            if kind == STOP:
                return
            error: BaseException | None = None
            try:
                runner.handle(kind, seed, payload)
            except BaseException as exc:  # noqa: BLE001
                error = exc
                if not isinstance(exc, errors.NndError):
                    log.exception("rank %d: request %d failed", self.rank, self.seq)
            reason = self.finish(error)
            if reason:
                self.fail(reason, grace=0.0)

    def fail(self, reason: str, *, grace: float = 1.0) -> None:
        """Record why the group ends, then end this rank (rank 0: after its answer has had time to leave)."""
        self.broken = reason
        log.error("stopping the tensor-parallel group: %s", reason)
        sock = os.environ.get("NND_TP_SOCKET", "")
        if sock:
            try:  # the first rank to tell wins
                with open(tpgroup.reason_path(sock), "x") as f:
                    f.write(f"rank {self.rank}: {reason}")
            except OSError:
                pass
        if grace <= 0:
            os._exit(1)
        threading.Timer(grace, lambda: os._exit(1)).start()


class Runner:
    """What every rank does with a request: the same load, the same engine run."""

    def __init__(self, group: Group, limits: Any = None) -> None:
        self.group = group
        self.limits = limits
        self.model: Any = None
        self.tokenizer: Any = None
        self.dtype = ""

    def handle(self, kind: int, seed: int, payload: bytes) -> None:
        if kind == LOAD:
            self.load(worker_pb2.WorkerLoadRequest.FromString(payload), lambda *_: None)
        elif kind == RUN:
            self.run(worker_pb2.WorkerRunRequest.FromString(payload), seed, lambda _: None, lambda: False)
        elif kind == INTERACT:
            steered = worker_pb2.WorkerInteract.FromString(payload)
            interaction = interact.Interaction(steered.start, self.group.relayed)
            self.run(steered.run, seed, lambda _: None, lambda: False, interaction)

    def load(self, request: worker_pb2.WorkerLoadRequest, report: loader.Report) -> None:
        model, tokenizer, dtype = loader.load(request, report)
        self.group.bound_collectives()
        started = time.perf_counter()
        tp = tplayout.measure(model, self.group.rank, self.group.world, control=self.group.sync)
        sharding.attach(model, tp)
        if self.group.rank == 0:
            log.info("sharded values (measured in %.2f s):", time.perf_counter() - started)
            for key, text in tp.describe().items():
                log.info("  %s: %s", key, text)
        self.model, self.tokenizer, self.dtype = model, tokenizer, dtype

    def run(
        self,
        request: worker_pb2.WorkerRunRequest,
        seed: int,
        emit: Callable[[Any], None],
        cancelled: Callable[[], bool],
        interaction: interact.Interaction | None = None,
    ) -> None:
        from nnd_daemon import engine

        if self.model is None:
            raise errors.FailedPrecondition("worker has no model loaded")
        torch.manual_seed(seed)  # the same on every rank: sampling and unseeded random ops agree
        # A Trace, a Generate or a Session, with the graphs of the edits it names.
        engine.run_worker(
            self.model, self.tokenizer, request, emit=emit, cancelled=self.group.vote(cancelled), limits=self.limits,
            interaction=interaction,
        )


class LeaderService(WorkerService):
    """Rank 0's Worker service: the single-process one, with every request led through the group."""

    def __init__(self, group: Group, runner: Runner) -> None:
        super().__init__()
        self.group = group
        self.runner = runner
        # Every run must go through the group (lead): no cross-client batching past it.
        self.batcher = None

    def _load(self, request: worker_pb2.WorkerLoadRequest, report: loader.Report) -> None:
        self.group.lead(LOAD, request.SerializeToString(), lambda seed: self.runner.load(request, report))
        self.model, self.tokenizer, self.dtype = self.runner.model, self.runner.tokenizer, self.runner.dtype

    def _execute(
        self, request: worker_pb2.WorkerRunRequest, emit: Callable[[Any], None], cancelled: Callable[[], bool]
    ) -> None:
        self.runner.limits = self.limits
        self.group.lead(RUN, request.SerializeToString(), lambda seed: self.runner.run(request, seed, emit, cancelled))

    def _interact(
        self, run: worker_pb2.WorkerRunRequest, emit: Callable[[Any], None], cancelled: Callable[[], bool],
        interaction: Any,
    ) -> None:
        # Every rank runs it; what the client sends at each pause reaches them all through `relay`.
        self.runner.limits = self.limits
        interaction.receive = self.group.relay(interaction.receive)
        payload = worker_pb2.WorkerInteract(run=run, start=interaction.start).SerializeToString()
        self.group.lead(
            INTERACT, payload, lambda seed: self.runner.run(run, seed, emit, cancelled, interaction)
        )

    def Status(self, request: worker_pb2.WorkerStatusRequest, context: grpc.ServicerContext) -> Any:
        status = super().Status(request, context)
        total = 0
        # Each rank's resident memory, and the group's (the pids of this host: nnd starts groups on one).
        for rank, (pid, device) in enumerate(zip(self.group.pids, self.group.devices, strict=True)):
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                rss = 0
            total += rss
            status.ranks.add(rank=rank, pid=pid, rss_bytes=rss, device=device)
        status.rss_bytes = total or status.rss_bytes
        return status


def _watch_daemon(parent: int) -> None:
    """Under torchrun our parent is the agent: end when the daemon or the agent goes."""
    agent = os.getppid()
    try:
        daemon = psutil.Process(parent) if parent else None
    except psutil.Error:
        os._exit(1)

    def alive(p: psutil.Process | None) -> bool:
        try:
            return p is None or (p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def watch() -> None:
        while os.getppid() == agent and alive(daemon):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(ns: argparse.Namespace, options: list[tuple[str, int]], limits: Any = None) -> None:
    """Entry of one rank (`python -m nnd_daemon.worker` under torchrun)."""
    _watch_daemon(ns.parent)
    os.environ["NND_TP_SOCKET"] = ns.socket
    group = Group()
    runner = Runner(group, limits)
    log.info("rank %d of %d up (pid %d, %s)", group.rank, group.world, os.getpid(), "nccl" if group.gpu else "gloo")
    if group.rank != 0:
        os.environ.pop(listen.TOKEN_ENV, None)  # only rank 0 serves clients (the route) and checks it
        group.follow(runner)
        return
    with open(tpgroup.pids_path(ns.socket) + ".tmp", "w") as f:
        f.write(" ".join(map(str, group.pids)))
    os.replace(tpgroup.pids_path(ns.socket) + ".tmp", tpgroup.pids_path(ns.socket))
    # Served like a single worker (listen.py): the Worker service to the daemon, and the data path
    # to clients by the model's route, behind the same token, limits, queue depth and epoch.
    service = LeaderService(group, runner)
    service.limits = limits
    listen.serve_until_terminated(listen.start(service, ns, worker_pb2_grpc.add_WorkerServicer_to_server), grace=2)
    os._exit(0)  # the other ranks wait in a broadcast; torchrun ends them when we are gone
