"""The model registry: every loaded model, its state, its worker.

States: META -> DISPATCHING -> DISPATCHED -> (release, keep-alive expiry,
worker death) -> META; unload forgets. All transitions happen under one lock;
slow work (building meta models, loading weights) happens outside it.

A worker that dies puts its model back to META with the reason (`last_error`,
the NOTE of `nnd ps`); the next dispatch without a placement of its own (the
next request's automatic one, or `nnd dispatch`) brings it back with the
placement it had. A worker the watchdog finds hung is killed and its model
re-dispatched at once, at most `restart_limit` times per `restart_window_s`.

Each worker has an epoch (a new one per start) and a public socket: the
model's route (`route`). Requests that go there directly are counted by the
worker; its Status answers (watchdog pings, `nnd ps`, the keep-alive reaper)
bring that activity here (`activity`).
"""

from __future__ import annotations

import grp
import itertools
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nnd.v1 import helper_pb2, nnd_pb2, worker_pb2
from nnd_daemon import errors, identity, loadoptions
from nnd_daemon.control import (
    budgets,
    events,
    forking,
    gpus,
    metamodel,
    modelroots,
    statedir,
    statefile,
    tplaunch,
    uploads,
)
from nnd_daemon.control.helper_supervisor import Helper, Lanes
from nnd_daemon.control.settings import Settings, parse_duration
from nnd_daemon.control.supervisor import Launcher, WorkerFactory, WorkerHandle, WorkerOrder, log_name

log = logging.getLogger("nnd.registry")

META, DISPATCHING, DISPATCHED = nnd_pb2.META, nnd_pb2.DISPATCHING, nnd_pb2.DISPATCHED


@dataclass
class Redispatch:
    """A model back in META because its worker died: the placement it had, and why."""

    placement: nnd_pb2.Placement | None
    reason: str


@dataclass
class Entry:
    name: str
    meta: metamodel.MetaModel
    placement: nnd_pb2.Placement
    trust_remote_code: bool = False
    keep_alive: str = ""
    state: int = META
    worker: WorkerHandle | None = None
    dispatched_placement: nnd_pb2.Placement | None = None
    dtype: str = ""
    last_used: float = 0.0
    last_error: str = ""
    active: int = 0
    # Trace requests waiting for or running on the worker (the queue).
    queued: int = 0
    # The stored upload (its SHA-256) the model was loaded from; "" for a repo id or a path.
    upload: str = ""
    # Set when its worker died while dispatched: the next dispatch without a placement of its own uses it.
    redispatch: Redispatch | None = None
    # The last worker that died: its epoch and why, for a client whose route it was (`route`).
    lost_epoch: int = 0
    lost_reason: str = ""
    # When the watchdog re-dispatched it after a hang (for --restart-limit).
    restarts: list[float] = field(default_factory=list)
    # Unloaded: no dispatch may start a worker for it any more (one would be an orphan nobody lists or reaps).
    gone: bool = False
    # Who loaded it and who dispatched its worker, when (identity.py's user names; "": the daemon itself).
    loaded_by: str = ""
    dispatched_by: str = ""
    dispatched_at: float = 0.0
    # Loaded under a short name of its own (LoadModelRequest.name, `nnd load PATH --name NAME`).
    short: bool = False


# Placement fields a handle may leave to whoever loaded the model first ("auto" is no choice either).
_OPEN = ("", "auto")


# Placement fields whose choice changes the numbers a model computes: an open one is the checkpoint's own.
_NUMERIC = ("dtype", "compute_dtype")


def _agrees(entry: Entry, req: nnd_pb2.LoadModelRequest) -> bool:
    """Whether `entry` is the model `req` asks for: the same load options and revision (they change
    the model), and every placement field `req` sets equal to the entry's. A field `req` leaves open
    takes what is loaded. An open dtype of the entry is the checkpoint's (the weights' once dispatched);
    other open fields of a model not yet dispatched take the handle's choice (`_agreeing` merges it)."""
    if entry.meta.ref.options != req.options or entry.meta.revision != req.revision:
        return False
    dispatched = entry.state != META and entry.dispatched_placement is not None
    have = entry.dispatched_placement if dispatched else entry.placement
    for fd, wanted in req.placement.ListFields():
        if fd.name == "max_memory":
            if dict(have.max_memory) and dict(have.max_memory) != dict(wanted):
                return False
            continue
        if wanted in _OPEN:
            continue
        current = getattr(have, fd.name)
        if fd.name == "dtype" and current in _OPEN:
            current = entry.dtype if dispatched and entry.dtype else entry.meta.description.default_dtype
        if current in _OPEN or current == 0:
            if fd.name in _NUMERIC:
                return False
            if fd.name == "tp_size" and dispatched and wanted > 1:
                return False  # a worker without tensor parallel runs already: not what was asked for
            continue
        if current != wanted:
            return False
    return True


def variant_tag(req: nnd_pb2.LoadModelRequest) -> str:
    """What a second entry of one checkpoint is named after: the choices of its load ("dtype=bfloat16",
    "attn_implementation=eager", "config=<hash>"), or "default" for none."""
    import hashlib

    parts = []
    for fd, value in req.placement.ListFields():
        text = ";".join(f"{k}:{v}" for k, v in sorted(value.items())) if fd.name == "max_memory" else str(value)
        parts.append(f"{fd.name}={text}")
    if req.options.attn_implementation:
        parts.append(f"attn_implementation={req.options.attn_implementation}")
    if req.options.config_json:
        parts.append("config=" + hashlib.sha256(req.options.config_json.encode()).hexdigest()[:8])
    if req.revision:
        parts.append(f"revision={req.revision}")
    return ",".join(parts) or "default"


def _merge(base: nnd_pb2.Placement, override: nnd_pb2.Placement | None) -> nnd_pb2.Placement:
    out = nnd_pb2.Placement()
    out.CopyFrom(base)
    if override is not None:
        for fd, value in override.ListFields():
            if fd.name == "max_memory":
                out.max_memory.clear()
                out.max_memory.update(value)
            else:
                setattr(out, fd.name, value)
    return out


