"""Results through shared memory (`shm=True`; the worker's side is daemon/worker/shm.py).

In the manner of Triton's system shared-memory extension, the client owns the
memory: a small pool of regions, files `/dev/shm/nnd-c<pid>-<start>-<serial>-<hex>`
(mode 0600, every byte allocated up front so a full /dev/shm is an error here,
never a SIGBUS in the worker), each mapped once and reused request after
request. That reuse is the point: a copy into memory already faulted in runs
~7x faster than one into fresh pages. A request names one free region
(`TraceRequest.shm_region`, set by `attach`); the worker writes each big
result into it (one copy, straight from the tensor) and answers with offsets;
the results are zero-copy views of the mapping. A region goes back to the pool
only when every array viewing it has been garbage-collected, so a live result
is never overwritten.

Sizes: a client's first shm request names no region, so the worker uses fresh
segments of its own (`take_fresh`: map, then unlink: the acknowledgement); the
bytes that took tell the pool how big a region to make. A later result that
outgrows its region spills into fresh segments the same way, and the next
region is made big enough. A process has at most `MAX_REGIONS` regions; while
all are in use by live results, requests take fresh segments too.

Cleanup whatever happens: regions are unlinked at normal exit (atexit); the
regions of a process that is gone (SIGKILL) are unlinked by the daemon's worker
within `NND_SHM_REAP_S` seconds (default 2) while it runs, and by the next nnd
client that uses shm on the host in any case (`reap_dead`). The start time in
the name keeps a reused pid from passing for the dead client.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import glob
import itertools
import mmap
import os
import re
import secrets
import sys
import threading
import weakref
from typing import Any

import numpy as np

SHM_DIR = "/dev/shm"
ALIGN = 64  # offsets of results in a region: cache-line aligned, for any dtype
# A region name: pid, process start time, serial, random.
REGION_NAME = re.compile(r"nnd-c([0-9]{1,10})-([0-9]{1,20})-([0-9]{1,12})-([0-9a-f]{8})")
_FRESH_NAME = re.compile(r"nnd-[0-9]+-[0-9]+-[0-9a-f]+")  # segments the worker creates (worker/shm.py)
KEEP_FREE = 2  # free regions kept mapped between requests; more are unlinked
# Regions a process has at once. Past that (results kept alive, or freed only by a later garbage
# collection), requests take fresh segments: making a region costs more than a fresh segment.
MAX_REGIONS = 2


def available(address: str) -> bool:
    """Whether results can come through shared memory: Linux, /dev/shm, and a daemon on this host's unix socket."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR) and address.startswith("unix:")


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def region_max() -> int:
    """Largest region the pool makes (NND_SHM_REGION_MAX bytes, default 1 GiB); bigger results use fresh segments."""
    try:
        return max(0, int(os.environ.get("NND_SHM_REGION_MAX", str(2**30))))
    except ValueError:
        return 2**30


# ------------------------------------------------------------------ whose region, and is its owner alive


def process_start(pid: int) -> int | None:
    """Process `pid`'s start time in clock ticks since boot (0 without /proc); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0 if not os.path.isdir("/proc/self") else None
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22; the name in (...) may hold spaces
    except (ValueError, IndexError):
        return 0


def alive(pid: int, start: int) -> bool:
    """Whether the process that created a region (its pid and start time, from the name) still runs."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    now = process_start(pid)
    return now is not None and (start == 0 or now == 0 or now == start)


def reap_dead() -> int:
    """Unlink the regions (of this user) whose creating process is gone; returns how many."""
    n = 0
    uid = os.geteuid()
    for path in glob.glob(os.path.join(SHM_DIR, "nnd-c*")):
        m = REGION_NAME.fullmatch(os.path.basename(path))
        if m is None:
            continue
        try:
            if os.lstat(path).st_uid != uid or alive(int(m.group(1)), int(m.group(2))):
                continue
            os.unlink(path)
            n += 1
        except OSError:
            continue
    return n


# ------------------------------------------------------------------ the pool


class Region:
    """One region: a file in /dev/shm and this process's mapping of it."""

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.size = size
        self.mm = mm
        self.ino = os.stat(self.path).st_ino

    @classmethod
    def create(cls, size: int, serial: int) -> Region | None:
        """A new region of `size` bytes, every page allocated; None if /dev/shm cannot hold it."""
        start = process_start(os.getpid()) or 0
        name = f"nnd-c{os.getpid()}-{start}-{serial}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # Allocate now: a full /dev/shm fails here (ENOSPC), not as a SIGBUS when the worker writes.
            os.posix_fallocate(fd, 0, size)
            # MAP_POPULATE: the pages are already there; map them all now, once, not a fault per page later.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        finally:
            os.close(fd)
        return cls(name, size, mm)

    def intact(self) -> bool:
        """Still the file this process created (nobody unlinked or replaced it)."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return st.st_ino == self.ino and st.st_size == self.size

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            if self.intact():
                os.unlink(self.path)


class Lease:
    """One request's use of one region, from `attach` until its results are garbage."""

    def __init__(self, pool: Pool, region: Region) -> None:
        self.pool = pool
        self.region = region
        self.holder: np.ndarray | None = None

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The result bytes at `offset`: a writable uint8 view of the region (no copy)."""
        if offset < 0 or offset % ALIGN or offset + nbytes > self.region.size:
            raise ValueError(
                f"the daemon placed a result of {nbytes} bytes at offset {offset} of shared-memory region "
                f"{self.region.name} ({self.region.size} bytes)"
            )
        if self.holder is None:
            # Every result array is a view of this one array (numpy keeps it as their base), so its
            # finalizer runs exactly when the last of them is gone.
            self.holder = np.frombuffer(self.region.mm, dtype=np.uint8)
        return self.holder[offset : offset + nbytes]

    def finish(self, ok: bool) -> None:
        """The request's stream ended (`ok`: completely, its results decoded)."""
        if not ok:
            # The worker may still be writing (a cancelled or timed-out call): never reuse it.
            self.pool.retire(self.region)
        elif self.holder is None:
            self.pool.give_back(self.region)
        else:
            weakref.finalize(self.holder, self.pool.give_back, self.region)
            self.holder = None


