"""Worker processes: start one per dispatched model, talk to it over a private
unix socket, notice when it dies, end it on release."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import psutil

from nnd.v1 import nnd_pb2, worker_pb2, worker_pb2_grpc
from nnd_daemon import errors
from nnd_daemon.worker import tplaunch

log = logging.getLogger("nnd.supervisor")
_serial = itertools.count(1)

OPTIONS = [("grpc.max_receive_message_length", 512 * 2**20), ("grpc.max_send_message_length", 512 * 2**20)]


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


class Worker:
    """One worker process and the channel to it."""

    def __init__(
        self,
        name: str,
        run_dir: str,
        log_dir: str,
        on_exit: Callable[[Worker, str], None],
        *,
        limits: dict[str, int] | None = None,
        placement: nnd_pb2.Placement | None = None,
        batch_window_ms: float = 0.0,
    ) -> None:
        self.name = name
        self.limits = limits or {}
        self.batch_window_ms = batch_window_ms  # the worker's cross-client batching window (batching.py)
        # Tensor parallel: `proc` is torchrun's agent, `rank_pids` its ranks (rank 0 serves the socket).
        self.placement = placement or nnd_pb2.Placement()
        self.tp_size = tplaunch.tp_size(placement)
        self.rank_pids: list[int] = []
        self._ranks: list[psutil.Process] = []
        self._log_offset = 0
        safe = "".join(c if c.isalnum() else "_" for c in name)[-40:]
        self.socket = os.path.join(run_dir, f"w{next(_serial)}.sock")
        self.log_path = os.path.join(log_dir, f"{safe}.log")
        self._on_exit = on_exit
        self._stopping = False
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.stub: worker_pb2_grpc.WorkerStub | None = None
        self.exit_reason = ""

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    @property
    def pids(self) -> list[int]:
        """Every process of the worker: the ranks in rank order, then torchrun's agent; or the one worker."""
        if not self.proc:
            return []
        return [*self.rank_pids, self.proc.pid] if self.tp_size > 1 else [self.proc.pid]

    def start(self, timeout: float) -> None:
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        logf = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        cmd = [sys.executable, "-m", "nnd_daemon.worker", "--socket", self.socket, "--name", self.name]
        cmd += ["--parent", str(os.getpid()), "--limits", json.dumps(self.limits)]
        if self.batch_window_ms > 0 and self.tp_size <= 1:
            cmd += ["--batch-window-ms", str(self.batch_window_ms)]
        env = None
        if self.tp_size > 1:  # a torchrun group of tp_size ranks, each running the same worker module
            gpus = tplaunch.gpu_count()
            cmd = tplaunch.command(self.tp_size, cmd[3:])
            env = tplaunch.environment(self.placement, gpus)
            self._log_offset = logf.tell()
        # No preexec_fn: running Python between fork and exec in a threaded
        # daemon can crash the child. The worker ties its life to ours itself.
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, close_fds=True, env=env)
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
        # Results pass through the daemon as bytes, never decoded here.
        self.run_raw = self.channel.unary_stream(
            "/nnd.v1.Worker/Run",
            request_serializer=worker_pb2.WorkerRunRequest.SerializeToString,
            response_deserializer=None,
        )

    def describe_exit(self) -> str:
        code = self.proc.poll() if self.proc else None
        if code is None:
            return "still running"
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
        if not self._stopping:
            log.warning("worker for %s died: %s", self.name, self.exit_reason)
            self._on_exit(self, self.exit_reason)

    def load(self, request: worker_pb2.WorkerLoadRequest) -> Iterator[nnd_pb2.DispatchProgress]:
        assert self.stub is not None
        try:
            yield from self.stub.Load(request)
        except grpc.RpcError as err:
            raise self.translate(err) from None

    def run(self, request: nnd_pb2.TraceRequest, *, generate: bool, timeout: float | None) -> Iterator[bytes]:
        call = self.run_raw(worker_pb2.WorkerRunRequest(request=request, generate=generate), timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as err:
            raise self.translate(err) from None
        finally:
            call.cancel()

    def status(self, timeout: float = 2.0) -> worker_pb2.WorkerStatus | None:
        if self.stub is None:
            return None
        try:
            return self.stub.Status(worker_pb2.WorkerStatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None

    def translate(self, err: grpc.RpcError) -> errors.NndError:
        """A worker's status, re-raised for the client; a vanished worker is UNAVAILABLE."""
        code = err.code()
        if self.tp_size > 1 and self.proc and (code == grpc.StatusCode.UNAVAILABLE or self._rank_gone()):
            # A group goes down as a whole: torchrun stops the other ranks when one dies; wait for it to
            # finish, and finish it ourselves if a rank hangs (torchrun would wait 30 s on a stuck one).
            # (A CANCELLED with every rank alive is a cancelled request, not a failing group.)
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
        if code == grpc.StatusCode.UNAVAILABLE or (self.proc and self.proc.poll() is not None):
            time.sleep(0.05)  # let the watcher record why it died
            reason = self.describe_exit() if self.proc and self.proc.poll() is not None else err.details()
            return errors.Unavailable(f"worker for {self.name} died: {reason}")
        exc_type = ""
        for key, value in err.trailing_metadata() or ():
            if key == errors.EXC_TYPE_KEY:
                exc_type = value
        mapped = errors.NndError(err.details() or str(code), exc_type=exc_type)
        mapped.code = code
        return mapped

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
        if os.path.exists(self.socket):
            try:
                os.unlink(self.socket)
            except OSError:
                pass

    def info(self) -> dict[str, Any]:
        return {"pid": self.pid, "socket": self.socket}

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
