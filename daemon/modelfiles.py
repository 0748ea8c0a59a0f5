"""The files a local model is read from: vetted once per load, then handed to transformers pinned.

The daemon, its helper and its workers run as the daemon's user, which may read files the
caller may not. So a local folder is never handed to transformers as it is: `opened(folder,
policy)` walks the folder's whole file set first and refuses (PERMISSION_DENIED, naming the
file) anything that

- resolves outside the model's own folder (a symlink out of it; for a folder inside a Hugging
  Face cache, `…/models--org--name/snapshots/<rev>/`, the repository folder `…/models--org--name/`
  is its own, so `../../blobs/<sha>` links keep working);
- is not a regular file (a FIFO would hang the load, a device would be read);
- lies outside the administrator's `--model-root`s, when any are named;
- is not admitted by `--allow-model` (the list applies to each resolved file, not the folder);
- on a daemon others can reach without `--model-root`: is not readable by every user (the
  caller's uid is unknown to a gRPC server, so "the caller could read it" is honoured as
  "anyone could");
- names another file by path inside its JSON (a shard index's `weight_map`, a `*_file` entry):
  only plain names, which transformers looks up beside the JSON.

Each vetted file is then opened once (no link followed, the same inode as checked) and the
loader gets a private folder of links to those open descriptors (`/proc/<pid>/fd/<n>`): what
transformers opens is what was checked, even if the folder changes meanwhile, and nothing else
of the folder exists for it. Dotfiles (`.git`, `.cache`) are never read, so never staged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from nnd_daemon import errors

# The policy travels from `nnd serve` to the helper and the workers in the environment, which
# both inherit (a torchrun group's ranks included).
ENV = "NND_FILE_POLICY"
# A checkpoint is tens of files (a sharded one a few hundred); a folder past this is not one.
MAX_ENTRIES = 10_000
MAX_DEPTH = 8
# A plain file name, as an index or a tokenizer config may name one (helper/checks.py: uploads).
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# JSON larger than this is not read for references (config.json's own limit is the same).
MAX_JSON_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Policy:
    """What `nnd serve` allows local models to be read from."""

    roots: tuple[str, ...] = ()  # --model-root, real paths; empty: anywhere (with the rules below)
    allow: tuple[str, ...] = ()  # --allow-model entries, as given
    public: bool = False  # no --model-root and others can reach the daemon: files every user may read
    store: str = ""  # the daemon's upload store: files it wrote itself

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Policy:
        data = json.loads(text) if text else {}
        return cls(
            roots=tuple(data.get("roots", ())),
            allow=tuple(data.get("allow", ())),
            public=bool(data.get("public", False)),
            store=data.get("store", ""),
        )

    @classmethod
    def from_env(cls) -> Policy:
        return cls.from_json(os.environ.get(ENV, ""))


def home(folder: str) -> str:
    """The folder a model's files must resolve into: its own, or its Hugging Face repository folder."""
    parent = os.path.dirname(folder)
    if os.path.basename(parent) == "snapshots":
        repo = os.path.dirname(parent)
        if os.path.basename(repo).startswith(("models--", "datasets--", "spaces--")):
            return repo
    return folder


def inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def admits(pattern: str, path: str) -> bool:
    """Whether an --allow-model entry admits the resolved file `path` (a repo-id entry admits none)."""
    prefix = pattern.endswith("*")
    stem = pattern[:-1] if prefix else pattern
    if not (os.path.isabs(stem) or stem.startswith(".")):
        return False
    real = os.path.realpath(stem)
    if prefix:
        return path.startswith(real.rstrip(os.sep) + os.sep) if stem.endswith(os.sep) else path.startswith(real)
    return inside(path, home(real))


@dataclass
class _Entry:
    rel: str  # path inside the folder, as transformers will ask for it
    real: str
    st: os.stat_result


def vet(folder: str, policy: Policy) -> list[_Entry]:
    """The folder's files transformers may open, each checked; raises PermissionDenied naming the first bad one."""
    real_folder = os.path.realpath(folder)
    own = home(real_folder)
    in_store = bool(policy.store) and inside(real_folder, os.path.realpath(policy.store))
    files: list[_Entry] = []
    dirs: list[tuple[str, str, int]] = [("", real_folder, 0)]
    seen = 0
    while dirs:
        rel_dir, real_dir, depth = dirs.pop()
        try:
            with os.scandir(real_dir) as it:
                names = sorted(e.name for e in it)
        except OSError as exc:
            raise errors.PermissionDenied(f"{os.path.join(folder, rel_dir)} cannot be listed: {exc.strerror}") from None
        for name in names:
            if name.startswith("."):
                continue
            seen += 1
            if seen > MAX_ENTRIES:
                raise errors.PermissionDenied(
                    f"{folder} holds more than {MAX_ENTRIES} files: not a model folder nnd reads"
                )
            rel = os.path.join(rel_dir, name)
            shown = os.path.join(folder, rel)
            real = os.path.realpath(os.path.join(real_dir, name))
            if not inside(real, own):
                raise errors.PermissionDenied(
                    f"{shown} resolves to {real}, outside the model's folder {own}: links out of it are not followed"
                )
            try:
                st = os.stat(real)
            except OSError:
                continue  # a dangling link (an unfinished download): nothing to read, so not staged
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 > MAX_DEPTH:
                    raise errors.PermissionDenied(f"{shown} is nested more than {MAX_DEPTH} folders deep")
                dirs.append((rel, real, depth + 1))
                continue
            if not stat.S_ISREG(st.st_mode):
                raise errors.PermissionDenied(f"{shown} is not a regular file; a model folder holds only files")
            if not in_store:
                _check_file(shown, real, policy)
            files.append(_Entry(rel, real, st))
    _check_references(folder, files)
    return files