class Pool:
    """This process's regions."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # Reentrant: a garbage collection inside a locked section may run a result's finalizer (give_back).
        self.lock = threading.RLock()
        self.regions: dict[str, Region] = {}
        self.free: list[Region] = []
        self.hint = 0  # bytes the biggest request so far put in shared memory
        self.serial = itertools.count(1)
        self.created = 0  # regions made so far (a warm pool makes none)
        self.busy = 0  # requests that took fresh segments because every region was in use
        self.reaped = False

    def lease(self) -> Lease | None:
        """A free region big enough for what requests have needed so far; None before anything is known."""
        lease = self._reuse()
        if lease is None and len(self.regions) > len(self.free):
            # A result may still sit in a reference cycle (a tracer the user keeps, a container of
            # proxies): a young-generation collection (~0.1 ms) hands its region back before a new one is made.
            gc.collect(1)
            lease = self._reuse()
        if lease is not None or not self.hint:
            return lease
        with self.lock:
            want = self.hint
            # Nothing fits: drop what is free (too small or tampered with) and make one, if allowed.
            stale, self.free = self.free, []
            for old in stale:
                self._drop(old)
            if len(self.regions) >= MAX_REGIONS:
                self.busy += 1
                return None
            reap = not self.reaped
            self.reaped = True
        if reap:
            reap_dead()  # once per process: what SIGKILLed clients left behind
        size = -(-want // mmap.PAGESIZE) * mmap.PAGESIZE
        region = Region.create(size, next(self.serial))
        if region is None:
            return None
        with self.lock:
            self.regions[region.name] = region
            self.created += 1
        return Lease(self, region)

    def _reuse(self) -> Lease | None:
        with self.lock:
            for region in sorted(self.free, key=lambda r: r.size):
                if self.hint and region.size >= self.hint and region.intact():
                    self.free.remove(region)
                    return Lease(self, region)
        return None

    def learn(self, need: int) -> None:
        with self.lock:
            self.hint = min(max(self.hint, aligned(need)), region_max())

    def give_back(self, region: Region) -> None:
        with self.lock:
            if region.name not in self.regions:
                return
            if region.size < self.hint or len(self.free) >= KEEP_FREE or not region.intact():
                self._drop(region)
            else:
                self.free.append(region)

    def retire(self, region: Region) -> None:
        with self.lock:
            self._drop(region)

    def _drop(self, region: Region) -> None:
        # Unlinking frees the memory once the last mapping goes; arrays still viewing it keep working.
        self.regions.pop(region.name, None)
        region.unlink()

    def unlink_all(self) -> None:
        if os.getpid() != self.pid:  # a forked child: these are its parent's
            return
        with self.lock:
            for region in list(self.regions.values()):
                self._drop(region)
            self.free.clear()


_pool: Pool | None = None
_pool_lock = threading.Lock()


def pool() -> Pool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = Pool()
            atexit.register(_pool.unlink_all)
        return _pool


def attach(request: Any) -> Lease | None:
    """Have `request`'s big results written into a region of the pool, when one is free.

    The caller hands the lease to `_results.collect`, which settles it when the stream ends.
    None: no region free (or none sized yet); the worker then makes fresh segments."""
    lease = pool().lease()
    if lease is not None:
        request.shm_region = lease.region.name
    return lease


def take_fresh(name: str, offset: int, nbytes: int) -> Any:
    """A writable private mapping of fresh segment `name` (the worker's, one per tensor); the segment is unlinked."""
    if not _FRESH_NAME.fullmatch(name):
        raise ValueError(f"the daemon sent an invalid shared-memory segment name {name!r}")
    if offset != 0:
        raise ValueError(f"the daemon sent offset {offset} in fresh segment {name}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(
            f"cannot open the shared-memory result {path}: {exc.strerror}. The daemon's worker creates it for "
            "its own user; run the client as that user, or trace without shm=True"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared-memory result {name} holds {size} bytes, {nbytes} expected")
        # MAP_PRIVATE: a copy-on-write view, so writing into the tensor never touches the segment.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE) if nbytes else bytearray()
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass  # another user's segment in a sticky /dev/shm: the worker's timer unlinks it
