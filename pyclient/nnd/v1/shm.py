"""Shared-memory results, the part of the contract both sides share: how a client's region is
named (the worker checks a request's name against it), offsets' alignment, and removing the
regions of processes that are gone. The client's pool lives in nnd/_shm.py, the worker's side
in nnd_daemon/worker/shm.py; neither imports the other."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import stat

SHM_DIR = "/dev/shm"
ALIGN = 64  # offsets of results in a region: cache-line aligned, for any dtype
# A process's directory of regions: pid, process start time, random.
DIR_NAME = re.compile(r"nnd-c([0-9]{1,10})-([0-9]{1,20})-([0-9a-f]{8})")
# A region, as a request names it: its directory, then serial and 128 random bits.
REGION_NAME = re.compile(r"(nnd-c[0-9]{1,10}-[0-9]{1,20}-[0-9a-f]{8})/([0-9]{1,12}-[0-9a-f]{32})")


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def process_start(pid: int) -> int | None:
    """Process `pid`'s start time in clock ticks since boot (0 without /proc); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0 if not os.path.isdir("/proc/self") else None
    try:
        return int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])  # field 22; the name in (...) may hold spaces
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


_OLD_REGION = re.compile(r"nnd-c([0-9]{1,10})-([0-9]{1,20})-[0-9]{1,12}-[0-9a-f]{8}")  # before directories


def remove_dir(path: str) -> None:
    """Remove a region directory of this user and the regions in it (never following a link)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def reap_dead() -> int:
    """Remove the regions (of this user) whose creating process is gone; returns how many directories or files."""
    n = 0
    uid = os.geteuid()
    for path in glob.glob(os.path.join(SHM_DIR, "nnd-c*")):
        name = os.path.basename(path)
        m = DIR_NAME.fullmatch(name) or _OLD_REGION.fullmatch(name)
        if m is None:
            continue
        try:
            st = os.lstat(path)
            if st.st_uid != uid or alive(int(m.group(1)), int(m.group(2))):
                continue
            if stat.S_ISDIR(st.st_mode):
                remove_dir(path)
            else:
                os.unlink(path)
            n += 1
        except OSError:
            continue
    return n
