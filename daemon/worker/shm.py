"""Results through POSIX shared memory (`TraceRequest.shm`), for clients on the daemon's host.

In the manner of Triton's system shared-memory extension, the client owns the
memory (its side is pyclient/nnd/_shm.py): it names one of its regions,
`/dev/shm/nnd-c<pid>-<start>-<hex>/<serial>-<32 hex>`, in a request
(`TraceRequest.shm_region`). Every result tensor of `wire.INLINE_LIMIT` bytes
or more is written into it at the next 64-byte aligned offset, as far as it
fits, and the Tensor message carries the region's name and the offset. What
does not fit, and everything of a request that names no usable region, is
streamed as without `shm`. The worker never creates shared memory of its own:
nothing it makes could be left behind, or be readable by another user.

Two ways to write, by who owns the region:
- **this worker's user** (a client of the daemon's own user): the region is
  opened read-write and mapped; mappings are cached by name (at most
  `MAX_MAPPINGS`), so a region a client reuses is memory this process has
  already faulted in and the copy runs at memcpy speed, straight from the
  tensor (one copy; GPU tensors included);
- **another user** (a lab box: the daemon runs as a service user): the client
  made the region writable, not readable, by the socket's group, so it is
  opened write-only and written with pwrite (one copy from the tensor's
  bytes). Never mapped: a mapping needs read access, and the owner could
  shrink the file under it, which is a SIGBUS that would kill this worker
  for every user of the model; pwrite past a shrunk end just fails or grows it.

What a request names is checked before anything is written: it must match the
pattern above (else INVALID_ARGUMENT), so it cannot point outside /dev/shm;
the directory is opened without following links and must be a directory on
/dev/shm's file system that only its owner can write; the region, opened in
it without following links, must be a regular file of the same owner with
every byte allocated; else the results are streamed. No write goes past the
file's size.

Cleanup: the client removes its regions; the janitor (every `reap_s` seconds,
NND_SHM_REAP_S, default 2, from a worker's first shm request on) drops its
mappings of regions that were unlinked, which frees their memory, and removes
the regions of dead clients of this worker's own user (only they can be
removed by it: /dev/shm is sticky). `remove_segments` removes what older
versions of the worker created (`nnd-<pid>-...`), at the daemon's start and
when a worker exits.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from typing import Any

from nnd.v1.shm import REGION_NAME, SHM_DIR, aligned, reap_dead
from nnd_daemon import errors

log = logging.getLogger("nnd.worker.shm")

MAX_MAPPINGS = 16  # client regions kept mapped; the least recently used goes first


def reap_s() -> float:
    try:
        return max(0.1, float(os.environ.get("NND_SHM_REAP_S", "2")))
    except ValueError:
        return 2.0




# ------------------------------------------------------------------ client regions


class Region:
    """A client's region, opened (and, when it is this user's, mapped) here."""

    def __init__(self, name: str, key: tuple[int, int, int], mm: mmap.mmap | None, fd: int = -1) -> None:
        self.name = name
        self.key = key  # (st_dev, st_ino, st_size): the file it was when opened
        self.mm = mm  # None: another user's region, written with pwrite through `fd`
        self.fd = fd
        self.size = key[2]

    def write(self, t: Any, offset: int) -> None:
        """Tensor `t`'s elements (C order, little-endian) at `offset`: one copy, from `t` into the region."""
        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > self.size:  # the caller checked; never write past the file
            raise errors.NndError(f"internal error: {nbytes} bytes at {offset} do not fit region {self.name}")
        if self.mm is None:
            from nnd_daemon.engine import wire

            view = wire.tensor_view(t)
            done = 0
            while done < nbytes:
                done += os.pwrite(self.fd, view[done:], offset + done)
            return
        import torch

        dst = torch.frombuffer(self.mm, dtype=t.dtype, count=t.numel(), offset=offset)
        dst.view(t.shape).copy_(t.detach())  # copy_ also gathers a non-contiguous or GPU tensor

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size)


