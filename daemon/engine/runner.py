"""The request loop: one request (or one session of them) from validation to Done.

`run` validates the graph before anything runs, installs hooks for the one
request, runs one batched forward (or `generate`), and emits Saved/Chunk/Step
messages and one Done. Every failure is an `nnd_daemon.errors` exception, and
the model is left exactly as it was.

`run_session` runs several traces in order with one value table: a node of a
later trace may use any value of an earlier one, and the saved values of all
of them are emitted once the last has run. Both take the graphs of stored
edits by id (`edits`); a request's `edits` field picks which run first.
Gradients are enabled only while a request that runs a backward pass runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2

from .. import errors
from . import generation, gradmode, inputs, plan, plancache, scan, wire
from .executor import Executor, StopForward
from .failures import where, wrap
from .interact import Interaction
from .limits import EngineLimits

MODES = ("trace", "scan", "generate")


def run(
    model: torch.nn.Module,
    tokenizer: Any,
    request: nnd_pb2.TraceRequest,
    *,
    mode: str,
    emit: Callable[[nnd_pb2.TraceResponse], None],
    cancelled: Callable[[], bool] = lambda: False,
    limits: EngineLimits | None = None,
    edits: Mapping[str, worker_pb2.EditStack] | None = None,
    lend: Callable[[Callable[[], contextlib.AbstractContextManager[Any]]], None] | None = None,
    interaction: Interaction | None = None,
) -> None:
    """Run `request.graph` on `model` and stream its results through `emit`.

    `edits` maps stored edit ids to their graphs (as the worker is sent them); `request.edits` names the
    ones applied first. `lend`, called between generation steps, may run other
    requests on the model (worker/turns.py); this request's hooks and random
    state are set aside meanwhile. With `interaction` the run pauses at the
    client's sync points (interact.py). Raises only `nnd_daemon.errors` exceptions.
    """
    try:
        limits = limits or EngineLimits()
        done = _run(
            model,
            tokenizer,
            request,
            mode=mode,
            emit=emit,
            cancelled=cancelled,
            limits=limits,
            edits=edits,
            interaction=interaction,
            lend=lend,
        )
        _emit_saved(done.plan, done.saved, emit, limits.max_saved_bytes, interaction)
        emit(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=done.compute_s)))
    except errors.NndError:
        raise
    except Exception as e:  # anything unforeseen still reaches the client as a status, not a traceback
        raise wrap(e, None, scan=mode == "scan") from e


def run_session(
    model: torch.nn.Module,
    tokenizer: Any,
    session: nnd_pb2.SessionRequest,
    *,
    emit: Callable[[nnd_pb2.TraceResponse], None],
    cancelled: Callable[[], bool] = lambda: False,
    limits: EngineLimits | None = None,
    edits: Mapping[str, worker_pb2.EditStack] | None = None,
    interaction: Interaction | None = None,
) -> None:
    """Run a session's traces in order, sharing values; emit every saved value at the end.
    With `interaction`, the last trace pauses at the client's sync points, and the client may
    send the session's next traces as it goes (interact.py).

    Raises only `nnd_daemon.errors` exceptions."""
    scan = session.scan
    try:
        limits = limits or EngineLimits()
        if not session.traces:
            raise errors.InvalidArgument("the session has no trace")
        needed: set[int] = set()
        seen: set[int] = set()
        for index, trace in enumerate(session.traces):
            needed |= plan.referenced(trace.request.graph)
            ids = {n.id for n in trace.request.graph.nodes}
            if ids & seen:
                raise errors.InvalidArgument(
                    f"trace {index} of the session reuses node id(s) {sorted(ids & seen)[:5]} of an earlier trace; "
                    "node ids must be unique across a session"
                )
            seen |= ids
        values: dict[int, Any] = {}
        saved: dict[int, Any] = {}
        plans: dict[int, plan.Plan] = {}
        compute_s = 0.0
        traces = list(session.traces)
        index = -1
        while index + 1 < len(traces):
            index += 1
            trace = traces[index]
            steered = interaction if interaction is not None and index == len(traces) - 1 else None
            if steered is not None and index > len(session.traces) - 1:
                steered.advance()
            mode = "scan" if scan else "generate" if trace.generate else "trace"
            request = trace.request
            if request.model and request.model != session.model:
                raise errors.InvalidArgument(
                    f"trace {index} of the session is for model {request.model!r}, the session for {session.model!r}"
                )

            def tagged(response: nnd_pb2.TraceResponse, index: int = index) -> None:
                if response.WhichOneof("kind") == "step":
                    response.step.trace = index
                emit(response)

            external = {i: values[i] for i in plan.referenced(request.graph) if i in values}
            if steered is not None:  # nodes it is sent while paused may use any earlier value
                external = dict(values)
            done = _run(
                model,
                tokenizer,
                request,
                mode=mode,
                emit=tagged,
                cancelled=cancelled,
                limits=limits,
                edits=edits,
                external=external,
                interaction=steered,
            )
            if steered is not None:
                # The client sent later traces while this one ran: they may use any of its values.
                for later in steered.next_traces:
                    needed |= plan.referenced(later.request.graph)
                traces += steered.next_traces
                steered.next_traces = []
            compute_s += done.compute_s
            for node_id, value in done.saved.items():
                saved[node_id] = value
                plans[node_id] = done.plan
            for node_id in needed:
                node = done.plan.nodes.get(node_id)
                if node is None or node.kind == "external" or node_id < 0:
                    continue
                if node.scope != 0 and node.kind != "save":
                    raise errors.InvalidArgument(
                        f"{where(node.proto)}\nthis value lives inside a loop over generation steps; a later "
                        "trace can use only top-level values (or a save inside the loop: a list per step)"
                    )
                values[node_id] = done.saved[node_id] if node.kind == "save" else done.values.get(node_id)
            if interaction is not None:  # traces still to come may use any top-level value
                for node_id, value in done.values.items():
                    if node_id >= 0:  # not a stored edit's node (negative ids, private to each trace)
                        values.setdefault(node_id, value)
        for trace in traces:
            missing = plan.referenced(trace.request.graph) - values.keys() - {n.id for n in trace.request.graph.nodes}
            if missing:
                raise errors.InvalidArgument(f"a trace of the session refers to unknown node(s) {sorted(missing)}")
        _emit_saved_many(plans, saved, emit, limits.max_saved_bytes, interaction)
        emit(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=compute_s)))
    except errors.NndError:
        raise
    except Exception as e:
        raise wrap(e, None, scan=scan) from e


def run_worker(
    model: torch.nn.Module,
    tokenizer: Any,
    request: worker_pb2.WorkerRunRequest,
    *,
    emit: Callable[[nnd_pb2.TraceResponse], None],
    cancelled: Callable[[], bool] = lambda: False,
    limits: EngineLimits | None = None,
    lend: Callable[[Callable[[], contextlib.AbstractContextManager[Any]]], None] | None = None,
    interaction: Interaction | None = None,
) -> None:
    """Run what a worker is sent: a Trace, a Generate or a Session, with the edit graphs it carries.
    A Generate lends the model between its steps through `lend` (see `run`)."""
    edits: Mapping[str, worker_pb2.EditStack] = request.edits
    if interaction is not None:  # one table: edits the client's later messages bring join it
        interaction.edits.update(request.edits)
        edits = interaction.edits
    if request.HasField("session"):
        run_session(
            model, tokenizer, request.session, emit=emit, cancelled=cancelled, limits=limits, edits=edits,
            interaction=interaction,
        )
        return
    mode = "generate" if request.generate else "trace"
    run(
        model,
        tokenizer,
        request.request,
        mode=mode,
        emit=emit,
        cancelled=cancelled,
        limits=limits,
        edits=edits,
        interaction=interaction,
        lend=lend,
    )


@dataclass
class _Done:
    plan: plan.Plan
    saved: dict[int, Any]
    values: dict[int, Any]  # the root frame's values (what a later trace of a session may use)
    compute_s: float


def _edit_graphs(request: nnd_pb2.TraceRequest, edits: Mapping[str, worker_pb2.EditStack] | None) -> list[Any]:
    """The graphs of the stored edits `request` names, in the order they apply (the one place they are read)."""
    out: list[graph_pb2.Graph] = []
    for edit_id in request.edits:
        stack = (edits or {}).get(edit_id)
        if stack is None:
            raise errors.NotFound(f"no stored edit {edit_id!r} for this model (it was deleted, or never created)")
        out.extend(stack.graphs)
    return out


def _run(
    model: torch.nn.Module,
    tokenizer: Any,
    request: nnd_pb2.TraceRequest,
    *,
    mode: str,
    emit: Callable[[nnd_pb2.TraceResponse], None],
    cancelled: Callable[[], bool],
    limits: EngineLimits,
    edits: Mapping[str, worker_pb2.EditStack] | None = None,
    external: Mapping[int, Any] | None = None,
    lend: Callable[[Callable[[], contextlib.AbstractContextManager[Any]]], None] | None = None,
    interaction: Interaction | None = None,
) -> _Done:
    if mode not in MODES:
        raise errors.InvalidArgument(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    batch = inputs.build(
        model,
        tokenizer,
        request.invokes,
        max_sequence_length=limits.max_sequence_length,
    )
    if external is None:  # reused when seen before (sync points add nodes to a fork of it: Plan.extended)
        the_plan = plancache.build(
            request.graph, model, len(request.invokes), limits.max_constant_bytes, edits=_edit_graphs(request, edits)
        )
    else:
        the_plan = plan.build(
            request.graph,
            model,
            len(request.invokes),
            limits.max_constant_bytes,
            edits=_edit_graphs(request, edits),
            external=external,
        )
    if the_plan.needs_grad and mode == "generate":
        raise errors.InvalidArgument(
            "gradients need a trace: generation runs without autograd (as in transformers' generate); "
            "run the backward pass in `model.trace(...)`",
            exc_type="NotImplementedError",
        )
    opts = generation.options(request.generate, limits) if mode == "generate" else None
    total_steps = opts.max_new_tokens if opts else 1

    def send(values: dict[int, Any]) -> None:  # a sync point's values, then Paused
        _emit_saved(executor.plan, values, emit, limits.max_saved_bytes, interaction)
        emit(nnd_pb2.TraceResponse(paused=nnd_pb2.Paused(nodes=list(values))))

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        constant: Callable[[Any], Any] = lambda v: v  # noqa: E731
        if mode == "scan":
            constant = scan.faker(stack.enter_context(scan.fake_mode()))
        executor = Executor(
            the_plan,
            model,
            batch.rows,
            batch.size,
            total_steps=total_steps,
            cancelled=cancelled,
            scan=mode == "scan",
            constant=constant,
            interaction=interaction,
            send=send,
            max_constant_bytes=limits.max_constant_bytes,
        )
        if interaction is not None:
            executor.check_wants()
        # Inference mode where nothing outlives the request (gradmode.py): not a session's trace, not a scan.
        scanning = mode == "scan"
        gradmode.enter(
            model, stack, needs_grad=the_plan.needs_grad and not scanning, may_be_fast=external is None and not scanning
        )
        stack.enter_context(executor.hooks.installed())
        try:
            executor.poll()
            executor.settle(None)  # nodes that need only constants
            if executor.done_before_the_forward():
                raise StopForward
            placed = batch.to(inputs.input_device(model))
            if opts is not None:
                between = None
                if lend is not None:

                    @contextlib.contextmanager
                    def set_aside() -> Iterator[None]:
                        # Whatever runs meanwhile must neither trip this request's hooks nor move its sampling.
                        with executor.hooks.suppressed(), generation.rng_kept():
                            yield

                    def between() -> None:
                        lend(set_aside)

                result = generation.generate(model, tokenizer, placed, opts, emit, cancelled, between)
            else:
                result = model(*placed.args, **placed.kwargs)
            executor.at_result(result)
        except StopForward:
            pass
        except errors.NndError:
            raise
        except Exception as e:
            last = executor.writes[-1].proto if executor.writes else None
            raise wrap(e, last, scan=mode == "scan") from None
        executor.drain()
        executor.check_complete()
        saved = executor.saved()
    compute_s = time.perf_counter() - started
    # A sync point may have moved the run on to a plan with the nodes it added (Plan.extended).
    return _Done(executor.plan, saved, executor.root.values, compute_s)


def _emit_saved(
    the_plan: plan.Plan,
    saved: dict[int, Any],
    emit: Callable[[nnd_pb2.TraceResponse], None],
    max_bytes: int,
    interaction: Interaction | None = None,
) -> None:
    _emit_saved_many(dict.fromkeys(saved, the_plan), saved, emit, max_bytes, interaction)


def _emit_saved_many(
    plans: Mapping[int, plan.Plan],
    saved: dict[int, Any],
    emit: Callable[[nnd_pb2.TraceResponse], None],
    max_bytes: int,
    interaction: Interaction | None = None,
) -> None:
    """Encode and emit `saved`. With `interaction`, max_bytes bounds the whole request: what its earlier
    sync points sent counts too, so many small pauses cannot deliver more than one result may."""
    # Encode everything first, so a limit violation emits nothing half-way.
    encoder = wire.Encoder(max_bytes=max_bytes, total_bytes=interaction.saved_bytes if interaction else 0)
    encoded: list[tuple[int, Any, list[tuple[int, Any]], int]] = []
    for node_id, value in saved.items():
        first_blob = len(encoder.blobs)
        proto = plans[node_id].nodes[node_id].proto
        try:
            msg, serialized = encoder.saved(value)
        except errors.NndError as e:
            raise wrap(e, proto) from None
        value_blob = 0
        blobs: list[tuple[int, Any]] = encoder.blobs[first_blob:]
        if serialized is not None:  # too big for one message: the value in chunks of its own
            value_blob = encoder.next_blob
            encoder.next_blob += 1
            blobs = [(value_blob, serialized)]
        encoded.append((node_id, msg, blobs, value_blob))
    if interaction is not None:
        interaction.saved_bytes = encoder.total_bytes
    for node_id, msg, blobs, value_blob in encoded:
        for response in wire.saved_messages(node_id, msg, blobs, value_blob):
            emit(response)
