"""A worker's data path: nnd.v1.Nnd's Trace, Generate, Session and Interact, served to
clients on the worker's public socket (they follow the model's route) and to
the daemon on the private one (bytes it forwards, unparsed, for clients that
do not follow routes).

Everything the daemon used to do per request happens here, so the daemon can
stay out of the data path: the route's epoch, the request limits, the queue
depth, the default deadline, alias paths, and the stored edits a request names
(the daemon pushes aliases and edits with Configure, at dispatch and on each
change). Activity is counted for the daemon's keep-alive, LRU and `nnd ps`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from nnd.v1 import contract, nnd_pb2, worker_pb2
from nnd_daemon import aliases, errors, identity, intake
from nnd_daemon.inflight import InflightBudget
from nnd_daemon.worker.stop import Stop

_SERVICE = "nnd.v1.Nnd"
# Interact continuations kept checked (Gateway._remember): how many, and the largest kept.
_REMEMBERED = 64
_MAX_REMEMBERED_BYTES = 1 << 16


class Gateway:
    """Checks and completes a client's data request, then runs it on `service`."""

    def __init__(
        self,
        service: Any,
        name: str,
        epoch: int,
        limits: nnd_pb2.Limits,
        tickets: identity.Tickets | None = None,
        *,
        queue_share: float = 0.0,
    ) -> None:
        self.service = service
        self.name = name
        self.epoch = epoch
        # The daemon's limits, passed at start; the gateway checks intake.REQUEST_LIMIT_FIELDS of them.
        self.limits = limits
        # One user's share of the queue (settings.UserLimits.max_queue_share; 0: none).
        self.queue_share = float(queue_share)
        # Verifies the `nnd-user` tickets clients (and the daemon, forwarding) send (identity.py).
        self.tickets = tickets
        # Request bytes held while they wait for the model, and Interact continuations not yet read by
        # their paused run: bounded as the daemon bounds what it forwards (daemon/inflight.py).
        self.inflight = InflightBudget(int(self.limits.max_inflight_bytes), holder=f"the worker of {name}")
        self._lock = threading.Lock()
        self._bindings: list[worker_pb2.AliasBinding] = []
        self._table: aliases.AliasTable | None = None
        self._edits: dict[str, worker_pb2.EditStack] = {}
        # Interact continuations checked before, by their bytes, for the alias table they were rewritten
        # with: a block repeated over prompts sends the same one at the same sync point every time.
        self._continued: tuple[aliases.AliasTable | None, dict[bytes, worker_pb2.WorkerInteractContinue]] = (None, {})

    # -- what the daemon pushes ----------------------------------------------
    def configure(self, config: worker_pb2.WorkerConfig) -> None:
        with self._lock:
            if config.set_aliases:
                self._bindings = list(config.aliases)
                self._table = None  # rebuilt on the next request, over the loaded model
            if config.replace_edits:
                self._edits = {}
            self._edits.update(config.edits)
            for edit_id in config.deleted_edits:
                self._edits.pop(edit_id, None)

    def _aliases(self) -> aliases.AliasTable | None:
        with self._lock:
            if self._table is None and self.service.model is not None:
                table = aliases.AliasTable.of(self.service.model, standard=False)
                for b in self._bindings:
                    table.hosts.setdefault(b.host, {})[b.alias] = b.target
                self._table = table
            return self._table

    def _stacks(self, ids: list[str]) -> dict[str, worker_pb2.EditStack]:
        with self._lock:
            missing = [i for i in ids if i not in self._edits]
            if missing:
                raise errors.NotFound(
                    f"no stored edit {missing[0]!r} for this model; ListEdits shows the ones there are"
                )
            return {i: self._edits[i] for i in dict.fromkeys(ids)}

    # -- requests ----------------------------------------------------------------
    def handler(self, route: bool = False) -> grpc.GenericRpcHandler:
        """Trace, TraceOnce, Generate and Session: bytes in (parsed here, so malformed ones get
        INVALID_ARGUMENT), TraceResponse out. `route`: the public socket clients reach by the
        model's route, where a call must carry the route's epoch and name this worker's model."""
        handlers = {
            method: grpc.unary_stream_rpc_method_handler(
                self._method(method, route), request_deserializer=None, response_serializer=_serialize
            )
            for method in contract.DATA_METHODS
        }
        handlers[contract.TRACE_ONCE] = grpc.unary_unary_rpc_method_handler(
            lambda raw, context: self.serve_once(raw, context, route=route),
            request_deserializer=None,
            response_serializer=_serialize,
        )
        handlers["Interact"] = grpc.stream_stream_rpc_method_handler(
            lambda raws, context: self.interact(raws, context, route=route),
            request_deserializer=None,
            response_serializer=_serialize,
        )
        return grpc.method_handlers_generic_handler(_SERVICE, handlers)

    def _method(self, method: str, route: bool) -> Callable[[bytes, grpc.ServicerContext], Iterator[Any]]:
        def serve(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
            yield from self.serve(method, raw, context, route=route)

        return serve

    def _check_epoch(self, context: grpc.ServicerContext, route: bool = False) -> None:
        sent = dict(context.invocation_metadata()).get(contract.EPOCH_KEY)
        if sent is None and route:
            # Without it a restarted worker on a reused socket would run a call meant for its predecessor.
            raise errors.FailedPrecondition(
                f"a call on a model's route must send the route's epoch as `{contract.EPOCH_KEY}` metadata "
                "(GetRoute's epoch); nothing ran"
            )
        if sent is not None and sent != str(self.epoch):
            # Nothing ran: the client fetches the route again and resends (nnd.proto, Route).
            raise errors.FailedPrecondition(
                f"stale route: the worker of {self.name} is at epoch {self.epoch}, not {sent}; "
                "fetch the route again (GetRoute)",
                trailers=((contract.ROUTE_KEY, contract.STALE),),
            )

    def _check_model(self, model: str, route: bool) -> None:
        """On the route, a request names this worker's model (clients send the name LoadModel answered)."""
        if not route or model == self.name or (os.path.isabs(model) and os.path.realpath(model) == self.name):
            return
        raise errors.NotFound(
            f"model {model[:200]!r} is not the model of this route (it serves {self.name!r}); "
            "ask the daemon for that model's route (GetRoute)"
        )

    def user_of(self, context: grpc.ServicerContext) -> str:
        return identity.who(context, self.tickets)

    def _begin(self, kind: str, keep_alive: str, context: grpc.ServicerContext) -> str:
        user = self.user_of(context)
        try:
            self.service.activity.begin(
                keep_alive, int(self.limits.max_queue_depth), self.name, user=user, share=self.queue_share
            )
        except errors.NndError as exc:
            self.service.activity.refused(kind, exc, user, client_of(context))
            raise
        return user

    def serve(self, method: str, raw: bytes, context: grpc.ServicerContext, route: bool = False) -> Iterator[Any]:
        self._check_epoch(context, route)
        with self.inflight.hold(len(raw), "the request"):
            run = self._intake(method, raw, context, route)
            keep_alive = run.session.keep_alive if run.HasField("session") else run.request.keep_alive
            user = self._begin(intake.kind_of(run), keep_alive, context)
            try:
                yield from self.service.run(run, context, *self._stop(context))
            finally:
                self.service.activity.end(user)

    def serve_once(self, raw: bytes, context: grpc.ServicerContext, route: bool = False) -> Any:
        """TraceOnce: a Trace whose whole answer is one unary response (nnd.proto)."""
        self._check_epoch(context, route)
        with self.inflight.hold(len(raw), "the request"):
            run = self._intake("Trace", raw, context, route)
            run.request.one_message = True
            user = self._begin("trace", run.request.keep_alive, context)
            try:
                return self.service.run_once(run, context, *self._stop(context))
            finally:
                self.service.activity.end(user)

    def _intake(
        self, method: str, raw: bytes, context: grpc.ServicerContext, route: bool
    ) -> worker_pb2.WorkerRunRequest:
        try:
            run = self._prepare(method, raw)
        except errors.NndError as exc:  # over a limit, malformed: counted, never run
            self.service.activity.refused(method.lower(), exc, self.user_of(context), client_of(context))
            raise
        self._check_model(run.session.model if run.HasField("session") else run.request.model, route)
        return run

    def interact(self, raws: Iterator[bytes], context: grpc.ServicerContext, route: bool = False) -> Iterator[Any]:
        """Interact (sync points): the first message starts the run, checked and completed as a
        Trace is; later ones add nodes (their alias paths rewritten here). A malformed later
        message ends the run with INVALID_ARGUMENT saying what was wrong."""
        self._check_epoch(context, route)
        raw = next(raws, b"")
        with self.inflight.hold(len(raw), "the request"):
            yield from self._interact(raw, raws, context, route)

    def _interact(
        self, raw: bytes, raws: Iterator[bytes], context: grpc.ServicerContext, route: bool
    ) -> Iterator[Any]:
        first = intake.parse(nnd_pb2.InteractRequest, raw)
        if first.WhichOneof("kind") != "start":
            raise errors.InvalidArgument("an Interact stream starts with an InteractStart")
        start = first.start
        self._check_model(start.session.model if start.HasField("session") else start.request.model, route)
        run = intake.prepare_start(start, self.limits, rewrite=self._rewrite, stacks=self._stacks)
        keep_alive = run.session.keep_alive if run.HasField("session") else run.request.keep_alive
        user = self._begin(intake.kind_of(run), keep_alive, context)

        def parse(raw: bytes) -> worker_pb2.WorkerInteractContinue | errors.NndError:
            """One later message, checked; an error is what the paused run fails with."""
            try:
                msg = nnd_pb2.InteractRequest.FromString(raw)
            except Exception as exc:  # noqa: BLE001 - malformed: the paused run fails, saying why
                return errors.InvalidArgument(
                    f"a later message of this Interact stream is not a valid nnd.v1.InteractRequest ({exc}); "
                    "the run was ended"
                )
            kind = msg.WhichOneof("kind")
            if kind != "more":
                return errors.InvalidArgument(
                    "a later message of an Interact stream must be an InteractContinue (`more`), not "
                    f"{'a second InteractStart' if kind == 'start' else 'an empty InteractRequest'}; "
                    "the run was ended"
                )
            try:  # held to the limits the stream's first message was
                part = intake.prepare_continue(
                    msg.more, len(raw), run, self.limits, rewrite=self._rewrite, stacks=self._stacks
                )
            except errors.NndError as err:
                return err
            if not part.more.traces:  # a session's next traces name stored edits, which may change
                self._remember(raw, part)
            return part

        def checked(raw: bytes) -> worker_pb2.WorkerInteractContinue | errors.NndError:
            table, seen = self._continued
            found = seen.get(raw) if table is self._table else None
            return found if found is not None else parse(raw)

        def messages() -> Iterator[worker_pb2.WorkerInteractContinue | errors.NndError]:
            for raw in raws:
                part = checked(raw)
                yield part
                if isinstance(part, errors.NndError):
                    return

        try:
            stop, on_error = self._stop(context)
            yield from self.service.interact(
                run, start, messages(), context, stop, on_error, caps=self.pause_caps(stop), inflight=self.inflight,
                parse=checked,
            )
        finally:
            self.service.activity.end(user)

    def _stop(self, context: grpc.ServicerContext) -> tuple[Stop, Callable[[BaseException], BaseException]]:
        """What ends a request early, and how a failure after its deadline reads."""
        # The deadline is a point in time checked where the request already waits or polls (stop.py),
        # not a timer thread per request: the client's own timeout, else the daemon's --deadline.
        remaining = context.time_remaining()
        forwarded_default = dict(context.invocation_metadata() or ()).get(contract.DEFAULT_DEADLINE_KEY) == "1"
        own = not forwarded_default and remaining is not None and remaining < 1e8
        seconds = remaining if own else float(self.limits.default_deadline_s)
        stop = Stop(seconds)

        def on_error(exc: BaseException) -> BaseException:
            if stop.expired and not isinstance(exc, errors.DeadlineExceeded):
                if own:
                    return errors.DeadlineExceeded(f"the request ran past its timeout ({seconds:.3g} s)")
                return errors.DeadlineExceeded(
                    f"the request ran past the daemon's default deadline ({seconds:g} s); "
                    "pass a timeout or raise `nnd serve --deadline`"
                )
            return exc

        return stop, on_error

    def pause_caps(self, stop: Stop) -> dict[str, Any]:
        """The server's bounds on `stop`'s request pausing at sync points (engine/interact.py's PauseCaps)."""
        left = stop.remaining()
        return {
            "max_pause_s": float(self.limits.max_pause_s),
            "max_paused_total_s": float(self.limits.max_paused_total_s),
            "remaining": stop.remaining,
            "deadline_s": left if left is not None else 0.0,
        }

    def _prepare(self, method: str, raw: bytes) -> worker_pb2.WorkerRunRequest:
        return intake.prepare(
            method,
            raw,
            self.limits,
            rewrite=self._rewrite,
            stacks=self._stacks,
        )

    def _rewrite(self, graphs: list[Any]) -> None:
        aliases.rewrite_graphs(graphs, self._aliases())

    def _remember(self, raw: bytes, part: worker_pb2.WorkerInteractContinue) -> None:
        """Keep a checked continuation (nothing changes it once checked: the engine plans from it) for the
        next stream that sends the same bytes, while the alias table it was rewritten with holds."""
        if len(raw) > _MAX_REMEMBERED_BYTES:
            return
        table, seen = self._continued
        if table is not self._table or len(seen) >= _REMEMBERED:
            seen = {}
            self._continued = (self._table, seen)
        seen[raw] = part


def client_of(context: grpc.ServicerContext) -> str:
    """Who sent a request: the client's own `nnd-client` metadata (free text, shortened), else the peer."""
    for key, value in context.invocation_metadata() or ():
        if key == contract.CLIENT_KEY and isinstance(value, str):
            return value[:80]
    return context.peer() or "?"


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()