def _check_file(shown: str, real: str, policy: Policy) -> None:
    if policy.roots and not any(inside(real, r) for r in policy.roots):
        raise errors.PermissionDenied(
            f"{shown} ({real}) is outside this daemon's model roots ({', '.join(policy.roots)})"
        )
    if policy.allow and not any(admits(p, real) for p in policy.allow):
        raise errors.PermissionDenied(f"{shown} ({real}) is not in this daemon's allow-list")
    if policy.public and not policy.roots:
        try:
            why = _not_public(real)
        except OSError as exc:
            why = exc.strerror or "cannot be checked"
        if why:
            raise errors.PermissionDenied(
                f"{shown} is not readable by every user ({why}); this daemon serves several users and names no "
                "--model-root, so it reads only files any of them could read"
            )


def _not_public(path: str) -> str:
    if not os.stat(path).st_mode & stat.S_IROTH:
        return f"{path} is not world-readable"
    d = os.path.dirname(path)
    while True:
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return f"{d} is not searchable by others"
        if d == os.path.dirname(d):
            return ""
        d = os.path.dirname(d)


def _check_references(folder: str, files: list[_Entry]) -> None:
    """A shard index or a tokenizer config naming a path would make transformers open it, unchecked."""
    for entry in files:
        if not entry.rel.endswith(".json") or entry.st.st_size > MAX_JSON_BYTES:
            continue
        try:
            with open(entry.real, "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError, RecursionError):
            continue  # transformers reports unreadable JSON in its own words, when it reads it
        if not isinstance(data, dict):
            continue
        refs: list[object] = []
        if entry.rel.endswith(".index.json") and isinstance(data.get("weight_map"), dict):
            refs += data["weight_map"].values()
        refs += [v for k, v in data.items() if isinstance(k, str) and k.endswith(("_file", "_files"))]
        for ref in refs:
            for target in ref if isinstance(ref, list) else [ref]:
                if isinstance(target, str) and target and not PLAIN_NAME.fullmatch(target):
                    raise errors.PermissionDenied(
                        f"{os.path.join(folder, entry.rel)} names {target[:120]!r}: a model's JSON may name "
                        "only files beside it, by plain name"
                    )


@contextmanager
def opened(source: str, policy: Policy | None = None) -> Iterator[str]:
    """The path to hand transformers for `source`: for a local folder, a private folder of its
    vetted files, pinned open for the duration; a repo id (no such folder) unchanged."""
    if not os.path.isdir(source):
        if os.path.exists(source):
            raise errors.InvalidArgument(f"{source} is not a folder: a local model is a folder of files")
        yield source
        return
    policy = policy or Policy.from_env()
    entries = vet(source, policy)
    stage = tempfile.mkdtemp(prefix="nnd-model-")
    fds: list[int] = []
    try:
        for entry in entries:
            fds.append(_pin(source, entry))
            target = os.path.join(stage, entry.rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(f"/proc/{os.getpid()}/fd/{fds[-1]}", target)
        yield stage
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(stage, ignore_errors=True)


def _pin(source: str, entry: _Entry) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    shown = os.path.join(source, entry.rel)
    try:
        fd = os.open(entry.real, flags)
    except OSError as exc:
        raise errors.PermissionDenied(f"{shown} cannot be opened as checked: {exc.strerror}") from None
    st = os.fstat(fd)
    # Swapped since the walk (a link put in its place, a parent folder moved): refuse, read nothing.
    if (st.st_dev, st.st_ino) != (entry.st.st_dev, entry.st.st_ino) or os.readlink(f"/proc/self/fd/{fd}") != entry.real:
        os.close(fd)
        raise errors.PermissionDenied(f"{shown} changed while it was checked; load it again")
    return fd


def restore_names(source: str, *objs: object) -> None:
    """Put the caller's folder back where transformers recorded the staged one (`name_or_path`)."""
    for obj in objs:
        if obj is None:
            continue
        config = getattr(obj, "config", None)
        for target in (obj, config):
            if target is not None and hasattr(target, "_name_or_path"):
                target._name_or_path = source
        if hasattr(obj, "name_or_path") and not hasattr(type(obj), "name_or_path"):
            obj.name_or_path = source
        init = getattr(obj, "init_kwargs", None)
        if isinstance(init, dict) and "name_or_path" in init:
            init["name_or_path"] = source