@dataclass(frozen=True)
class Processes:
    """What the daemon's workers and its helper are started as: processes (the default). The
    in-process engine for tests (nnd_daemon/inprocess.py) passes subclasses that serve the same
    gRPC services from threads of the daemon's own process instead."""

    launcher: type[Launcher] = Launcher
    helper: type[Helper] = Helper
    # Whether workers and the helper fork from a fork server (control/forking.py) when settings allow.
    forks: bool = True


class Registry:
    """The models and their workers.

    What it starts and asks can be swapped (as Ollama's scheduler takes its server and GPU
    functions), so lifecycle tests run in-process without a worker process, a GPU or a wall
    clock (tests/control/): `start_worker` starts a model's worker (default: a process,
    supervisor.Launcher), `gpu_query` counts GPUs and reads their free memory (default: gpus.py),
    `clock` is the time keep-alive and LRU reckon with, `helper` builds META models (default: the
    helper process), and `reap_every_s` is how often keep-alive is checked in the background
    (0: never; `reap` runs one check)."""

    def __init__(
        self,
        settings: Settings,
        token: str | None = None,
        *,
        start_worker: WorkerFactory | None = None,
        gpu_query: gpus.GpuQuery = gpus,
        clock: Callable[[], float] = time.time,
        helper: Lanes | Helper | None = None,
        reap_every_s: float = 0.5,
        processes: Processes | None = None,
    ) -> None:
        processes = processes or Processes()
        self.settings = settings
        # Over TCP a caller is known by the token it sent (identity.who).
        self.token_required = token is not None
        self.gpus = gpu_query
        self._clock = clock
        # Epochs differ across daemon restarts too, so a stale route can never match a new worker.
        self._epochs = itertools.count(int(clock() * 1000))
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, Entry] = {}
        self._loading: dict[str, threading.Event] = {}
        # Worker sockets live in a private short directory: unix socket paths
        # are limited to ~107 bytes, and state directories can be deep.
        # The run dir holds the workers' public sockets (routes): like the daemon's socket, for its
        # group (0750, setgid so sockets inherit the group); their private sockets are in a 0700 subdir.
        self.run_dir = tempfile.mkdtemp(prefix="nnd-", dir=os.environ.get("RUNTIME_DIRECTORY") or None)
        if settings.socket_group:
            os.chown(self.run_dir, -1, grp.getgrnam(settings.socket_group).gr_gid)
            os.chmod(self.run_dir, 0o2750)
        else:
            os.chmod(self.run_dir, 0o750)
        self.private_dir = os.path.join(self.run_dir, "private")
        os.mkdir(self.private_dir, 0o700)
        self.log_dir = os.path.join(settings.state_dir, "logs")
        os.makedirs(self.log_dir, mode=0o750, exist_ok=True)
        # What the metrics count as it happens (control/events.py), and the users' tickets (identity.py).
        self.events = events.Events()
        self.tickets = identity.Tickets()
        # Started with the helper (`restore`); nothing forks from it when every process is a fake.
        uses_processes = processes.forks and (start_worker is None or helper is None)
        self.forks = (
            forking.ForkServer(self.private_dir, self.log_dir, start_timeout_s=settings.worker_start_timeout_s)
            if uses_processes and settings.worker_start == "fork"
            else None
        )
        # Meta builds, scans, tokenizing, edit and upload checks: never in this process (control/helper_supervisor.py).
        if helper is None:
            helper = Lanes(
                self.run_dir,
                self.log_dir,
                helper_class=processes.helper,
                memory_bytes=settings.helper_memory_bytes,
                cpu_s=settings.helper_cpu_s,
                start_timeout_s=settings.worker_start_timeout_s,
                call_timeout_s=settings.limits.default_deadline_s,
                forks=self.forks,
            )
            for lane in (helper.heavy, helper.light):  # each lane's own calls (describe, ...) count too
                events.count_helper_calls(lane, self.events)
        self.helper = helper
        # Uploaded models' files (control/uploads.py), checked in the helper process.
        self.uploads = uploads.UploadStore(settings, check=self.helper.check_upload)
        lim = settings.limits
        self._start_worker: WorkerFactory = start_worker or processes.launcher(
            run_dir=self.private_dir,
            log_dir=self.log_dir,
            public_dir=self.run_dir,
            start_timeout_s=settings.worker_start_timeout_s,
            limits=lim.to_proto(),
            queue_share=settings.users.max_queue_share,
            request_idle_timeout_s=settings.request_idle_timeout_s,
            max_waiting_calls=settings.max_waiting_calls,
            batch_window_ms=settings.batch_window_ms,
            token=token,  # workers ask clients for the daemon's token too
            identity_key=self.tickets.key.hex(),
            log_requests=settings.log_requests,
            log_format=settings.log_format,
            log_bytes=settings.worker_log_bytes,
            forks=self.forks,
        )
        self._stop = threading.Event()
        if reap_every_s > 0:
            threading.Thread(target=self._reap_every, args=(reap_every_s,), name="keep-alive", daemon=True).start()

    # -- lookup -------------------------------------------------------------
    def get(self, name: str) -> Entry:
        with self._lock:
            entry = self._entries.get(name) or self._entries.get(self._alias(name))
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "none loaded"
            raise errors.NotFound(f"model {name!r} is not loaded (loaded: {known}); load it with `nnd load {name}`")
        return entry

    def _alias(self, name: str) -> str:
        # A local path may be given relative, absolute or through a link: models are keyed by real path.
        return local_key(name)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    # -- load / unload ------------------------------------------------------
    def load(self, req: nnd_pb2.LoadModelRequest, user: str = "") -> Entry:
        name = req.model.strip()
        if not name:
            raise errors.InvalidArgument("LoadModel needs a model: a repo id or a local directory")
        check_name(name)
        short = self._named(name, req)
        if short is not None:  # `model = "llama"`, a name some `nnd load ... --name llama` gave
            return short
        if req.name:
            check_short_name(req.name)
        if not req.upload:  # an upload (control/uploads.py) is gated by --no-uploads, not the allow-list
            # One folder is one model, however it is reached (a link, a relative path, /proc/self/root/...).
            name = local_key(name)
            self._check_allowed(name, req.trust_remote_code)
            _check_local_path(name)
        if req.keep_alive:
            _keep_alive_seconds(req.keep_alive)
        loadoptions.check(req.options)
        loadoptions.check_placement(req.placement)
        source = name
        while True:
            with self._lock:
                if req.upload:  # a model sent as data is loaded once, under the name it was sent with
                    if name in self._entries:
                        return self._entries[name]
                else:
                    held = self._entries.get(name)
                    if held is not None and held.upload:  # a model sent as data answers to its name
                        return held
                    if req.name:  # an entry of its own under the name asked for, or that one again
                        named = self._entries.get(req.name)
                        if named is not None:
                            if named.meta.source == source and _agrees(named, req):
                                return named
                            raise errors.AlreadyExists(
                                f"the name {req.name!r} is taken by {named.meta.source} "
                                f"({_describe(named.placement)}); unload it first or choose another name"
                            )
                        name = req.name
                    else:
                        # One checkpoint may be loaded several ways: a handle gets the entry whose placement
                        # and load options agree with its own, else an entry of its own (variant_tag).
                        found = self._agreeing(source, req)
                        if found is not None:
                            return found
                        name = self._free_variant(source, req)
                pending = self._loading.get(name)
                if pending is None:
                    self._loading[name] = threading.Event()
                    break
            pending.wait()
        began = time.monotonic()
        try:
            if req.upload:
                meta = self.uploads.build_meta(req, lambda ref: metamodel.describe(self.helper, ref))
            else:
                ref = helper_pb2.HelperModel(
                    key=name,
                    source=source,
                    revision=req.revision,
                    task=req.task,
                    trust_remote_code=req.trust_remote_code,
                    options=req.options,
                )
                meta = metamodel.describe(self.helper, ref)
            entry = Entry(
                name=name,
                meta=meta,
                placement=_merge(nnd_pb2.Placement(), req.placement),
                trust_remote_code=req.trust_remote_code,
                keep_alive=req.keep_alive,
                upload=req.upload,  # the registry file records it (statefile.py)
                loaded_by=user,
                short=bool(req.name),
            )
            with self._lock:
                self._entries[name] = entry
            self.save()
            log.info(
                "loaded %s (%s, %s) for %s in %.2f s", name, meta.architecture or "?", meta.task or "?", _who(user),
                time.monotonic() - began,
                extra=_fields("load", name, user, duration_s=time.monotonic() - began),
            )
            return entry
        finally:
            with self._lock:
                self._loading.pop(name).set()

    def _named(self, name: str, req: nnd_pb2.LoadModelRequest) -> Entry | None:
        """The entry loaded under the short name `name`, if one is; refused when `req` asks for
        something else of it (another placement or options, or a name of its own)."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is None or not entry.short:
            return None
        if req.name and req.name != name:
            raise errors.InvalidArgument(
                f"{name!r} is already a short name (of {entry.meta.source}); give the checkpoint's path or repo id "
                f"to load it under another name"
            )
        if not _agrees(entry, req):
            raise errors.FailedPrecondition(
                f"{name} is {entry.meta.source} loaded with {_describe(entry.dispatched_placement or entry.placement)}; "
                f"this handle asks for {_describe(req.placement)}. Either use it as it is (no placement of your own), "
                f"or load the checkpoint with a placement of its own (its path, or `nnd load {entry.meta.source} "
                "--name OTHER` with your placement)"
            )
        with self._lock:
            if entry.state == META:
                entry.placement = _merge(entry.placement, req.placement)
        return entry

    def _agreeing(self, source: str, req: nnd_pb2.LoadModelRequest) -> Entry | None:
        """The loaded entry of checkpoint `source` that serves what `req` asks (under the lock).
        A placement field the entry leaves open, on a model not yet dispatched, is taken from `req`."""
        for entry in self._entries.values():
            if entry.upload or entry.meta.source != source:
                continue
            if _agrees(entry, req):
                if entry.state == META:
                    merged = _merge(entry.placement, req.placement)
                    if merged.tp_size > 1 and not self._placement_ok(entry, merged):
                        # (tp_size=2 on a model another handle loaded as nf4): taking this handle's
                        # choice would break the model for both; this handle gets an entry of its own.
                        continue
                    entry.placement = merged
                return entry
        return None

    def _placement_ok(self, entry: Entry, placement: nnd_pb2.Placement) -> bool:
        try:
            self._check_placement(entry, placement)
        except errors.NndError:
            return False
        return True

    def _free_variant(self, source: str, req: nnd_pb2.LoadModelRequest) -> str:
        """The name a new entry of `source` loaded as `req` asks gets: the checkpoint's own name first.
        A name being loaded by another call is returned as it is: load() waits for it, then asks again
        whether it agrees (two handles loading one model at once share it)."""
        if source not in self._entries:
            return source
        base = f"{source}@{variant_tag(req)}"
        name, n = base, 1
        while name in self._entries and not _agrees(self._entries[name], req):
            n += 1
            name = f"{base}#{n}"
        return name

    def _check_allowed(self, name: str, trust_remote_code: bool) -> None:
        if trust_remote_code and not self.settings.allow_remote_code:
            raise errors.PermissionDenied(
                "trust_remote_code is refused: this daemon runs no model code from repositories "
                "(start it with --allow-remote-code to change that)"
            )
        allow = self.settings.allow_models
        if allow and not any(_allows(a, name) for a in allow):
            raise errors.PermissionDenied(f"model {name!r} is not in this daemon's allow-list")
        modelroots.check_folder(self.settings, name)

    def unload(self, name: str, *, user: str | None = None, force: bool = False) -> None:
        """Forget the model (ending its worker). `user`: who asked (None: the daemon itself); a user
        other than its dispatcher, or any while requests run, needs `force`."""
        entry = self.get(name)
        if user is not None:
            self._may_release(entry, user, force, "unload")
        with self._lock:
            # Gone first: a request waiting on this model's dispatch must not start a worker for it.
            entry.gone = True
            self._entries.pop(entry.name, None)
            self._changed.notify_all()
        self.release_entry(entry, user=user, why="unload")
        self.save()
        log.info("unloaded %s for %s", entry.name, _who(user), extra=_fields("unload", entry.name, user))
        if entry.upload and not any(e.upload == entry.upload for e in self.entries()):
            self.uploads.forget(entry.upload)  # its files, once no loaded model uses them

    def upload_of(self, name: str) -> str | None:
        """The upload the model loaded as `name` came from ("" for none); None if no model is."""
        with self._lock:
            entry = self._entries.get(name)
        return None if entry is None else entry.upload

    # -- dispatch / release -------------------------------------------------
    def dispatch(
        self, name: str, override: nnd_pb2.Placement | None = None, keep_alive: str = "", user: str | None = ""
    ) -> Iterator[Any]:
        """Start the model's worker for `user` (None: the daemon itself, restoring its registry);
        yields DispatchProgress. Waits if another caller is already dispatching it."""
        entry = self.get(name)
        if keep_alive:
            _keep_alive_seconds(keep_alive)
            entry.keep_alive = keep_alive
        # After a worker death: the placement it had, and why it is back.
        again = None
        if override is None:
            again, entry.redispatch = entry.redispatch, None
        if again is not None:
            override = again.placement
        placement = _merge(entry.placement, override)
        # Before the checks on the merged placement: they would blame fields of the placement it is
        # dispatched with (a dtype another handle chose) for what this caller asked.
        self._check_conflict(entry, override, placement, user)
        self._check_combined(entry, override, placement)
        with self._lock:
            while entry.state == DISPATCHING:
                self._changed.wait()
            _check_present(entry)
            if entry.state == DISPATCHED:
                if override is None or placement == entry.dispatched_placement:
                    entry.last_used = self._clock()
                    return
                self._check_conflict(entry, override, placement, user)
            # Every check a new placement can fail comes before the working dispatch is released:
            # a refused placement leaves the model as other clients are using it.
            budgets.check_fits_max_memory(entry, placement)
            budgets.check_budget(entry, placement, self._entries.values(), self.settings.max_memory, self.gpus)
            budgets.check_user(entry, placement, user or "", self._entries.values(), self.settings.users)
            if entry.state == DISPATCHED:
                self._release_locked(entry)  # a new placement: start over
            self._make_room(entry)
            entry.state = DISPATCHING
            began = time.monotonic()
            when = time.strftime("%H:%M:%S", time.localtime(self._clock()))
            entry.last_error = f"re-dispatched {when} after: {again.reason}" if again else ""
        worker: WorkerHandle | None = None
        try:
            yield nnd_pb2.DispatchProgress(stage="starting", message="starting worker process")
            worker = self._start_worker(WorkerOrder(entry.name, placement, next(self._epochs), self._worker_exited))
            entry.worker = worker
            # Before any request can reach it: what it needs to complete requests itself.
            worker.configure(self.worker_config(entry))
            load = worker_pb2.WorkerLoadRequest(
                model=entry.meta.source,
                revision=entry.meta.revision,
                placement=placement,
                trust_remote_code=entry.trust_remote_code,
                task=entry.meta.task,
                options=entry.meta.ref.options,
            )
            for progress in worker.load(load):
                if progress.stage != "ready":
                    yield progress
            status = worker.status()
            s = self.settings
            worker.watch(s.watchdog_interval_s, s.watchdog_timeout_s, s.watchdog_misses)
        except BaseException as exc:
            if worker is not None:  # (a worker that failed to start left nothing running)
                worker.stop()
            with self._lock:
                entry.worker = None
                entry.state = META
                entry.last_error = str(exc)
                self._changed.notify_all()
            self.events.count(self.events.dispatches, entry.name, "failed")
            log.warning(
                "dispatch of %s (%s) for %s failed after %.2f s: %s", entry.name, _describe(placement), _who(user),
                time.monotonic() - began, str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                extra=_fields("dispatch_failed", entry.name, user, duration_s=time.monotonic() - began),
            )
            raise
        with self._lock:
            orphan = entry.gone  # unloaded while its weights loaded: nobody would list or reap this worker
            if orphan:
                entry.worker = None
                entry.state = META
            else:
                entry.state = DISPATCHED
                entry.dispatched_placement = placement
                entry.dtype = status.dtype if status else ""
                entry.last_used = self._clock()
                entry.dispatched_by, entry.dispatched_at = user or "", time.time()
            self._changed.notify_all()
        if orphan:
            worker.stop()
            _check_present(entry)
        self.save()
        self.events.count(self.events.dispatches, entry.name, "ok")
        took = time.monotonic() - began
        log.info(
            "dispatched %s on %s (%s, worker pid %s) for %s in %.2f s", entry.name, _describe(placement),
            entry.dtype or "default dtype", ",".join(map(str, worker.pids)) or "-", _who(user), took,
            extra=_fields("dispatch", entry.name, user, duration_s=took, placement=_describe(placement)),
        )

    def _check_placement(self, entry: Entry, placement: nnd_pb2.Placement) -> None:
        """The refusals a placement meets before any process starts (fields, tensor parallel, GPUs)."""
        loadoptions.check_placement(placement)
        # Refuse a tensor-parallel degree this model or machine cannot run, before any process starts.
        tplaunch.check(entry.meta.config, placement, self.gpus.count())
        budgets.check_gpus_visible(placement, self.gpus.count())

    def _check_combined(self, entry: Entry, override: nnd_pb2.Placement | None, placement: nnd_pb2.Placement) -> None:
        """Check the placement a dispatch would use. When what the caller asked for is fine by itself
        and fails only together with what the model already has (`--tp 2` on a model another handle
        loaded or dispatched as nf4), the refusal says so: what is there, chosen by whom, and the
        caller's choices, instead of blaming a field the caller never gave."""
        try:
            self._check_placement(entry, placement)
        except errors.NndError as exc:
            if override is None or not override.ListFields():
                raise
            try:
                self._check_placement(entry, _merge(nnd_pb2.Placement(), override))
            except errors.NndError:
                raise exc from None  # the caller's own choice is refused as it is
            raise errors.FailedPrecondition(self._combined_refusal(entry, override, str(exc))) from None

    def _combined_refusal(self, entry: Entry, override: nnd_pb2.Placement, why: str) -> str:
        asked = {fd.name for fd, _ in override.ListFields()}
        dispatched = entry.state == DISPATCHED and entry.dispatched_placement is not None
        have = entry.dispatched_placement if dispatched else entry.placement
        kept = nnd_pb2.Placement()
        for fd, value in have.ListFields():
            if fd.name not in asked:
                kept.MergeFrom(nnd_pb2.Placement(**{fd.name: value}))
        if dispatched:
            where = f"is dispatched with {_describe(kept)} by {_who(entry.dispatched_by or None)} at {_when(entry.dispatched_at)}"
        else:
            where = f"was loaded with {_describe(kept)} by {_who(entry.loaded_by or None)} (every dispatch of it uses that)"
        source = entry.meta.source or entry.name
        return (
            f"{entry.name} {where}; this call asks for {_describe(override)}, which cannot be combined with it "
            f"({why}). Either use it as it is (no placement of your own), release it first "
            f"(`nnd release {entry.name}`, then dispatch it with the placement you want), or load the checkpoint "
            f"under another name with a placement of its own (`nnd load {source} --name NAME` with your placement; "
            "in Python, a handle whose placement differs in a field it sets)"
        )

    def _check_conflict(
        self, entry: Entry, override: nnd_pb2.Placement | None, placement: nnd_pb2.Placement, user: str | None
    ) -> None:
        """Refuse a new placement for a model another user dispatched, or one with requests on it: say what
        is dispatched, by whom, and the caller's choices (a re-dispatch would end their work)."""
        dispatched = entry.dispatched_placement
        if override is None or user is None or entry.state != DISPATCHED or dispatched is None:
            return
        if placement == dispatched:
            return
        owner = entry.dispatched_by
        others = bool(owner) and owner != user
        if not (others or entry.active):
            return  # the caller's own idle model: dispatched again with the new placement
        by = f"by {owner} at {_when(entry.dispatched_at)}" if owner else "by the daemon"
        busy = f", and {entry.active} request(s) run or wait on it" if entry.active else ""
        raise errors.FailedPrecondition(
            f"{entry.name} is already dispatched with {_describe(dispatched)} ({entry.dtype or 'default dtype'}) "
            f"{by}{busy}; this call asks for {_describe(override)}. Either use it as it is (no placement of your "
            f"own), release it first (`nnd release {entry.name}`"
            + (", with --force as it is not yours" if others else "")
            + f"), or load the checkpoint under another name with a placement of its own (`nnd load "
            f"{entry.meta.source or entry.name} --name NAME` with your placement, or a copy in another folder)"
        )

    def _make_room(self, entry: Entry) -> None:
        cap = self.settings.limits.max_dispatched_models
        live = [e for e in self._entries.values() if e is not entry and e.state in (DISPATCHED, DISPATCHING)]
        if not cap or len(live) < cap:
            return
        idle = sorted(
            (e for e in live if e.state == DISPATCHED and not self.busy(e, self.activity(e, ask=False))),
            key=lambda e: e.last_used,
        )
        if not idle:
            raise errors.ResourceExhausted(
                f"{len(live)} models are dispatched (the cap is {cap}) and none is idle; try again later"
            )
        victim = idle[0]
        log.info(
            "releasing %s (least recently used, dispatched by %s) to make room for %s", victim.name,
            _who(victim.dispatched_by), entry.name, extra=_fields("lru_eviction", victim.name, victim.dispatched_by),
        )
        self._release_locked(victim, reason=f"released to make room for {entry.name} (cap {cap})", why="lru")

    def release(self, name: str, reason: str = "", *, user: str | None = None, force: bool = False) -> Entry:
        """End the model's worker. `user`: who asked (None: the daemon itself, e.g. keep-alive); a
        user other than its dispatcher, or any while requests run, needs `force`."""
        entry = self.get(name)
        if user is not None:
            self._may_release(entry, user, force, "release")
        return self.release_entry(entry, reason, user=user, why="keep_alive" if user is None else "request")

    def _may_release(self, entry: Entry, user: str, force: bool, what: str) -> None:
        """Refuse to end another user's model, or one with requests running, unless forced; log a forced one."""
        status = self.activity(entry, ask=True) if entry.worker is not None else None
        inflight = list(status.requests) if status is not None else []
        busy = self.busy(entry, status)
        owner = entry.dispatched_by if entry.worker is not None else ""
        others = bool(owner) and owner != user
        if not (busy or others):
            return
        users = sorted({r.user or r.client for r in inflight})
        running = f"{len(inflight) or entry.active} request(s) run or wait on it" + (
            f" (from {', '.join(users)})" if users else ""
        )
        why = "; ".join(
            ([f"it was dispatched by {owner} at {_when(entry.dispatched_at)}"] if others else [])
            + ([running] if busy else [])
        )
        if not force:
            raise errors.FailedPrecondition(
                f"not {what}ing {entry.name}: {why}; `nnd {what} --force {entry.name}` does it anyway "
                "(those requests then fail, saying who ended them)"
            )
        log.warning(
            "%s of %s forced by %s: %s", what, entry.name, _who(user), why,
            extra=_fields(f"forced_{what}", entry.name, user, owner=owner, requests=len(inflight)),
        )

    def release_entry(self, entry: Entry, reason: str = "", *, user: str | None = None, why: str = "request") -> Entry:
        current = entry.worker
        if current is not None:
            current.status()  # its latest counts, for the metrics' totals (events.retire)
        with self._lock:
            while entry.state == DISPATCHING:
                self._changed.wait()
            had = entry.worker is not None
            if had and user is not None:
                # What a client whose request dies with this worker is told (route(failed_epoch), forward.py).
                entry.lost_epoch = entry.worker.epoch
                entry.lost_reason = (
                    f"was released by {_who(user)} at {_when(time.time())}"
                    + (" (`nnd unload`)" if why == "unload" else " (`nnd release`)")
                )
            self._release_locked(entry, reason, why=why)
        self.save()
        if had:
            log.info(
                "released %s for %s (dispatched by %s)", entry.name, _who(user), _who(entry.dispatched_by),
                extra=_fields("release", entry.name, user, owner=entry.dispatched_by),
            )
        return entry

    def _release_locked(self, entry: Entry, reason: str = "", why: str = "request") -> None:
        worker, entry.worker = entry.worker, None
        if worker is not None:
            self.events.retire(entry.name, worker.last_status)
            self.events.count(self.events.releases, entry.name, why)
        entry.state = META
        entry.dispatched_placement = None
        entry.dtype = ""
        if reason:
            entry.last_error = reason
        entry.redispatch = None
        self._changed.notify_all()
        if worker is not None:
            worker.stop()

    def _worker_exited(self, worker: WorkerHandle, reason: str) -> None:
        """A worker ended without being asked (crash, kill, or killed by the watchdog as hung)."""
        hung: Entry | None = None
        with self._lock:
            for entry in self._entries.values():
                if entry.worker is worker:
                    entry.worker = None
                    self.events.retire(entry.name, worker.last_status)
                    self.events.count(self.events.worker_deaths, entry.name)
                    log.warning(
                        "worker of %s (pid %s, dispatched by %s) ended: %s", entry.name,
                        ",".join(map(str, worker.pids)) or "?", _who(entry.dispatched_by), reason,
                        extra=_fields("worker_death", entry.name, entry.dispatched_by, reason=reason),
                    )
                    entry.lost_epoch, entry.lost_reason = worker.epoch, reason
                    entry.last_error = f"worker {reason}" if worker.fault else f"worker died: {reason}"
                    if entry.state == DISPATCHED:
                        entry.state = META
                        entry.redispatch = Redispatch(entry.dispatched_placement, entry.last_error)
                        entry.dispatched_placement = None
                        entry.dtype = ""
                        if worker.fault and self._may_restart(entry):
                            hung = entry
                    self._changed.notify_all()
        self.save()
        if hung is not None:
            self._replace(hung)

    def _may_restart(self, entry: Entry) -> bool:
        """Whether a hung model may be re-dispatched now (under --restart-limit); if not, say so."""
        now = self._clock()
        window, limit = self.settings.restart_window_s, self.settings.restart_limit
        recent = [t for t in entry.restarts if now - t < window]
        if len(recent) >= limit:
            entry.last_error += (
                f"; not re-dispatched: {len(recent)} restart(s) in the last {window / 60:g} min"
                if limit
                else "; not re-dispatched (--restart-limit 0)"
            ) + "; a request or `nnd dispatch` brings it back"
            return False
        entry.restarts = [*recent, now]
        return True

    def _replace(self, entry: Entry) -> None:
        """Re-dispatch a model whose worker hung, in the background."""

        def redispatch() -> None:
            with self._lock:
                if entry.state != META or entry.redispatch is None:
                    return  # released, or dispatched by a request meanwhile
            log.warning(
                "re-dispatching %s (%s)", entry.name, entry.last_error,
                extra=_fields("worker_restart", entry.name, entry.dispatched_by),
            )
            self.events.count(self.events.worker_restarts, entry.name)
            try:
                for _ in self.dispatch(entry.name, user=entry.dispatched_by):
                    pass
            except Exception as exc:  # noqa: BLE001 - recorded as the model's last_error by dispatch
                log.error("could not re-dispatch %s: %s", entry.name, exc)

        threading.Thread(target=redispatch, name=f"redispatch-{entry.name}", daemon=True).start()

    # -- routes and what workers need ---------------------------------------
    def worker_config(self, entry: Entry) -> worker_pb2.WorkerConfig:
        """Everything a worker completes requests with: the aliases and every stored edit."""
        config = self.alias_config(entry)
        config.replace_edits = True
        for edit in entry.meta.edits.all():
            config.edits[edit.id].CopyFrom(edit.stack())
        return config

    def alias_config(self, entry: Entry) -> worker_pb2.WorkerConfig:
        config = worker_pb2.WorkerConfig(set_aliases=True)
        table = entry.meta.aliases
        for host, names in (table.hosts if table is not None else {}).items():
            for alias, target in names.items():
                config.aliases.add(host=host, alias=alias, target=target)
        return config

    def configure(self, entry: Entry, config: worker_pb2.WorkerConfig) -> None:
        """Push a change (edits, aliases) to the model's worker, if it has one."""
        worker = entry.worker
        if worker is not None:
            worker.configure(config)

    def route(self, name: str, failed_epoch: int = 0) -> nnd_pb2.Route:
        """Where the model's data requests go; with `failed_epoch`, why that worker ended."""
        entry = self.get(name)
        worker = entry.worker
        out = nnd_pb2.Route()
        if failed_epoch and worker is not None and worker.epoch == failed_epoch:
            # The client lost its call: give a dying worker a moment to be seen dead, and say why.
            out.lost = worker.wait_exit(2.0)
            if out.lost:
                return out
        elif failed_epoch:
            out.lost = entry.lost_reason if entry.lost_epoch == failed_epoch else ""
        with self._lock:
            worker = entry.worker
            if entry.state == DISPATCHED and worker is not None and worker.public:
                out.MergeFrom(_route_of(worker))  # `lost` (an earlier epoch's) stays
        return out

    def activity(self, entry: Entry, *, ask: bool) -> worker_pb2.WorkerStatus | None:
        """The worker's Status (what it counted, requests sent to it directly included), asked now
        or as its last answer (a watchdog ping) left it; taken into the entry (last use, keep-alive)
        before it is returned. The one place the registry reads a worker's activity."""
        worker = entry.worker
        if worker is None:
            return None
        status = worker.status() if ask else worker.last_status
        if status is None or not (status.accepted or status.active):
            return status
        now = self._clock()
        with self._lock:
            used = now if status.active else status.idle_since
            if used > entry.last_used:
                entry.last_used = used
            if status.keep_alive and status.keep_alive != entry.keep_alive:
                try:
                    _keep_alive_seconds(status.keep_alive)
                    entry.keep_alive = status.keep_alive
                except errors.NndError:
                    pass  # not a duration: the worker ran the request; keep the old keep-alive
        return status

    @staticmethod
    def busy(entry: Entry, status: worker_pb2.WorkerStatus | None) -> bool:
        """Requests in flight, through the daemon or (by the worker's `status`) directly."""
        return entry.active > 0 or bool(status is not None and status.active)

    # -- requests -----------------------------------------------------------
    def acquire(self, name: str, *, auto_dispatch: bool, keep_alive: str = "", user: str = "") -> Entry:
        """The entry, dispatched (dispatching it first if allowed), counted as busy."""
        entry = self.get(name)
        if keep_alive:
            _keep_alive_seconds(keep_alive)
            entry.keep_alive = keep_alive
        if entry.state != DISPATCHED:
            if not auto_dispatch:
                raise errors.FailedPrecondition(
                    f"model {entry.name} is not dispatched; dispatch it first (`nnd dispatch {entry.name}`)"
                )
            for _ in self.dispatch(entry.name, user=user):
                pass
        with self._lock:
            depth = self.settings.limits.max_queue_depth
            if depth and entry.queued >= depth:
                raise errors.ResourceExhausted(f"the queue of {entry.name} is full (max_queue_depth={depth})")
            _check_present(entry)
            if entry.state != DISPATCHED or entry.worker is None:
                raise errors.Unavailable(f"model {entry.name} lost its worker: {entry.last_error or 'released'}")
            entry.active += 1
            entry.queued += 1
            entry.last_used = self._clock()
        return entry

    def done(self, entry: Entry) -> None:
        with self._lock:
            entry.active -= 1
            entry.queued -= 1
            entry.last_used = self._clock()
            expire_now = entry.active == 0 and self.keep_alive_s(entry) == 0
        if expire_now:
            self.release(entry.name)

    def keep_alive_s(self, entry: Entry) -> float | None:
        return _keep_alive_seconds(entry.keep_alive or self.settings.keep_alive)

    def expires_at(self, entry: Entry) -> float:
        ka = self.keep_alive_s(entry)
        if entry.state != DISPATCHED or ka is None:
            return 0.0
        return entry.last_used + ka

    def _reap_every(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.reap()
            self.rotate_logs()

    # -- logs ---------------------------------------------------------------
    def log_path(self, name: str) -> str:
        """The worker log of the model `name` (loaded or not: a released model's log stays); "" or
        "helper": the helper's."""
        if name in ("", "helper"):
            return os.path.join(self.log_dir, "helper.log")
        try:
            name = self.get(name).name
        except errors.NotFound:
            name = local_key(name)
        return os.path.join(self.log_dir, log_name(name))

    def rotate_logs(self) -> None:
        """Keep every log in the state directory under --worker-log-bytes (3 old files kept)."""
        limit = self.settings.worker_log_bytes
        if limit <= 0:
            return
        try:
            names = [n for n in os.listdir(self.log_dir) if n.endswith(".log")]
        except OSError:
            return
        for n in names:
            try:
                if statedir.rotate_log(os.path.join(self.log_dir, n), limit):
                    log.info("rotated %s (over %d bytes)", n, limit)
            except OSError as exc:
                log.warning("cannot rotate %s: %s", n, exc)

    def reap(self) -> None:
        """Release every model whose keep-alive has run out and that has no request in flight."""
        now = self._clock()
        for entry in self.entries():
            exp = self.expires_at(entry)
            # Requests may have gone to the worker directly: ask it before ending it.
            asked = exp and entry.active == 0 and now >= exp
            status = self.activity(entry, ask=bool(asked))
            exp = self.expires_at(entry)
            if exp and not self.busy(entry, status) and now >= exp:
                log.info(
                    "keep-alive of %s expired (%s idle, dispatched by %s); releasing", entry.name,
                    entry.keep_alive or self.settings.keep_alive, _who(entry.dispatched_by),
                    extra=_fields("keep_alive_expiry", entry.name, entry.dispatched_by),
                )
                try:
                    self.release(entry.name, reason="")
                except errors.NndError:
                    pass

    # -- views --------------------------------------------------------------
    def info(self, entry: Entry, *, modules: bool = False) -> nnd_pb2.ModelInfo:
        status = self.activity(entry, ask=True) if entry.state == DISPATCHED else None
        out = nnd_pb2.ModelInfo(
            name=entry.name,
            state=entry.state,
            task=entry.meta.task,
            architecture=entry.meta.architecture,
            config=entry.meta.summary(),
            num_parameters=entry.meta.num_parameters(),
            placement=entry.placement,
            idle_s=_idle_s(entry, status, self._clock()),
            expires_at=self.expires_at(entry),
            last_error=entry.last_error,
            dtype=entry.dtype,
            estimated_bytes=entry.meta.estimate_bytes(entry.placement.dtype),
            loaded_by=entry.loaded_by,
        )
        if entry.worker is not None:
            out.dispatched_by, out.dispatched_at = entry.dispatched_by, entry.dispatched_at
        if entry.dispatched_placement is not None:
            out.dispatched_placement.CopyFrom(entry.dispatched_placement)
        if entry.worker is not None:
            out.worker_pids.extend(entry.worker.pids)  # a tensor-parallel group: every rank, then torchrun
            out.tp_size = entry.worker.tp_size
            if entry.state == DISPATCHED and entry.worker.public:
                out.route.CopyFrom(_route_of(entry.worker))
        if status is not None:
            out.requests.extend(status.requests)
            out.worker_rss_bytes = status.rss_bytes
            out.worker_requests = status.accepted
            out.weights.extend(status.weights)
            out.ranks.extend(status.ranks)
        if modules:
            out.modules.extend(entry.meta.modules(dict(status.devices) if status else None))
            out.config_json = entry.meta.description.config_json
        return out

    # -- persistence --------------------------------------------------------
    def save(self) -> None:
        with self._lock:
            statefile.write(self.settings.state_file, self._entries.values())

    def restore(self, on_error: Callable[[str, Exception], None]) -> None:
        """Start the helper, clear what interrupted uploads left, then load (and re-dispatch
        in the background) what the state file lists. Called once the socket is bound: a daemon that cannot
        bind exits without having started anything."""
        if self.forks is not None:
            self.forks.start()
        self.helper.start_soon()
        self.uploads.clean_partial()
        for rec in statefile.read(self.settings.state_file):
            try:
                self.load(rec.load_request())
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the rest
                on_error(rec.name, exc)
                continue
            if rec.dispatched:
                threading.Thread(target=self._redispatch, args=(rec.name, on_error), daemon=True).start()

    def _redispatch(self, name: str, on_error: Callable[[str, Exception], None]) -> None:
        # Restored models are the daemon's: any user may release them once idle (owners are not persisted,
        # so that registry.json stays readable by the versions before them).
        try:
            for _ in self.dispatch(name, user=None):
                pass
        except Exception as exc:  # noqa: BLE001
            on_error(name, exc)

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            workers = [e.worker for e in self._entries.values() if e.worker is not None]
            for e in self._entries.values():
                e.worker = None
        # Each process takes its grace period and its interpreter's teardown (seconds with torch
        # loaded): end them side by side, so a stop costs the slowest one, not their sum.
        ends = [threading.Thread(target=w.stop, name="stop-worker") for w in workers]
        ends.append(threading.Thread(target=self.helper.close, name="stop-helper"))
        for t in ends:
            t.start()
        for t in ends:
            t.join()
        if self.forks is not None:
            self.forks.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _idle_s(entry: Entry, status: worker_pb2.WorkerStatus | None, now: float) -> float:
    """Seconds since the model last had work: 0 while a request runs or waits (here or on the worker).
    `status` has been taken in (`Registry.activity`): `last_used` counts the worker's requests too."""
    if Registry.busy(entry, status) or (status is not None and status.requests):
        return 0.0
    return now - entry.last_used if entry.last_used else 0.0


def _who(user: str | None) -> str:
    if user is None:
        return "the daemon"
    return user or "an unknown user"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "an unknown time"


def _describe(placement: nnd_pb2.Placement) -> str:
    parts = [f"{fd.name}={value}" for fd, value in placement.ListFields() if fd.name != "max_memory"]
    return ", ".join(parts) or "the default placement"


def _fields(event: str, model: str, user: str | None, **more: Any) -> dict[str, Any]:
    """A lifecycle line's fields, as `--log-format json` prints them (logfmt.py)."""
    return {"nnd": {"event": event, "model": model, "user": user or "", **more}}


def _check_present(entry: Entry) -> None:
    if entry.gone:
        raise errors.Unavailable(f"model {entry.name} was unloaded; load it again to use it")


# Longest model name (a repo id or a path) LoadModel takes.
MAX_NAME = 4096


def check_name(name: str) -> None:
    """Refuse names no repo id or path has, before they reach a file system call or a worker's command line."""
    if len(name) > MAX_NAME:
        raise errors.InvalidArgument(f"the model name is {len(name)} characters long; at most {MAX_NAME}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise errors.InvalidArgument(f"the model name {name[:80]!r} contains a control character")
    if name.startswith("-"):
        raise errors.InvalidArgument(f"the model name {name[:80]!r} starts with '-'; no repo id or path does")


_SHORT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_short_name(name: str) -> None:
    """A short name (`--name`) is never a path or an org/name repo id, so it cannot hide one."""
    if not _SHORT.fullmatch(name) or name in (".", ".."):
        raise errors.InvalidArgument(
            f"the short name {name[:80]!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit (no '/': it must not look like a path or an org/name repo id)"
        )


def local_key(name: str) -> str:
    """A local path's real path (links and '..' resolved); a repo id unchanged."""
    if "\0" in name:  # no path or repo id holds one, and os.path would raise ValueError (an INTERNAL)
        raise errors.InvalidArgument(f"the model name {name[:80]!r} holds a NUL character")
    return os.path.realpath(name) if os.path.isabs(name) or os.path.exists(name) else name


def _check_local_path(name: str) -> None:
    """A name that can only be a path (a Hub repo id is NAME or ORG/NAME) and is not there is a missing
    directory, said so, rather than the Hub's repo-id rules that transformers would quote."""
    looks_local = name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count("/") > 1
    if looks_local and not os.path.exists(name):
        raise errors.NotFound(
            f"no such directory: {name[:200]!r} (as the daemon sees it); a local model is a folder with a "
            "config.json, a Hub model a repo id such as gpt2 or org/name"
        )
    if looks_local and not os.path.isdir(name):
        raise errors.InvalidArgument(f"{name[:200]!r} is not a directory; a local model is a folder with a config.json")


def _allows(pattern: str, name: str) -> bool:
    """Whether an --allow-model entry admits `name`: paths compare by real path, so
    `allowed/../other` and links out of an allowed folder are not inside it."""
    prefix = pattern.endswith("*")
    stem = pattern[:-1] if prefix else pattern
    if os.path.isabs(name):  # a local path, resolved by local_key
        if not (os.path.isabs(stem) or stem.startswith(".") or os.path.exists(stem)):
            return False  # a repo-id pattern admits no path
        real = os.path.realpath(stem)
        if prefix and stem.endswith(os.sep):  # "/models/*": what is inside /models
            real = real.rstrip(os.sep) + os.sep
        return name.startswith(real) if prefix else name == real
    if ".." in name.split("/"):  # no repo id has it
        return False
    return name == stem or (prefix and name.startswith(stem))


def _keep_alive_seconds(text: str) -> float | None:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise errors.InvalidArgument(f"keep_alive: {exc}") from None


def _route_of(worker: Any) -> nnd_pb2.Route:
    """A dispatched worker's route (nnd.proto, Route): its gRPC socket, epoch and fast socket."""
    return nnd_pb2.Route(address=worker.address, epoch=worker.epoch, fast_address=worker.fast_address)
