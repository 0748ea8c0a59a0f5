"""Cross-client batching: concurrent Trace requests for one model run as ONE forward.

The worker runs one request at a time. While it is busy (and for a short
gathering window, `--batch-window-ms`, when it is idle) compatible Trace
requests pile up; the next one to get the model takes every compatible
request waiting with it, merges them into one `TraceRequest` whose invokes
are all of theirs, runs it once through `engine.run` (the engine's API is
unchanged), and routes the emitted responses back to each request.

Merging
    Request k's node ids are shifted by an offset (past every id of the
    requests before it), and so are its refs; every `ModuleValue.invoke` is
    shifted by the number of invokes before it; its loop scopes are appended
    after theirs. Text invokes are tokenized here once and sent on as token
    ids (the engine tokenizes text the same way). Responses are routed by
    node-id range: a Saved message goes to the request that owns its node (id
    shifted back); the blob ids inside it are renumbered per request (1, 2,
    ... as the engine numbers them for a request alone), and each Chunk goes
    to the request (and local blob id) its Saved message named. Responses are
    held until the merged run has finished, so a failure emits nothing.

Compatibility rule (anything else runs alone, exactly as before)
    - a Trace: not a Generate, Scan or Session; no stored edits; no `shm`;
    - nodes are module values, constants, ops, saves and sets only: no
      skip, stop, backward/grad/set_grad or cache nodes (those act on the
      whole batch or the whole request);
    - every module value (read or written) names an `invoke` (the Python
      client sets invoke=0 for a single-input trace), a module path other
      than "" and a point other than RESULT, and no operation inside a forward
      (`op`, whose value need not hold the batch in dim 0): each value is a view of the
      request's own rows, never of the whole batch;
    - invokes are text or token ids (no tensor args, no keyword inputs), and every invoke of
      every merged request has the same tokenized length, so no request sees
      padding (or other position ids) it would not have had alone; requests
      are grouped by that length;
    - the merged request keeps to `max_invokes`.
    Batch rows are independent in the models nnd serves (attention, MLPs,
    norms work per row), so each request computes what it computes alone, up
    to the floating-point differences a larger matmul may bring (kernels may
    block the work differently by batch size).

The window: a request waits up to `--batch-window-ms` for companions only when
the model is idle and requests have overlapped within the last second; a lone
sequential client never waits, and a busy model gathers by itself.

Errors stay apart: if the merged run fails for any reason, each member is run
again alone, so only the faulty one fails and the others get their normal
results. A member cancelled before the merged run starts is dropped from it
(also when the cancellation lands as it is told it has the model: grpc raises
there); one cancelled during the run is not waited on (the run continues for
the others and its results are dropped), unless every member is cancelled.
Whatever a run does, every member it claimed is finished when it ends: the
others wait on that with no timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nnd.v1 import graph_pb2, nnd_pb2, values_pb2, worker_pb2
from nnd_daemon.engine import inputs

log = logging.getLogger("nnd.worker.batching")

Emit = Callable[[Any], None]
# Runs one original request alone (the worker's normal path), emitting into `emit`.
RunAlone = Callable[[worker_pb2.WorkerRunRequest, Emit, Callable[[], bool]], None]

_ALLOWED_KINDS = frozenset({"module", "constant", "op", "save", "set"})
MAX_MEMBERS = 64
_MAX_ID = 2**32 - 1
_POLL_S = 0.002
# The gathering window applies for this long after requests last overlapped.
_OVERLAP_MEMORY_S = 1.0


def token_length(request: worker_pb2.WorkerRunRequest, tokenizer: Any) -> tuple[int, list[list[int]]] | None:
    """The common tokenized length of a qualifying request and its invokes' ids; None if it does not qualify."""
    if request.generate or request.HasField("session") or request.edits:
        return None
    trace = request.request
    if trace.edits or trace.shm or not trace.invokes or trace.HasField("generate"):
        return None
    for node in trace.graph.nodes:
        kind = node.WhichOneof("kind")
        if kind not in _ALLOWED_KINDS:
            return None
        mv = node.module if kind == "module" else node.set.target if kind == "set" else None
        # An operation's value need not have the batch as dim 0 (a flattened token matrix): it runs alone.
        if mv is not None and (not mv.HasField("invoke") or not mv.path or mv.point == graph_pb2.RESULT or mv.op):
            return None
    seqs: list[list[int]] = []
    for inv in trace.invokes:
        if inv.args or inv.kwargs:  # keyword inputs (T5's decoder_input_ids) are not merged across requests
            return None
        which = inv.WhichOneof("input")
        if which == "tokens":
            seqs.append([int(i) for i in inv.tokens.ids])
        elif which == "text" and tokenizer is not None:
            try:
                seqs.append(list(inputs.text_ids(tokenizer, inv.text)))
            except Exception:  # noqa: BLE001 - the request alone reports it
                return None
        else:
            return None
    lengths = {len(s) for s in seqs}
    if len(lengths) != 1 or 0 in lengths:
        return None
    return lengths.pop(), seqs


