"""Worker processes: start one per dispatched model, talk to it over a private
unix socket, notice when it dies or hangs, end it on release. Each worker also
serves its model's data path on a public socket (its route, with an epoch of
its own); clients send Trace/Generate/Session there, or to the daemon, which
forwards the bytes (`forward`).

Faults, as a client sees them (docs/reliability.md has the whole story):
- a worker that dies (a crash, an OOM kill, `kill -9`) fails every request sent
  to it with UNAVAILABLE and the reason: the one it was running ("while running
  this request") and the ones queued behind it ("before this request ran ...
  safe to retry"). Queued requests are not re-run on a new worker: the daemon
  cannot tell whether one of them is what killed the worker, and a silent
  re-run would hide the crash and double their latency. Its model goes back to
  META with the reason (`nnd ps`, NOTE column); the next request dispatches it
  again, with the same placement.
- a worker that stops answering (stopped, deadlocked) is found by the watchdog
  (`watch`): a Status ping every interval; after N pings in a row without an
  answer it is killed, and the same happens as for a death, except that the
  registry re-dispatches the model at once.
- a client that goes away cancels its request in the worker (`forward`, `interact`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import psutil

from nnd.v1 import contract, nnd_pb2, worker_pb2, worker_pb2_grpc
from nnd_daemon import errors, identity, intake, shmreap, tpgroup
from nnd_daemon.control import forking, gpus, statedir, tplaunch

log = logging.getLogger("nnd.supervisor")
_serial = itertools.count(1)

# (Not SingleThreadedUnaryStream: with it, concurrent calls to one worker were not concurrent.)
OPTIONS = contract.GRPC_OPTIONS
TOKEN_ENV = "NND_WORKER_TOKEN"  # worker/listen.py reads it (the command line is public)


def log_name(model: str) -> str:
    """A model's log file name: readable, and unique per name (sanitising alone makes a/b and a_b collide)."""
    safe = "".join(c if c.isalnum() else "_" for c in model)[-40:]
    return f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:10]}.log"


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


def isolated_python() -> list[str]:
    """The interpreter a worker runs under: isolated (-I: no PYTHON* variables, no user site, and
    on 3.11+ no working directory or script folder on sys.path), so a file that lands in the
    daemon's working directory is never imported by a worker. Editable installs still import:
    their .pth files live in site-packages, which -I keeps."""
    return [sys.executable, "-I"]


def empty_dir(run_dir: str) -> str:
    """A working directory for workers that holds nothing and that they cannot write (unless root)."""
    path = os.path.join(run_dir, "cwd")
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o555)
    return path


