"""Results through shared memory (`shm=True`; the worker's side is daemon/worker/shm.py).

In the manner of Triton's system shared-memory extension, the client owns the
memory: a small pool of regions, each mapped once and reused request after
request. That reuse is the point: a copy into memory already faulted in runs
~7x faster than one into fresh pages. A request names one free region
(`TraceRequest.shm_region`, set by `attach`); the worker writes each big
result into it and answers with offsets; the results are zero-copy views of
the mapping. A region goes back to the pool only when every array viewing it
has been garbage-collected, so a live result is never overwritten.

Who can see what (a lab box: the daemon runs as a service user, clients as
their own users in the socket's group). Regions live in a directory of this
process, `/dev/shm/nnd-c<pid>-<start>-<hex>/`, as files `<serial>-<32 hex>`:
- daemon of this user (the socket is ours): directory 0700, files 0600; the
  worker maps them and copies into them;
- daemon of another user: directory 0710 and files 0620, both of the
  socket's group (which the worker has, and which lets this user reach the
  socket). Nobody but this user can read a region, the daemon included: the
  worker opens it write-only and writes with pwrite. Group members can
  traverse the directory but not list it, so a region's name (128 random
  bits) is known only to this process and the daemon it was sent to: nobody
  else can find a region to write into it, and nobody outside the group can
  even reach one. Sizes are not visible in /dev/shm either.
When no region fits (a first request: the size is not known yet; all regions
busy; the socket's group is not one of ours), results are streamed as without
shm, and their sizes tell the pool how big a region to make. The worker never
creates shared memory of its own.

Every byte of a region is allocated up front (a full /dev/shm is an error
here, never a SIGBUS in the worker). Cleanup whatever happens: regions are
unlinked at normal exit (atexit); the directories of a process that is gone
(SIGKILL) are removed by the next nnd client of the same user that uses shm
(`reap_dead`), and by a worker of that user within `NND_SHM_REAP_S` seconds
(default 2). The start time in the name keeps a reused pid from passing for
the dead client.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
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

from nnd.v1.shm import ALIGN, SHM_DIR, aligned, process_start, reap_dead, remove_dir
from nnd.v1.shm import alive as alive  # noqa: F401 - part of this module's interface (tests, tools)

_FRESH_NAME = re.compile(r"nnd-[0-9]+-[0-9]+-[0-9a-f]+")  # segments older workers created
KEEP_FREE = 2  # free regions kept mapped between requests; more are unlinked
# Regions a process has at once. Past that (results kept alive, or freed only by a later garbage
# collection), requests stream their results: making a region costs more than streaming once.
MAX_REGIONS = 2
PRIVATE = -1  # the "group" of regions for a daemon of this user: no group access


def available(address: str) -> bool:
    """Whether results can come through shared memory: Linux, /dev/shm, and a daemon on this host's unix socket."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR) and address.startswith("unix:")


def region_max() -> int:
    """Largest region the pool makes (NND_SHM_REGION_MAX bytes, default 1 GiB); bigger results are streamed."""
    try:
        return max(0, int(os.environ.get("NND_SHM_REGION_MAX", str(2**30))))
    except ValueError:
        return 2**30


def access_group(address: str) -> int | None:
    """How regions for the daemon at `address` are shared: PRIVATE (the daemon runs as this user), the
    socket's group (another user's daemon), or None (no group to share them through: stream instead)."""
    from nnd.wire import _address

    path = _address.unix_path(address)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid == os.geteuid():
        return PRIVATE
    if st.st_gid in os.getgroups() or st.st_gid == os.getegid() or os.geteuid() == 0:
        return st.st_gid
    return None


# ------------------------------------------------------------------ whose region, and is its owner alive


# ------------------------------------------------------------------ the pool


class Directory:
    """This process's directory of regions for one group (PRIVATE: for a daemon of this user)."""

    def __init__(self, group: int) -> None:
        self.group = group
        start = process_start(os.getpid()) or 0
        while True:
            self.name = f"nnd-c{os.getpid()}-{start}-{secrets.token_hex(4)}"
            self.path = os.path.join(SHM_DIR, self.name)
            try:
                os.mkdir(self.path, 0o700)
                break
            except FileExistsError:  # someone took the name first: another one
                continue
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(self.fd)
            if st.st_uid != os.geteuid():
                raise PermissionError(f"{self.path} is not this user's")
            if group != PRIVATE:
                # Search, not read: the daemon's group reaches a region by its name, nobody can list them.
                os.fchown(self.fd, -1, group)
                os.fchmod(self.fd, 0o710)
        except OSError:
            self.remove()
            raise

    def create(self, size: int, serial: int) -> tuple[str, int, mmap.mmap] | None:
        """A new region file of `size` bytes, every page allocated and mapped: (file name, inode, mapping)."""
        name = f"{serial}-{secrets.token_hex(16)}"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            if self.group != PRIVATE:
                # Write-only for the daemon's group: the worker pwrites results, it can never read them.
                os.fchown(fd, -1, self.group)
                os.fchmod(fd, 0o620)
            # Allocate now: a full /dev/shm fails here (ENOSPC), not when the worker writes.
            os.posix_fallocate(fd, 0, size)
            # MAP_POPULATE: the pages are already there; map them all now, once, not a fault per page later.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            ino = os.fstat(fd).st_ino
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.fd)
            return None
        finally:
            os.close(fd)
        return name, ino, mm

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            remove_dir(self.path)