@dataclass
class Member:
    """One request waiting to run, and where its responses go."""

    request: worker_pb2.WorkerRunRequest
    length: int
    ids: list[list[int]]
    emit: Emit
    cancelled: Callable[[], bool]
    started: Callable[[], None]
    claimed: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # Set while merging: where its node ids start, how many it has.
    offset: int = 0
    end: int = 0
    buffer: list[Any] = field(default_factory=list)
    blobs: int = 0  # local blob ids handed out so far


def _tokenized(m: Member) -> worker_pb2.WorkerRunRequest:
    """The member's request with its text invokes replaced by the ids tokenized for it (the same input)."""
    if not any(inv.WhichOneof("input") == "text" for inv in m.request.request.invokes):
        return m.request
    request = worker_pb2.WorkerRunRequest()
    request.CopyFrom(m.request)
    del request.request.invokes[:]
    for ids in m.ids:
        request.request.invokes.add().tokens.ids.extend(ids)
    return request


def _max_id(graph: graph_pb2.Graph) -> int:
    return max((n.id for n in graph.nodes), default=-1)


def _shift_arg(arg: graph_pb2.Arg, offset: int) -> None:
    kind = arg.WhichOneof("kind")
    if kind == "ref":
        arg.ref += offset
    elif kind in ("tuple", "list"):
        for item in getattr(arg, kind).items:
            _shift_arg(item, offset)


def merge(members: list[Member]) -> nnd_pb2.TraceRequest | None:
    """One TraceRequest holding every member's invokes and graph; None if the ids would not fit."""
    merged = nnd_pb2.TraceRequest(model=members[0].request.request.model)
    next_id = 0
    invokes = 0
    for m in members:
        trace = m.request.request
        m.offset = next_id
        m.end = next_id + _max_id(trace.graph) + 1
        if m.end > _MAX_ID:
            return None
        scopes = len(merged.graph.scopes)
        merged.graph.scopes.extend(trace.graph.scopes)
        for ids in m.ids:
            merged.invokes.add().tokens.ids.extend(ids)
        for src in trace.graph.nodes:
            node = merged.graph.nodes.add()
            node.CopyFrom(src)
            node.id += m.offset
            if node.scope:
                node.scope += scopes
            kind = node.WhichOneof("kind")
            if kind == "module":
                node.module.invoke += invokes
            elif kind == "op":
                for a in node.op.args:
                    _shift_arg(a, m.offset)
                for a in node.op.kwargs.values():
                    _shift_arg(a, m.offset)
            elif kind in ("save", "set"):
                effect = getattr(node, kind)
                _shift_arg(effect.value, m.offset)
                if kind == "set":
                    effect.target.invoke += invokes
        invokes += len(trace.invokes)
        next_id = m.end
    return merged


