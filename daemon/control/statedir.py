"""The state directory: made with explicit modes, and refused when others could
change what the daemon writes there.

The daemon writes its registry, uploads and worker logs under the state
directory. Anyone who can write that directory can swap `logs/` for a link to
a folder of theirs and have the next worker log created there, so a state
directory (or `logs/`, `uploads/`) that another user can write, or that is
not the daemon's own, stops `nnd serve` at start. Files and folders are
created with explicit modes whatever the umask (`serve` also sets umask 077).
"""

from __future__ import annotations

import os
import stat

# Subfolders: group-readable, so an admin group may read logs; never group-writable.
SUBDIRS = {"logs": 0o750, "uploads": 0o750}
STATE_MODE = 0o750


class StateDirError(RuntimeError):
    """A state directory `nnd serve` refuses to start with (one-line reason)."""


def prepare(state_dir: str) -> None:
    """Create the state directory and its subfolders, or refuse ones others can write."""
    path = os.path.abspath(state_dir)
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, STATE_MODE)
        except FileExistsError:
            pass
        os.chmod(path, STATE_MODE)
    _check_private(path, "the state directory", follow=True)
    for name, mode in SUBDIRS.items():
        sub = os.path.join(path, name)
        try:
            os.mkdir(sub, mode)
            os.chmod(sub, mode)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
        _check_private(sub, f"the state directory's {name}/", follow=False)


def _check_private(path: str, what: str, *, follow: bool) -> None:
    info = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise StateDirError(f"{what} {path} is a symbolic link; refusing to write through it")
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"{what} {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise StateDirError(f"{what} {path} belongs to uid {info.st_uid}, not to this daemon's user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateDirError(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}); chmod go-w it"
        )


def open_log(path: str) -> int:
    """A worker log opened for appending: created 0640, never through a link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o640)


LOCK_FILE = "serve.lock"


def lock(state_dir: str, address: str) -> int:
    """Hold the state directory for this process: an flock on `serve.lock`, which the kernel drops when
    the process ends however it ends (a killed daemon never blocks the next one). Another live daemon
    holding it stops this one, with its pid and socket, before this one reads or writes anything else."""
    import fcntl

    path = os.path.join(os.path.abspath(state_dir), LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").split()
        os.close(fd)
        pid, where = (holder + ["?", "?"])[:2]
        raise StateDirError(
            f"the state directory {state_dir} is in use by another nnd serve (pid {pid}, socket {where}); "
            "stop it or give this one another --state-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {address}\n".encode(), 0)
    return fd


# Rotated copies of a worker log kept beside it (NAME.log.1 is the newest).
KEEP_LOGS = 3


def rotate_log(path: str, max_bytes: int, keep: int = KEEP_LOGS) -> bool:
    """If `path` is over `max_bytes`, copy it to `path.1` (older copies move up, the oldest goes) and
    empty it in place: a worker writing to it (O_APPEND) carries on at the new end. Returns whether it
    rotated. Never follows a link."""
    if max_bytes <= 0:
        return False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
        return False
    for i in range(keep - 1, 0, -1):
        older = f"{path}.{i}"
        if os.path.lexists(older):
            os.replace(older, f"{path}.{i + 1}")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = os.open(f"{path}.1", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        try:
            while chunk := os.read(fd, 1 << 20):
                os.write(out, chunk)
        finally:
            os.close(out)
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    return True
