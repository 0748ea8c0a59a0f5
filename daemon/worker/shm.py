"""Results through POSIX shared memory (`TraceRequest.shm`), for clients on the daemon's host.

In the manner of Triton's system shared-memory extension, but with the
worker creating the segments, since only it knows the results' sizes:

- While a request with `shm` set is encoded, every result tensor of
  `wire.INLINE_LIMIT` bytes or more is written into a segment of its own, a
  file `/dev/shm/nnd-<worker pid>-<serial>-<random>` created with mode 0600
  (O_EXCL), and the Tensor message carries only its name (`Tensor.shm`).
  One copy, from the tensor into the segment; no byte crosses a socket.
- The client maps the segment (a zero-copy view) and unlinks it at once: the
  unlink is its acknowledgement, and the mapping stays valid after it.
- Cleanup whatever happens to the client: if the request fails, its segments
  are unlinked at once; otherwise each segment still present `grace_s`
  seconds (NND_SHM_GRACE_S, default 30) after its response was handed over
  (the client died, was killed, or cannot unlink) is unlinked by the worker.
  A worker that exits unlinks what it still owns; one that dies (SIGKILL) has
  its segments removed by the daemon (`remove_segments`, from the supervisor),
  which finds them by the pid in their names.
"""

from __future__ import annotations

import contextlib
import glob
import heapq
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("nnd.worker.shm")

SHM_DIR = "/dev/shm"
PREFIX = "nnd-"


def grace_s() -> float:
    try:
        return max(0.0, float(os.environ.get("NND_SHM_GRACE_S", "30")))
    except ValueError:
        return 30.0


def remove_segments(pid: int) -> int:
    """Unlink every segment worker `pid` created (called when it is gone); returns how many."""
    n = 0
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{pid}-*")):
        with contextlib.suppress(OSError):
            os.unlink(path)
            n += 1
    return n


class Segments:
    """The segments one worker created and has not seen acknowledged yet."""

    def __init__(self, grace: float | None = None) -> None:
        self.grace = grace_s() if grace is None else grace
        self._serial = itertools.count(1)
        self._lock = threading.Lock()
        self._due: list[tuple[float, str]] = []  # (unlink time, name), a heap
        self._wake = threading.Event()
        self._janitor: threading.Thread | None = None

    def write(self, t: Any) -> str:
        """A new segment holding tensor `t`'s wire bytes (little-endian, C order); its name."""
        import torch

        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        elif t.dtype == torch.bool:
            t = t.to(torch.uint8)
        view = memoryview(t.numpy()).cast("B")
        name = f"{PREFIX}{os.getpid()}-{next(self._serial)}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        return name

    def unlink(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))

    def expire(self, names: list[str]) -> None:
        """Unlink these segments `grace` seconds from now unless their client has (or now, with no grace)."""
        if not names:
            return
        if self.grace <= 0:
            self.unlink(names)
            return
        when = time.monotonic() + self.grace
        with self._lock:
            for name in names:
                heapq.heappush(self._due, (when, name))
            if self._janitor is None:
                self._janitor = threading.Thread(target=self._sweep, name="shm-janitor", daemon=True)
                self._janitor.start()
        self._wake.set()

    def _sweep(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                expired = []
                while self._due and self._due[0][0] <= now:
                    expired.append(heapq.heappop(self._due)[1])
                wait = self._due[0][0] - now if self._due else None
            gone = [n for n in expired if os.path.exists(os.path.join(SHM_DIR, n))]
            if gone:
                log.info("unlinking %d shared-memory result(s) no client took", len(gone))
                self.unlink(gone)
            self._wake.wait(wait)
            self._wake.clear()

    def unlink_all(self) -> None:
        """At exit: every segment this worker still owns."""
        with self._lock:
            self._due.clear()
        remove_segments(os.getpid())


_segments: Segments | None = None
_segments_lock = threading.Lock()


def segments() -> Segments:
    global _segments
    with _segments_lock:
        if _segments is None:
            _segments = Segments()
        return _segments


@contextlib.contextmanager
def results(request: Any) -> Iterator[None]:
    """Around one request's run: with `request.request.shm`, big result tensors go to segments.

    `request` is the WorkerRunRequest. On failure its segments are unlinked at
    once; on success they expire after the grace period unless taken."""
    trace = getattr(request, "request", None)
    if trace is None or not getattr(trace, "shm", False) or not os.path.isdir(SHM_DIR):
        yield
        return
    from nnd_daemon.engine import wire

    owner = segments()
    created: list[str] = []

    def sink(t: Any) -> str:
        name = owner.write(t)
        created.append(name)
        return name

    token = wire.blob_sink.set(sink)
    try:
        yield
    except BaseException:
        owner.unlink(created)
        raise
    finally:
        wire.blob_sink.reset(token)
    owner.expire(created)