def _renumber(value: values_pb2.Value, owner: Member, blob_owner: dict[int, tuple[Member, int]]) -> None:
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        if value.tensor.blob:
            owner.blobs += 1
            blob_owner[value.tensor.blob] = (owner, owner.blobs)
            value.tensor.blob = owner.blobs
    elif kind in ("list", "tuple"):
        for item in getattr(value, kind).items:
            _renumber(item, owner, blob_owner)
    elif kind == "map":
        for item in value.map.items.values():
            _renumber(item, owner, blob_owner)


class Router:
    """Sends each response of a merged run to the member it belongs to (buffered)."""

    def __init__(self, members: list[Member]) -> None:
        self.members = members
        self.blob_owner: dict[int, tuple[Member, int]] = {}

    def owner(self, node: int) -> Member:
        for m in self.members:
            if m.offset <= node < m.end:
                return m
        raise RuntimeError(f"batched run emitted node {node}, which no member owns")

    def __call__(self, response: nnd_pb2.TraceResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "saved":
            m = self.owner(response.saved.node)
            response.saved.node -= m.offset
            if response.saved.value_blob:  # a serialized value: its tensors are inline, one blob to renumber
                m.blobs += 1
                self.blob_owner[response.saved.value_blob] = (m, m.blobs)
                response.saved.value_blob = m.blobs
            _renumber(response.saved.value, m, self.blob_owner)
            m.buffer.append(response)
        elif kind == "chunk":
            m, local = self.blob_owner[response.chunk.blob]
            response.chunk.blob = local
            m.buffer.append(response)
        elif kind == "done":
            for m in self.members:
                m.buffer.append(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=response.done.compute_s)))
        else:  # nothing else comes out of a trace
            raise RuntimeError(f"batched run emitted an unexpected {kind!r} response")


