"""Results through POSIX shared memory (`TraceRequest.shm`), for clients on the daemon's host.

In the manner of Triton's system shared-memory extension (the client's side
is pyclient/nnd/_shm.py):

- **Client regions** (`TraceRequest.shm_region`). The client owns a few
  regions, files `/dev/shm/nnd-c<pid>-<start>-<serial>-<hex>`, and names a
  free one in each request. Every result tensor of `wire.INLINE_LIMIT` bytes
  or more is copied straight from the tensor into it (one copy, no
  intermediate bytes) at the next 64-byte aligned offset, and the Tensor
  message carries the name and offset. Mappings are cached by name (at most
  `MAX_MAPPINGS`), so a region a client reuses is memory this process has
  already faulted in: the copy runs at memcpy speed, not at the ~2.4 GB/s of
  fresh pages.
- **Fresh segments**, for a request with `shm` but no region (a client's
  first, or one that keeps no pool) and for what does not fit in its region:
  a file `/dev/shm/nnd-<worker pid>-<serial>-<random>` per tensor, created
  with mode 0600 (O_EXCL). The client maps it and unlinks it at once: the
  unlink is its acknowledgement.

What a request may name is checked before anything is written: a region name
must match the pattern above (else INVALID_ARGUMENT), so it cannot point
outside /dev/shm; the file is opened without following links and used only if
it is a regular file of this process's user with every byte allocated (so the
writes cannot hit a full /dev/shm, which would be a SIGBUS), else the request
falls back to fresh segments. No write goes past the file's size. (A process of
the same user could still shrink the file during a write and crash this
worker; it could as well kill it.)

Cleanup whatever happens to the client:
- fresh segments: if the request fails they are unlinked at once; otherwise
  each one still present `grace_s` seconds (NND_SHM_GRACE_S, default 30) after
  its response was handed over (the client died, was killed, or cannot unlink)
  is unlinked by the worker;
- regions: the client unlinks its own at exit; every `reap_s` seconds
  (NND_SHM_REAP_S, default 2) the janitor unlinks the regions of processes that
  are gone (a SIGKILLed client; its pid and start time are in the name) and
  drops its mappings of regions that were unlinked, which frees their memory.
  The janitor runs from a worker's first shm request on.
A worker that exits unlinks the fresh segments it still owns; one that dies
(SIGKILL) has them removed by the daemon (`remove_segments`, from the
supervisor), which finds them by the pid in their names and reaps dead
clients' regions too.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import heapq
import itertools
import logging
import mmap
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from nnd._shm import REGION_NAME, aligned, reap_dead
from nnd_daemon import errors

log = logging.getLogger("nnd.worker.shm")

SHM_DIR = "/dev/shm"
PREFIX = "nnd-"
MAX_MAPPINGS = 16  # client regions kept mapped; the least recently used goes first


def _env_seconds(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, str(default))))
    except ValueError:
        return default


def grace_s() -> float:
    return _env_seconds("NND_SHM_GRACE_S", 30.0)


def reap_s() -> float:
    return max(0.1, _env_seconds("NND_SHM_REAP_S", 2.0))


def remove_segments(pid: int) -> int:
    """Unlink every segment worker `pid` created (called when it is gone), and dead clients' regions."""
    n = 0
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{pid}-*")):
        with contextlib.suppress(OSError):
            os.unlink(path)
            n += 1
    return n + reap_dead()


# ------------------------------------------------------------------ client regions


class Region:
    """A client's region as mapped here."""

    def __init__(self, name: str, key: tuple[int, int, int], mm: mmap.mmap) -> None:
        self.name = name
        self.key = key  # (st_dev, st_ino, st_size): the file it was when mapped
        self.mm = mm
        self.size = key[2]

    def write(self, t: Any, offset: int) -> None:
        """Tensor `t`'s elements (C order, little-endian) at `offset`: one copy, from `t` into the mapping."""
        import torch

        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > self.size:  # the caller checked; never write past the file
            raise errors.NndError(f"internal error: {nbytes} bytes at {offset} do not fit region {self.name}")
        dst = torch.frombuffer(self.mm, dtype=t.dtype, count=t.numel(), offset=offset)
        dst.view(t.shape).copy_(t.detach())  # copy_ also gathers a non-contiguous or GPU tensor


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size)