class Region:
    """One region: a file in this process's directory and this process's mapping of it."""

    def __init__(self, directory: Directory, file: str, ino: int, size: int, mm: mmap.mmap) -> None:
        self.group = directory.group
        self.name = f"{directory.name}/{file}"  # what a request names
        self.path = os.path.join(directory.path, file)
        self.size = size
        self.mm = mm
        self.ino = ino

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
    """One request's use of one region (or of none: then its results are streamed, and their size is
    learnt), from `attach` until its results are garbage."""

    def __init__(self, pool: Pool, region: Region | None) -> None:
        self.pool = pool
        self.region = region
        self.holder: np.ndarray | None = None

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The result bytes at `offset`: a writable uint8 view of the region (no copy)."""
        region = self.region
        if region is None or offset < 0 or offset % ALIGN or offset + nbytes > region.size:
            raise ValueError(
                f"the daemon placed a result of {nbytes} bytes at offset {offset} of shared-memory region "
                f"{region.name if region else None} ({region.size if region else 0} bytes)"
            )
        if self.holder is None:
            # Every result array is a view of this one array (numpy keeps it as their base), so its
            # finalizer runs exactly when the last of them is gone.
            self.holder = np.frombuffer(region.mm, dtype=np.uint8)
        return self.holder[offset : offset + nbytes]

    def finish(self, ok: bool, need: int = 0) -> None:
        """The request's stream ended (`ok`: completely, its results decoded); `need`: bytes its big
        results took, which sizes the next region."""
        if need:
            self.pool.learn(need)
        region = self.region
        if region is None:
            return
        if not ok:
            # The worker may still be writing (a cancelled or timed-out call): never reuse it.
            self.pool.retire(region)
        elif self.holder is None:
            self.pool.give_back(region)
        else:
            weakref.finalize(self.holder, self.pool.give_back, region)
            self.holder = None


class Pool:
    """This process's regions."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # Reentrant: a garbage collection inside a locked section may run a result's finalizer (give_back).
        self.lock = threading.RLock()
        self.dirs: dict[int, Directory] = {}
        self.refused: set[int] = set()  # groups no directory could be made for
        self.regions: dict[str, Region] = {}
        self.free: list[Region] = []
        self.hint = 0  # bytes the biggest request so far put in shared memory
        self.serial = itertools.count(1)
        self.created = 0  # regions made so far (a warm pool makes none)
        self.busy = 0  # requests streamed because every region was in use
        self.reaped = False

    def lease(self, group: int) -> Lease:
        """A free region of `group` big enough for what requests have needed so far; one without a
        region before anything is known."""
        lease = self._reuse(group)
        if lease is None and len(self.regions) > len(self.free):
            # A result may still sit in a reference cycle (a tracer the user keeps, a container of
            # proxies): a young-generation collection (~0.1 ms) hands its region back before a new one is made.
            gc.collect(1)
            lease = self._reuse(group)
        if lease is not None or not self.hint:
            return lease or Lease(self, None)
        with self.lock:
            want = self.hint
            # Nothing fits: drop what is free (too small, of another group, tampered with) and make one, if allowed.
            stale, self.free = self.free, []
            for old in stale:
                self._drop(old)
            if len(self.regions) >= MAX_REGIONS:
                self.busy += 1
                return Lease(self, None)
            reap = not self.reaped
            self.reaped = True
        if reap:
            reap_dead()  # once per process: what SIGKILLed clients left behind
        size = -(-want // mmap.PAGESIZE) * mmap.PAGESIZE
        with self.lock:
            directory = self.dirs.get(group)
            if directory is None:
                if group in self.refused:
                    return Lease(self, None)
                try:
                    directory = self.dirs[group] = Directory(group)
                except OSError:  # e.g. not allowed to give it that group: stream, and do not try again
                    self.refused.add(group)
                    return Lease(self, None)
            made = directory.create(size, next(self.serial))
            if made is None:
                return Lease(self, None)
            region = Region(directory, made[0], made[1], size, made[2])
            self.regions[region.name] = region
            self.created += 1
        return Lease(self, region)

    def _reuse(self, group: int) -> Lease | None:
        with self.lock:
            for region in sorted(self.free, key=lambda r: r.size):
                if self.hint and region.group == group and region.size >= self.hint and region.intact():
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
            for directory in self.dirs.values():
                directory.remove()
            self.dirs.clear()


_pool: Pool | None = None
_pool_lock = threading.Lock()


def pool() -> Pool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = Pool()
            atexit.register(_pool.unlink_all)
        return _pool


def attach(request: Any, address: str) -> Lease:
    """Have `request`'s big results written into a region of the pool, when one is free.

    The caller hands the lease to `_results.collect`, which settles it when the
    stream ends. A lease without a region (none free, none sized yet, no way to
    share one with the daemon at `address`): the results are streamed."""
    group = access_group(address)
    if group is None:
        return Lease(pool(), None)
    lease = pool().lease(group)
    if lease.region is not None:
        request.shm_region = lease.region.name
    return lease


def take_fresh(name: str, offset: int, nbytes: int) -> Any:
    """A writable private mapping of fresh segment `name` (an older worker's, one per tensor); it is unlinked."""
    if not _FRESH_NAME.fullmatch(name):
        raise ValueError(f"the daemon sent an invalid shared-memory segment name {name!r}")
    if offset != 0:
        raise ValueError(f"the daemon sent offset {offset} in fresh segment {name}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(f"cannot open the shared-memory result {path}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared-memory result {name} holds {size} bytes, {nbytes} expected")
        # MAP_PRIVATE: a copy-on-write view, so writing into the tensor never touches the segment.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE) if nbytes else bytearray()
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