class Batcher:
    """Gathers compatible Trace requests and runs them as one; see the module docstring."""

    def __init__(
        self,
        run_lock: threading.Lock,
        run_merged: Callable[[nnd_pb2.TraceRequest, Emit, Callable[[], bool]], None],
        run_alone: RunAlone,
        *,
        window_s: float,
        max_invokes: int = 0,
    ) -> None:
        self.run_lock = run_lock
        self.run_merged = run_merged
        self.run_alone = run_alone
        self.window_s = window_s
        self.max_invokes = max_invokes
        self._cond = threading.Condition()
        self._pending: list[Member] = []
        self._overlap_at = -1e9  # when a request last arrived while another was in the worker
        # Counters (read by tests through the log and by status reports).
        self.merged_runs = 0
        self.merged_requests = 0

    def submit(self, member: Member) -> None:
        """Run `member` (alone or merged with others); returns when its responses are all emitted."""
        with self._cond:
            now = time.monotonic()
            busy = self.run_lock.locked()
            if busy or self._pending:
                self._overlap_at = now
            self._pending.append(member)
            # Gather only when requests have lately overlapped and the model is idle: a busy model
            # gathers by itself (whoever takes it next takes every compatible waiting request),
            # and a lone sequential client never waits.
            gather = self.window_s > 0 and not busy and now - self._overlap_at < _OVERLAP_MEMORY_S
        if gather:
            time.sleep(self.window_s)
        while True:
            with self._cond:
                if member.claimed:
                    break
            if not self.run_lock.acquire(timeout=_POLL_S * 5):
                continue
            group: list[Member] = []
            try:
                with self._cond:
                    if member.claimed:
                        break
                    group = self._claim(member)
                self._run_group(group)
            finally:
                self.run_lock.release()
                # Every claimed member waits on `finished` with no timeout: whatever happened in this
                # run, none of them may be left waiting (a liveness guarantee, not error handling).
                _finish_all(group)
            break
        member.finished.wait()
        if member.error is not None:
            raise member.error

    def _claim(self, leader: Member) -> list[Member]:
        """Take the leader and every compatible pending member off the queue (under the condition)."""
        group: list[Member] = []
        invokes = 0
        for m in list(self._pending):
            if m is not leader and (m.length != leader.length or len(group) >= MAX_MEMBERS):
                continue
            n = len(m.request.request.invokes)
            if m is not leader and self.max_invokes and invokes + n > self.max_invokes:
                continue
            group.append(m)
            invokes += n
            m.claimed = True
            self._pending.remove(m)
        return group

    def _run_group(self, group: list[Member]) -> None:
        live = []
        for m in group:
            if m.cancelled():
                self._alone(m)  # reports the cancellation as a request alone would
            else:
                live.append(m)
        if len(live) == 1:
            self._alone(live[0])
            return
        if not live:
            return
        # `started` answers the member's RPC (initial metadata), and raises if the client cancelled it
        # after the check above: that member alone is done (cancelled); the others still run.
        live = [m for m in live if self._start(m)]
        if len(live) == 1:
            self._alone(live[0], started=True)
            return
        if not live:
            return
        merged = merge(live)
        if merged is None:
            for m in live:
                self._alone(m, started=True)
            return
        router = Router(live)
        try:
            self.run_merged(merged, router, lambda: all(m.cancelled() for m in live))
        except BaseException as exc:  # noqa: BLE001 - each member is rerun alone
            log.info("batched run of %d requests failed (%s); running each alone", len(live), type(exc).__name__)
            for m in live:
                m.buffer.clear()
                self._alone(m, started=True)
            return
        self.merged_runs += 1
        self.merged_requests += len(live)
        log.info(
            "batched %d requests (%d invokes) in one forward [runs=%d requests=%d]",
            len(live),
            len(merged.invokes),
            self.merged_runs,
            self.merged_requests,
        )
        for m in live:
            try:
                for response in m.buffer:
                    m.emit(response)
            except BaseException as exc:  # noqa: BLE001 - reported to that member only
                m.error = exc
            m.buffer.clear()
            m.finished.set()

    @staticmethod
    def _start(m: Member) -> bool:
        """Tell `m`'s client it has the model; False (and `m` finished, cancelled) if it has left."""
        from nnd_daemon import errors

        try:
            m.started()
        except BaseException as exc:  # noqa: BLE001 - reported to that member only
            m.error = exc if isinstance(exc, errors.NndError) else errors.Cancelled("request cancelled before it ran")
            m.finished.set()
            return False
        return True

    def _alone(self, m: Member, *, started: bool = False) -> None:
        from nnd_daemon import errors

        try:
            if m.cancelled():
                raise errors.Cancelled("request cancelled before it ran")
            if not started:
                m.started()
            self.run_alone(_tokenized(m), m.emit, m.cancelled)
        except BaseException as exc:  # noqa: BLE001 - reported to that member only
            m.error = exc
        m.finished.set()

    def offer(
        self,
        request: worker_pb2.WorkerRunRequest,
        tokenizer: Any,
        emit: Emit,
        cancelled: Callable[[], bool],
        started: Callable[[], None],
    ) -> bool:
        """Run `request` through the batcher if it qualifies (True: done, its error raised); False: not taken."""
        found = token_length(request, tokenizer)
        if found is None:
            return False
        length, ids = found
        self.submit(Member(request, length, ids, emit, cancelled, started))
        return True


def _finish_all(group: list[Member]) -> None:
    """Finish every member of a run that is not finished yet, with an error saying so."""
    from nnd_daemon import errors

    for m in group:
        if not m.finished.is_set():
            if m.error is None:
                m.error = errors.NndError("internal error in worker: a batched run ended without running this request")
            m.finished.set()


def for_service(service: Any, window_ms: float) -> Batcher:
    """A batcher for a WorkerService: merged runs go through `engine.run`, lone ones through its `_execute`."""

    def run_merged(merged: nnd_pb2.TraceRequest, emit: Emit, cancelled: Callable[[], bool]) -> None:
        from nnd_daemon import engine

        engine.run(
            service.model,
            service.tokenizer,
            merged,
            mode="trace",
            emit=emit,
            cancelled=cancelled,
            limits=service.limits,
        )

    max_invokes = getattr(service.limits, "max_invokes", 0) or 0
    return Batcher(service._run_lock, run_merged, service._execute, window_s=window_ms / 1000, max_invokes=max_invokes)