class Regions:
    """Client regions this worker has mapped, by name (an LRU cache)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[str, Region] = collections.OrderedDict()

    def get(self, name: str) -> Region | None:
        """The region a request names, mapped; None when it cannot be used (then fresh segments are)."""
        if not REGION_NAME.fullmatch(name):
            raise errors.InvalidArgument(
                f"shm_region {name[:80]!r} is not a region name (nnd-c<pid>-<start>-<serial>-<8 hex digits>)"
            )
        path = os.path.join(SHM_DIR, name)
        try:
            now = _key(os.lstat(path))
        except OSError:
            log.info("shared-memory region %s not found; using fresh segments", name)
            return None
        with self._lock:
            region = self._maps.get(name)
            if region is not None and region.key == now:
                self._maps.move_to_end(name)
                return region
        region = self._map(name, path)
        if region is None:
            return None
        # Dropped mappings are not closed: a request still writing holds one; the last reference unmaps it.
        with self._lock:
            self._maps[name] = region
            self._maps.move_to_end(name)
            while len(self._maps) > MAX_MAPPINGS:
                self._maps.popitem(last=False)
        return region

    def _map(self, name: str, path: str) -> Region | None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            log.info("cannot open shared-memory region %s (%s); using fresh segments", name, exc.strerror)
            return None
        try:
            st = os.fstat(fd)
            why = None
            if not stat.S_ISREG(st.st_mode):
                why = "not a regular file"
            elif st.st_uid != os.geteuid():
                why = "owned by another user"
            elif st.st_size <= 0:
                why = "empty"
            elif st.st_blocks * 512 < st.st_size:
                why = "not allocated up front (posix_fallocate)"
            if why is not None:
                log.info("shared-memory region %s is %s; using fresh segments", name, why)
                return None
            return Region(name, _key(st), mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED))
        except OSError as exc:
            log.info("cannot map shared-memory region %s (%s); using fresh segments", name, exc.strerror)
            return None
        finally:
            os.close(fd)

    def sweep(self) -> None:
        """Drop mappings of regions whose file is gone or replaced: that memory comes back."""
        with self._lock:
            items = list(self._maps.items())
        stale = []
        for name, region in items:
            try:
                gone = _key(os.lstat(os.path.join(SHM_DIR, name))) != region.key
            except OSError:
                gone = True
            if gone:
                stale.append(name)
        with self._lock:
            for name in stale:
                self._maps.pop(name, None)


# ------------------------------------------------------------------ fresh segments


class Segments:
    """The fresh segments one worker created and has not seen acknowledged yet, and its janitor."""

    def __init__(self, grace: float | None = None) -> None:
        self.grace = grace_s() if grace is None else grace
        self.regions = Regions()
        self._serial = itertools.count(1)
        self._lock = threading.Lock()
        self._due: list[tuple[float, str]] = []  # (unlink time, name), a heap
        self._wake = threading.Event()
        self._janitor: threading.Thread | None = None

    def write(self, t: Any) -> str:
        """A new segment holding tensor `t`'s wire bytes (little-endian, C order); its name."""
        from nnd_daemon.engine import wire

        view = wire.tensor_view(t)
        name = f"{PREFIX}{os.getpid()}-{next(self._serial)}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            done = 0
            while done < len(view):  # os.write, not a mapping: a full /dev/shm is ENOSPC, not SIGBUS
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
        self._wake.set()

    def start_janitor(self) -> None:
        with self._lock:
            if self._janitor is None:
                self._janitor = threading.Thread(target=self._sweep, name="shm-janitor", daemon=True)
                self._janitor.start()

    def _sweep(self) -> None:
        period = reap_s()
        next_reap = 0.0
        while True:
            now = time.monotonic()
            with self._lock:
                expired = []
                while self._due and self._due[0][0] <= now:
                    expired.append(heapq.heappop(self._due)[1])
                next_due = self._due[0][0] if self._due else float("inf")
            gone = [n for n in expired if os.path.exists(os.path.join(SHM_DIR, n))]
            if gone:
                log.info("unlinking %d shared-memory result(s) no client took", len(gone))
                self.unlink(gone)
            if now >= next_reap:
                next_reap = now + period
                try:
                    self.regions.sweep()
                    if n := reap_dead():
                        log.info("unlinked %d shared-memory region(s) of clients that are gone", n)
                except Exception:  # noqa: BLE001 - the janitor must outlive any one odd file
                    log.exception("shared-memory janitor")
            self._wake.wait(max(0.0, min(next_due, next_reap) - time.monotonic()))
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
    """Around one request's run: with `request.request.shm`, big result tensors go to shared memory.

    `request` is the WorkerRunRequest. Into the client's region when it names
    a usable one, as far as it fits; into fresh segments otherwise. On failure
    the fresh segments are unlinked at once; on success they expire after the
    grace period unless taken."""
    trace = getattr(request, "request", None)
    if trace is None or not getattr(trace, "shm", False) or not os.path.isdir(SHM_DIR):
        yield
        return
    from nnd_daemon.engine import wire

    owner = segments()
    owner.start_janitor()
    region = owner.regions.get(trace.shm_region) if trace.shm_region else None
    used = 0
    created: list[str] = []

    def sink(t: Any) -> tuple[str, int]:
        nonlocal used
        nbytes = t.numel() * t.element_size()
        if region is not None and used + nbytes <= region.size:
            offset = used
            region.write(t, offset)
            used = aligned(offset + nbytes)
            return region.name, offset
        name = owner.write(t)
        created.append(name)
        return name, 0

    token = wire.blob_sink.set(sink)
    try:
        yield
    except BaseException:
        owner.unlink(created)
        raise
    finally:
        wire.blob_sink.reset(token)
    owner.expire(created)