class WorkerHandle(Protocol):
    """What the control plane uses of a started worker: the registry (lifecycle, `nnd ps`, routes)
    and the servicer (forwarding). `Worker` is the real one; lifecycle tests pass fakes
    (tests/control/registry_fakes.py) through the registry's `start_worker`."""

    name: str
    epoch: int
    tp_size: int
    # Why the daemon killed it itself (the watchdog found it hung); "" otherwise.
    fault: str
    # The last Status answer (watchdog pings refresh it).
    last_status: worker_pb2.WorkerStatus | None

    @property
    def pids(self) -> list[int]: ...

    @property
    def public(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def fast_address(self) -> str: ...

    def configure(self, config: worker_pb2.WorkerConfig) -> None: ...

    def load(self, request: worker_pb2.WorkerLoadRequest) -> Iterator[nnd_pb2.DispatchProgress]: ...

    def status(self) -> worker_pb2.WorkerStatus | None: ...

    def watch(self, interval: float, timeout: float, misses: int) -> None: ...

    def wait_exit(self, timeout: float) -> str: ...

    def stop(self) -> None: ...

    def forward(
        self,
        method: str,
        raw: bytes,
        *,
        timeout: float | None,
        client: grpc.ServicerContext,
        metadata: list[tuple[str, str]],
    ) -> Iterator[bytes]: ...

    def interact(
        self,
        raws: Iterator[bytes],
        *,
        timeout: float | None,
        client: grpc.ServicerContext,
        metadata: list[tuple[str, str]],
    ) -> Iterator[bytes]: ...


# Called from the worker's own thread when it ends without being asked (crash, kill, watchdog).
OnExit = Callable[[WorkerHandle, str], None]


@dataclass(frozen=True)
class WorkerOrder:
    """What differs between two worker starts: the model, where it goes, its epoch, who hears of its death."""

    name: str
    placement: nnd_pb2.Placement
    epoch: int
    on_exit: OnExit


# Starts a worker (returning once it answers on its socket) or raises, leaving nothing running.
WorkerFactory = Callable[[WorkerOrder], WorkerHandle]


@dataclass(frozen=True)
class Launcher:
    """The real `WorkerFactory`: a `Worker` process with the daemon's directories, limits and token."""

    run_dir: str
    log_dir: str
    public_dir: str
    start_timeout_s: float
    limits: nnd_pb2.Limits = field(default_factory=nnd_pb2.Limits)
    # One user's share of a model's queue (settings.UserLimits.max_queue_share; 0: none).
    queue_share: float = 0.0
    # The route socket's bounds on calls that have not sent their request (worker/listen.py).
    request_idle_timeout_s: float = 5.0
    max_waiting_calls: int = 32
    batch_window_ms: float = 0.0
    token: str | None = None
    # The key `nnd-user` tickets are checked with (identity.py), hex; handed over in the environment.
    identity_key: str = ""
    log_requests: bool = False
    log_format: str = "text"
    # A worker log is rotated at this size (statedir.rotate_log); 0: never.
    log_bytes: int = 0
    # Workers fork from the daemon's fork server where it can (control/forking.py); None: each execs.
    forks: forking.ForkServer | None = None

    def __call__(self, order: WorkerOrder) -> Worker:
        worker = self.worker_class()(
            order.name,
            self.run_dir,
            self.log_dir,
            order.on_exit,
            limits=self.limits,
            placement=order.placement,
            batch_window_ms=self.batch_window_ms,
            epoch=order.epoch,
            public_dir=self.public_dir,
            queue_share=self.queue_share,
            route_bounds=(self.request_idle_timeout_s, self.max_waiting_calls),
            token=self.token,
            identity_key=self.identity_key,
            log_args=(["--log-requests"] if self.log_requests else []) + ["--log-format", self.log_format],
            log_bytes=self.log_bytes,
            forks=self.forks,
        )
        try:
            worker.start(self.start_timeout_s)
        except BaseException:
            worker.stop()
            raise
        return worker

    def worker_class(self) -> type[Worker]:
        """The `Worker` it starts (the in-process engine for tests returns its own)."""
        return Worker


class Worker:
    """One worker process and the channel to it."""

    def __init__(
        self,
        name: str,
        run_dir: str,
        log_dir: str,
        on_exit: OnExit,
        *,
        limits: nnd_pb2.Limits | None = None,
        placement: nnd_pb2.Placement | None = None,
        batch_window_ms: float = 0.0,
        epoch: int = 0,
        public_dir: str = "",
        queue_share: float = 0.0,
        route_bounds: tuple[float, int] = (5.0, 32),
        token: str | None = None,
        identity_key: str = "",
        log_args: list[str] | None = None,
        log_bytes: int = 0,
        forks: forking.ForkServer | None = None,
    ) -> None:
        self.name = name
        self._identity_key = identity_key
        self._log_args = log_args or []
        self.log_bytes = log_bytes
        self.run_dir = run_dir
        self.epoch = epoch
        self.queue_share = queue_share
        self.route_bounds = route_bounds
        self._token = token
        # The last Status answer (watchdog pings refresh it): activity for keep-alive and LRU.
        self.last_status: worker_pb2.WorkerStatus | None = None
        self.limits = limits or nnd_pb2.Limits()
        self.batch_window_ms = batch_window_ms  # the worker's cross-client batching window (batching.py)
        # Tensor parallel: `proc` is torchrun's agent, `rank_pids` its ranks (rank 0 serves the socket).
        self.placement = placement or nnd_pb2.Placement()
        self.tp_size = tplaunch.tp_size(placement)
        self.rank_pids: list[int] = []
        self._ranks: list[psutil.Process] = []
        self._log_offset = 0
        serial = next(_serial)
        self.socket = os.path.join(run_dir, f"w{serial}.sock")
        # The route clients follow (nnd.proto, Route); empty: none. A tensor-parallel group's rank 0
        # serves it (worker/tp.py); a client that loses its call there learns why from `wait_exit`.
        self.public = os.path.join(public_dir, f"m{serial}.sock") if public_dir else ""
        # Beside it, the route's fast socket (worker/fastroute.py); a tensor-parallel group has none.
        self.fast = os.path.join(public_dir, f"m{serial}.fast.sock") if public_dir and self.tp_size <= 1 else ""
        self.log_path = os.path.join(log_dir, log_name(name))
        self._on_exit = on_exit
        self._stopping = False
        self.proc: subprocess.Popen[bytes] | forking.ForkedProcess | None = None
        self._forks = forks
        self.channel: grpc.Channel | None = None
        self.stub: worker_pb2_grpc.WorkerStub | None = None
        self.exit_reason = ""
        # Why the daemon killed this worker itself (the watchdog found it hung); empty otherwise.
        self.fault = ""
        self._ended = threading.Event()

    @property
    def pids(self) -> list[int]:
        """Every process of the worker: the ranks in rank order, then torchrun's agent; or the one worker."""
        if not self.proc:
            return []
        return [*self.rank_pids, self.proc.pid] if self.tp_size > 1 else [self.proc.pid]

    def start(self, timeout: float) -> None:
        for path in (self.socket, self.public, self.fast):
            if path and os.path.exists(path):
                os.unlink(path)
        statedir.rotate_log(self.log_path, self.log_bytes)
        logf = os.fdopen(statedir.open_log(self.log_path), "ab")  # owned by the child; never through a link
        args = ["--socket", self.socket, "--name", self.name, *self._log_args]
        args += ["--parent", str(os.getpid()), "--limits", intake.limits_arg(self.limits)]
        args += ["--epoch", str(self.epoch), "--queue-share", repr(float(self.queue_share))]
        if self.public:
            idle, waiting = self.route_bounds
            args += ["--public", self.public, "--request-idle-timeout", repr(float(idle))]
            args += ["--max-waiting-calls", str(int(waiting))]
            if self.fast:
                args += ["--fast", self.fast]
        if self.batch_window_ms > 0 and self.tp_size <= 1:
            args += ["--batch-window-ms", str(self.batch_window_ms)]
        cmd = [*isolated_python(), "-m", "nnd_daemon.worker", *args]
        env = dict(os.environ)
        if self.tp_size > 1:  # a torchrun group of tp_size ranks, each running the same worker module
            cmd = tplaunch.command(self.tp_size, args)
            env = tplaunch.environment(self.placement, gpus.count())
            self._log_offset = logf.tell()
        env.pop(TOKEN_ENV, None)
        if self._token:
            env[TOKEN_ENV] = self._token
        env.pop(identity.KEY_ENV, None)
        if self._identity_key:
            env[identity.KEY_ENV] = self._identity_key
        # No preexec_fn: running Python between fork and exec in a threaded
        # daemon can crash the child. The worker ties its life to ours itself.
        self.proc = self._spawn(cmd, env, logf)
        logf.close()
        threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise errors.Unavailable(f"worker for {self.name} exited at start: {self.describe_exit()}")
            if time.monotonic() > deadline:
                self.stop()
                raise errors.Unavailable(f"worker for {self.name} did not start within {timeout:.0f} s")
            time.sleep(0.02)
        if self.tp_size > 1:
            self.rank_pids = tplaunch.read_pids(self.socket)
            self._ranks = [p for p in map(_process, self.rank_pids) if p is not None]
        self.channel = grpc.insecure_channel("unix://" + self.socket, options=OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=max(1.0, deadline - time.monotonic()))
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        # Clients' data requests, forwarded as bytes (worker/gateway.py parses them); results pass
        # through the daemon as bytes too, never decoded here.
        self.forward_raw = {
            method: self.channel.unary_stream(f"/nnd.v1.Nnd/{method}") for method in contract.DATA_METHODS
        }
        self.forward_interact = self.channel.stream_stream("/nnd.v1.Nnd/Interact")

    def _spawn(self, cmd: list[str], env: dict[str, str], logf: Any) -> subprocess.Popen[bytes] | forking.ForkedProcess:
        """Start the worker's process: forked from the fork server where it can, else by exec; torchrun's
        group always by exec (the in-process engine for tests, nnd_daemon/inprocess.py, serves the same
        command line from threads of this process instead)."""
        forks = self._forks if self.tp_size <= 1 else None
        return forking.spawn(forks, cmd, env=env, cwd=empty_dir(self.run_dir), logf=logf)

    @property
    def address(self) -> str:
        """The route's gRPC target: the public socket."""
        return "unix://" + self.public if self.public else ""

    @property
    def fast_address(self) -> str:
        """The route's fast socket (nnd.proto, Route.fast_address)."""
        return "unix://" + self.fast if self.fast else ""

    def configure(self, config: worker_pb2.WorkerConfig, timeout: float = 30.0) -> None:
        """Push aliases or edits; a worker that is gone needs none."""
        if self.stub is None:
            return
        try:
            self.stub.Configure(config, timeout=timeout)
        except grpc.RpcError as err:
            log.warning("could not configure the worker of %s: %s", self.name, err.details())

    def describe_exit(self) -> str:
        code = self.proc.poll() if self.proc else None
        if code is None:
            return "still running"
        if self.fault:
            return self.fault
        what = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if self.tp_size > 1:
            reason = tplaunch.group_exit_reason(self.socket, self._log_since_start())
            if reason:
                return reason
        tail = _tail(self.log_path)
        return f"{what}" + (f"; last output: {tail}" if tail else "")

    def _watch(self) -> None:
        assert self.proc is not None
        self.proc.wait()
        self.exit_reason = self.describe_exit()
        for pid in self.pids:  # shared-memory results a dead worker left behind (older versions)
            shmreap.remove_segments(pid)
        self._ended.set()
        if not self._stopping:
            log.warning("worker for %s %s: %s", self.name, "hung" if self.fault else "died", self.exit_reason)
            self._on_exit(self, self.exit_reason)

    def watch(self, interval: float, timeout: float, misses: int) -> None:
        """The watchdog: ping the worker (Status) every `interval` s; after `misses`
        pings in a row without an answer within `timeout` s, kill it as hung.
        Its exit is then reported like any death, with `fault` saying why."""
        if interval <= 0:
            return

        def loop() -> None:
            missed = 0
            while not self._ended.wait(interval):
                if self._stopping:
                    return
                if self.ping(timeout):
                    missed = 0
                    continue
                if self._ended.is_set() or self._stopping:
                    return
                missed += 1
                log.warning(
                    "worker for %s did not answer a ping within %g s (%d/%d)", self.name, timeout, missed, misses
                )
                if missed >= misses:
                    self.kill(
                        f"hung: {misses} status ping(s) in a row got no answer within {timeout:g} s, so the "
                        "daemon killed it"
                    )
                    return

        threading.Thread(target=loop, name=f"watchdog-{self.name}", daemon=True).start()

    def ping(self, timeout: float) -> bool:
        """True if the worker answers a Status call within `timeout` s."""
        if self.stub is None:
            return False
        try:
            self.last_status = self.stub.Status(worker_pb2.WorkerStatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return True

    def kill(self, reason: str) -> None:
        """Kill the worker (every process of it) at once, recording `reason` as its fault."""
        self.fault = reason
        for proc in [*getattr(self, "_ranks", []), self.proc]:
            try:
                if proc is not None:
                    proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def load(self, request: worker_pb2.WorkerLoadRequest) -> Iterator[nnd_pb2.DispatchProgress]:
        assert self.stub is not None
        try:
            yield from self.stub.Load(request)
        except grpc.RpcError as err:
            raise self.translate(err) from None

    def interact(
        self,
        raws: Iterator[bytes],
        *,
        timeout: float | None,
        client: grpc.ServicerContext,
        metadata: list[tuple[str, str]],
    ) -> Iterator[bytes]:
        """An interactive run (Nnd.Interact): the client's messages in and the worker's answers
        out, as bytes neither side of this process parses."""
        call = self.forward_interact(raws, timeout=timeout, metadata=[*metadata, *_client_metadata(client)])
        if not client.add_callback(call.cancel):
            call.cancel()
        try:
            yield from call
        except grpc.RpcError as err:
            raise self.translate(err, started=_started(call)) from None
        finally:
            call.cancel()

    def forward(
        self,
        method: str,
        raw: bytes,
        *,
        timeout: float | None,
        client: grpc.ServicerContext,
        metadata: list[tuple[str, str]],
    ) -> Iterator[bytes]:
        """Send a client's request bytes to the worker unparsed and pass its responses back.

        A client that goes away cancels the worker's call at once, not only when the next
        response is due: a Trace sends nothing until it is done, and the engine stops at
        its next hook."""
        call = self.forward_raw[method](raw, timeout=timeout, metadata=[*metadata, *_client_metadata(client)])
        if not client.add_callback(call.cancel):
            call.cancel()
        ran = False  # a queued request's turn came (worker/service.py's RUNNING): it may have run
        try:
            for response in call:
                ran = ran or response == _RUNNING
                yield response
        except grpc.RpcError as err:
            raise self.translate(err, started=ran or _started(call)) from None
        finally:
            call.cancel()

    def status(self, timeout: float = 2.0) -> worker_pb2.WorkerStatus | None:
        if self.stub is None:
            return None
        try:
            self.last_status = self.stub.Status(worker_pb2.WorkerStatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return self.last_status

    def translate(self, err: grpc.RpcError, *, started: bool | None = None) -> errors.NndError:
        """A worker's status, re-raised for the client; a vanished worker is UNAVAILABLE.

        `started`: whether the worker had begun running the request (None: unknown)."""
        code = err.code()
        if self.fault and self.proc:
            self._wait_exit(2.0)
            return self.lost(self.fault, started)
        if self.tp_size > 1 and self.proc and (code == grpc.StatusCode.UNAVAILABLE or self._rank_gone()):
            # (A CANCELLED with every rank alive is a cancelled request, not a failing group.)
            self._end_group()
        if code == grpc.StatusCode.UNAVAILABLE or (self.proc and self.proc.poll() is not None):
            self._wait_exit(0.5)  # a dropped connection: the process is going, let it be reaped
            died = self.proc is not None and self.proc.poll() is not None
            reason = self.describe_exit() if died else err.details()
            return self.lost(f"died: {reason}" if died else f"cannot be reached: {reason}", started)
        return errors.from_rpc(err)

    def _wait_exit(self, timeout: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def lost(self, reason: str, started: bool | None) -> errors.Unavailable:
        """UNAVAILABLE for a request the worker could not finish, saying why and whether it ran."""
        if started is False:
            when = "before this request ran (it was queued behind another one): none of it ran, so it is safe to retry"
        elif started:
            when = "while running this request"
        else:
            when = "during this request"
        again = (
            "the daemon is dispatching the model again"
            if self.fault
            else "the next request dispatches the model again (`nnd ps` shows why it stopped)"
        )
        return errors.Unavailable(f"the worker of {self.name} {reason}; this happened {when}; {again}")

    def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        if self.channel is not None:
            self.channel.close()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._kill_ranks()  # ranks torchrun did not get to end (its agent was killed)
        for path in (self.socket, self.public, self.fast):
            if path and os.path.exists(path):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _end_group(self) -> None:
        """A group goes down as a whole: torchrun stops the other ranks when one dies; wait for it to
        finish, and finish it ourselves if a rank hangs (torchrun would wait 30 s on a stuck one)."""
        assert self.proc is not None
        try:
            self.proc.wait(tplaunch.GROUP_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("worker group for %s did not stop by itself; killing its ranks", self.name)
            self._kill_ranks()
            try:
                self.proc.wait(tplaunch.GROUP_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def wait_exit(self, timeout: float) -> str:
        """Why the worker ended, waiting up to `timeout` s for a dying one; "" if it runs on.

        A tensor-parallel group that is going down (a rank gone, or rank 0 stopping the group after
        it answered UNAVAILABLE) is waited for as `translate` waits, so a client of its route hears
        which rank failed and how, as one sent through the daemon does."""
        if self.proc is None:
            return ""
        if self.tp_size > 1 and self.proc.poll() is None and (self._rank_gone() or self._group_stopping()):
            self._end_group()
        if self.proc.poll() is None:
            self._wait_exit(timeout)
        if self.proc.poll() is None:
            return ""
        self._ended.wait(timeout)  # its exit handled (`_watch`): the registry has seen it
        return self.exit_reason or self.describe_exit()

    def _group_stopping(self) -> bool:
        """Rank 0 recorded why it stops the group (worker/tp.py, Group.fail)."""
        return os.path.exists(tpgroup.reason_path(self.socket))

    def _rank_gone(self) -> bool:
        for rank in self._ranks:
            try:
                if not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                return True
        return False

    def _kill_ranks(self) -> None:
        for rank in self._ranks:
            try:
                if rank.is_running():
                    rank.kill()
            except psutil.Error:
                pass

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _client_metadata(client: grpc.ServicerContext) -> list[tuple[str, str]]:
    """Who asked, for the worker's `nnd ps` view: the client's own name for itself, else its peer address."""
    who = dict(client.invocation_metadata() or ()).get(contract.CLIENT_KEY) or client.peer() or ""
    return [(contract.CLIENT_KEY, str(who)[:80])] if who else []


_RUNNING = nnd_pb2.TraceResponse(queued=nnd_pb2.Queued(running=True)).SerializeToString()


def _started(call: Any) -> bool | None:
    """Whether the worker had begun running `call`'s request when it failed (contract.started_from)."""
    try:
        return contract.started_from(call.initial_metadata())
    except Exception:  # noqa: BLE001 - only a hint for the error message
        return None