def _unusable(st: os.stat_result, owner: int) -> str | None:
    """Why an opened region cannot take results (None: it can)."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != owner:
        return "not of its directory's owner"
    if st.st_size <= 0:
        return "empty"
    if st.st_blocks * 512 < st.st_size:
        return "not allocated up front (posix_fallocate)"
    return None


class Regions:
    """Client regions: this user's mapped (an LRU cache, by name), other users' opened per request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[str, Region] = collections.OrderedDict()
        self._dev = os.stat(SHM_DIR).st_dev

    def open(self, name: str) -> Region | None:
        """The region a request names; None when it cannot be used (then results are streamed).
        The caller closes it (`Region.close`) when the request is done."""
        m = REGION_NAME.fullmatch(name)
        if m is None:
            raise errors.InvalidArgument(
                f"shm_region {name[:80]!r} is not a region name "
                "(nnd-c<pid>-<start>-<8 hex digits>/<serial>-<32 hex digits>)"
            )
        try:
            # O_PATH: reaching a file in a directory needs search permission only, not read.
            dfd = os.open(os.path.join(SHM_DIR, m.group(1)), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.info("shared-memory region %s: directory unusable (%s); streaming", name, exc.strerror)
            return None
        try:
            dst = os.fstat(dfd)
            if dst.st_dev != self._dev or dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                log.info("shared-memory region %s: directory not on /dev/shm or writable by others; streaming", name)
                return None
            if dst.st_uid == os.geteuid():
                return self._mapped(name, m.group(2), dfd, dst.st_uid)
            return self._opened(name, m.group(2), dfd, dst.st_uid)
        finally:
            os.close(dfd)

    def _mapped(self, name: str, file: str, dfd: int, owner: int) -> Region | None:
        try:
            now = _key(os.stat(file, dir_fd=dfd, follow_symlinks=False))
        except OSError:
            log.info("shared-memory region %s not found; streaming", name)
            return None
        with self._lock:
            region = self._maps.get(name)
            if region is not None and region.key == now:
                self._maps.move_to_end(name)
                return region
        try:
            fd = os.open(file, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as exc:
            log.info("cannot open shared-memory region %s (%s); streaming", name, exc.strerror)
            return None
        try:
            st = os.fstat(fd)
            why = _unusable(st, owner)
            if why is not None:
                log.info("shared-memory region %s is %s; streaming", name, why)
                return None
            region = Region(name, _key(st), mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED))
        except OSError as exc:
            log.info("cannot map shared-memory region %s (%s); streaming", name, exc.strerror)
            return None
        finally:
            os.close(fd)
        # Dropped mappings are not closed: a request still writing holds one; the last reference unmaps it.
        with self._lock:
            self._maps[name] = region
            self._maps.move_to_end(name)
            while len(self._maps) > MAX_MAPPINGS:
                self._maps.popitem(last=False)
        return region

    def _opened(self, name: str, file: str, dfd: int, owner: int) -> Region | None:
        try:
            fd = os.open(file, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as exc:
            log.info("cannot open shared-memory region %s (%s); streaming", name, exc.strerror)
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        why = _unusable(st, owner)
        if why is not None:
            os.close(fd)
            log.info("shared-memory region %s is %s; streaming", name, why)
            return None
        return Region(name, _key(st), None, fd)

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


class Janitor:
    """Every `reap_s` seconds: drop mappings of unlinked regions, remove dead clients' regions."""

    def __init__(self, regions: Regions) -> None:
        self.regions = regions
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shm-janitor", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        period = reap_s()
        stop = threading.Event()
        while not stop.wait(period):
            try:
                self.regions.sweep()
                if n := reap_dead():
                    log.info("removed %d shared-memory region(s) of clients that are gone", n)
            except Exception:  # noqa: BLE001 - the janitor must outlive any one odd file
                log.exception("shared-memory janitor")


_regions: Regions | None = None
_janitor: Janitor | None = None
_state_lock = threading.Lock()


def regions() -> Regions:
    global _regions, _janitor
    with _state_lock:
        if _regions is None:
            _regions = Regions()
            _janitor = Janitor(_regions)
        assert _janitor is not None
        _janitor.start()
        return _regions


@contextlib.contextmanager
def results(request: Any) -> Iterator[None]:
    """Around one request's run: with `request.request.shm` and a usable `shm_region`, big result
    tensors go into the client's region as far as they fit; the rest is streamed.

    `request` is the WorkerRunRequest."""
    trace = getattr(request, "request", None)
    if trace is None or not getattr(trace, "shm", False) or not trace.shm_region or not os.path.isdir(SHM_DIR):
        yield
        return
    from nnd_daemon.engine import wire

    region = regions().open(trace.shm_region)
    if region is None:
        yield
        return
    used = 0

    def sink(t: Any) -> tuple[str, int] | None:
        nonlocal used
        nbytes = t.numel() * t.element_size()
        if used + nbytes > region.size:
            return None
        offset = used
        try:
            region.write(t, offset)
        except OSError as exc:  # e.g. the owner shrank the file and /dev/shm is full: stream it
            log.info("cannot write shared-memory region %s (%s); streaming", region.name, exc.strerror)
            return None
        used = aligned(offset + nbytes)
        return region.name, offset

    token = wire.blob_sink.set(sink)
    try:
        yield
    finally:
        wire.blob_sink.reset(token)
        region.close()
