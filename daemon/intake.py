"""A request's intake, before any work: its bytes parsed, checked against the daemon's limits
(size, depth, nodes, invokes), alias paths rewritten and stored edits attached (`prepare`; an
Interact stream's first message `prepare_start`, its later ones `prepare_continue`), and its kind
(`kind_of`). The worker takes in data requests, the helper scans, the daemon edits (`check_part`);
no torch here: the control plane imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from nnd.v1 import contract, graph_pb2, nnd_pb2, worker_pb2
from nnd_daemon import errors

# Protobuf parsers refuse messages nested more than 100 deep, and the daemon
# wraps a request up to 3 levels deeper for its worker (a session's trace, a
# stored edit's graph). A request nested deeper than this is refused here, as
# INVALID_ARGUMENT, instead of failing to parse in the worker (INTERNAL).
MAX_DEPTH = 90
# Nodes one graph may have. Real interventions have hundreds (thousands with
# unrolled loops); every node costs the daemon and the engine work in Python,
# so millions of them (a few MB of request) must not reach either.
MAX_GRAPH_NODES = 200_000
# Messages that hold no recursive fields: one level, whatever they hold (`_height`), so never walked into.
_LEAVES = {"nnd.v1." + n for n in ("Tensor", "Slice", "Empty", "Shape", "SourceLocation", "ModuleValue", "TokenIds")}


def check_nodes(graph: Any, what: str = "the request") -> None:
    """Refuse a graph of more than MAX_GRAPH_NODES nodes (before any walk over it)."""
    if len(graph.nodes) > MAX_GRAPH_NODES:
        raise errors.ResourceExhausted(
            f"{what} has {len(graph.nodes)} graph nodes, over the daemon's limit max_graph_nodes={MAX_GRAPH_NODES}"
        )


def check_depth(message: Any, what: str = "the request") -> None:
    """Refuse `message` if it nests messages (lists in lists...) more than MAX_DEPTH deep.

    Every request is walked, so the walk visits only the fields a message has set (`ListFields`),
    with each field's kind worked out once per field descriptor (`_kind`): walking every declared
    field of every node, with its options read each time, cost 62 µs for a 2-node graph and 1.9 ms
    for 100 nodes here. A field whose type cannot nest past the limit from where it stands (no
    recursion below it: a source location, a module value, a tensor) is not walked into at all, nor
    is a message too small to: each level below a message costs its encoding at least two bytes (a
    tag, a length), so one of S bytes at depth d reaches at most depth d + S // 2 (`_shallow`; a
    96-node generation graph: 0.96 ms walked, 0.23 ms with it)."""
    if _shallow(message, 1):
        return
    stack = [(message, 1)]
    while stack:
        msg, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise errors.InvalidArgument(
                f"{what} nests values more than {MAX_DEPTH} levels deep (lists in lists...); flatten it"
            )
        for fd, value in msg.ListFields():
            info = _KINDS.get(fd)
            if info is None:
                info = _KINDS[fd] = _kind(fd)
            kind, below = info
            if kind == _SCALAR or (below is not None and depth + below <= MAX_DEPTH):
                continue
            if kind == _ONE:
                if not _shallow(value, depth + 1):
                    stack.append((value, depth + 1))
            elif kind == _MANY:
                stack.extend((v, depth + 1) for v in value if not _shallow(v, depth + 1))
            else:
                stack.extend((v, depth + 2) for v in value.values() if not _shallow(v, depth + 2))


def _shallow(msg: Any, depth: int) -> bool:
    """Whether `msg`, at `depth`, is too small to hold anything past MAX_DEPTH (see check_depth)."""
    return depth + msg.ByteSize() // 2 <= MAX_DEPTH


# What check_depth does with a field: nothing (a scalar, or a map of scalars), or walk one message,
# each of a repeated field's, or each value of a map whose values are messages (an entry is a level);
# and how many levels below its message the field can reach at most (None: its type can recurse).
_SCALAR, _ONE, _MANY, _MAP = range(4)
_KINDS: dict[Any, tuple[int, int | None]] = {}


def _kind(fd: Any) -> tuple[int, int | None]:
    kind, below = _kind_within(fd, ())
    return (_MANY if kind == _ONE and _repeated(fd) else kind), below


def _height(desc: Any, within: tuple[Any, ...]) -> int | None:
    """The levels a message of type `desc` spans at most, itself included, as check_depth counts them
    (a leaf is one); None when a field below it can hold its own kind again (lists of lists)."""
    if desc.full_name in _LEAVES:
        return 1
    if desc in within:
        return None
    deepest = 1
    for fd in desc.fields:
        kind, below = _kind_within(fd, (*within, desc))
        if kind == _SCALAR:
            continue
        if below is None:
            return None
        deepest = max(deepest, 1 + below)
    return deepest


def _kind_within(fd: Any, within: tuple[Any, ...]) -> tuple[int, int | None]:
    """A field's kind (_ONE for a repeated one too) and how many levels below its message it reaches."""
    if fd.message_type is None:
        return _SCALAR, 0
    if fd.message_type.GetOptions().map_entry:
        value = fd.message_type.fields_by_name["value"].message_type
        if value is None:
            return _SCALAR, 0
        height = _height(value, within)
        return _MAP, None if height is None else 1 + height
    return _ONE, _height(fd.message_type, within)


def _repeated(fd: Any) -> bool:
    flag = getattr(fd, "is_repeated", None)  # protobuf >= 5.29; `label` is deprecated there
    return bool(flag) if flag is not None else fd.label == fd.LABEL_REPEATED


def check_part(message: Any, size: int, limits: Any, what: str) -> None:
    """A part of a request that arrives on its own (an Interact continuation, a stored edit's graph),
    `size` bytes: held to the limits a whole request is (max_request_bytes, nodes, depth)."""
    limit = int(getattr(limits, "max_request_bytes", 0) or 0)
    if limit and size > limit:
        raise errors.ResourceExhausted(f"{what} is {size} bytes, over the daemon's limit max_request_bytes={limit}")
    check_nodes(message if isinstance(message, graph_pb2.Graph) else message.graph, what)
    check_depth(message, what)


def check(request: nnd_pb2.TraceRequest, limits: Any, *, generate: bool) -> None:
    """`limits`: anything with the request-limit fields of nnd.v1.Limits."""
    if not request.model:
        raise errors.InvalidArgument("the request names no model")
    if not request.invokes:
        raise errors.InvalidArgument("the request has no input: give a prompt, token ids or tensors")
    if limits.max_invokes and len(request.invokes) > limits.max_invokes:
        raise errors.ResourceExhausted(
            f"{len(request.invokes)} invokes exceed the daemon's limit max_invokes={limits.max_invokes}"
        )
    if limits.max_request_bytes:
        size = request.ByteSize()
        if size > limits.max_request_bytes:
            raise errors.ResourceExhausted(
                f"the request is {size} bytes, over the daemon's limit max_request_bytes={limits.max_request_bytes}"
            )
    check_nodes(request.graph)
    check_depth(request)
    if generate:
        n = request.generate.max_new_tokens
        if n < 0:
            raise errors.InvalidArgument(f"max_new_tokens must be positive, not {n}")
        if limits.max_new_tokens and n > limits.max_new_tokens:
            raise errors.ResourceExhausted(
                f"max_new_tokens={n} exceeds the daemon's limit max_new_tokens={limits.max_new_tokens}; "
                "ask for fewer tokens or raise the limit (nnd serve --max-new-tokens)"
            )


# The fields of nnd.v1.Limits (control/settings.py's Limits) a worker's gateway checks per request
# (`check`, the queue depth, the default deadline)...
REQUEST_LIMIT_FIELDS = (
    "max_request_bytes",
    "max_invokes",
    "max_new_tokens",
    "default_deadline_s",
    "max_queue_depth",
    "max_pause_s",
    "max_paused_total_s",
    "max_inflight_bytes",
)
# ...and those the engine enforces while a request runs (engine/limits.py's EngineLimits). A limit
# `check` enforces from the request alone (max_invokes) is not the engine's: each is checked once.
ENGINE_LIMIT_FIELDS = ("max_saved_bytes", "max_sequence_length", "max_new_tokens", "max_constant_bytes")


# The kinds of request a worker counts (`nnd ps`, worker/activity.py); a scan is the helper's.
KINDS = ("trace", "generate", "session")


def kind_of(run: worker_pb2.WorkerRunRequest | nnd_pb2.InteractStart) -> str:
    """What a prepared run (or an Interact stream's start) is: one of KINDS."""
    return "session" if run.HasField("session") else "generate" if run.generate else "trace"


def steps_of(run: worker_pb2.WorkerRunRequest) -> int:
    """The steps a run is expected to take, for `nnd ps`'s progress: a Generate's new tokens (the
    protocol's default when it asks for none), else 0."""
    if kind_of(run) != "generate":
        return 0
    return run.request.generate.max_new_tokens or contract.DEFAULT_MAX_NEW_TOKENS


def limits_arg(limits: nnd_pb2.Limits) -> str:
    """The daemon's limits as one command-line argument of a worker: nnd.v1.Limits in protobuf's JSON
    form (the one form limits travel in, to workers and to the helper)."""
    return json_format.MessageToJson(limits, preserving_proto_field_name=True, indent=None)


def limits_of_arg(text: str) -> nnd_pb2.Limits:
    """`limits_arg`'s result read back; empty: no limits (every field 0)."""
    return json_format.Parse(text, nnd_pb2.Limits()) if text else nnd_pb2.Limits()


def pick(limits: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """`fields` of `limits` (anything with them as attributes) as a dict; absent ones 0."""
    return {f: getattr(limits, f, 0) for f in fields}


def engine_limits(limits: Any) -> Any:
    from nnd_daemon.engine import EngineLimits

    return EngineLimits(**pick(limits, ENGINE_LIMIT_FIELDS))


def parse(message: Any, raw: bytes) -> Any:
    """`raw` as a `message`; INVALID_ARGUMENT if it is not one."""
    try:
        return message.FromString(raw)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise errors.InvalidArgument(
            f"the request is not a valid nnd.v1.{message.__name__} message ({exc}); nothing ran"
        ) from None


def prepare(
    method: str,
    raw: bytes,
    limits: Any,
    *,
    rewrite: Callable[[list[Any]], None],
    stacks: Callable[[list[str]], dict[str, worker_pb2.EditStack]],
    scan: bool = False,
) -> worker_pb2.WorkerRunRequest:
    """A client's Trace, Generate, Scan or Session bytes as the engine runs them: parsed,
    checked against `limits`, alias paths rewritten (`rewrite`), the stored edits it names
    attached (`stacks`). The worker does this for its requests, the helper for scans
    (`scan`: a Scan, or a Session with `scan` set; the worker takes no scan sessions)."""
    if method == "Session":
        session = parse(nnd_pb2.SessionRequest, raw)
        if not session.traces:
            raise errors.InvalidArgument("the session has no trace: add at least one")
        if session.scan and not scan:
            raise errors.InvalidArgument("a scan session runs on the daemon, not on a worker: send it there")
        return _session(session, limits, rewrite=rewrite, stacks=stacks)
    return _trace(parse(nnd_pb2.TraceRequest, raw), method == "Generate", limits, rewrite=rewrite, stacks=stacks)


def prepare_start(
    start: nnd_pb2.InteractStart,
    limits: Any,
    *,
    rewrite: Callable[[list[Any]], None],
    stacks: Callable[[list[str]], dict[str, worker_pb2.EditStack]],
) -> worker_pb2.WorkerRunRequest:
    """An Interact stream's first message as the run it starts, taken in as a Trace, Generate or
    Session is (`prepare`)."""
    if start.HasField("session"):
        session = start.session
        if not session.traces or session.scan:
            raise errors.InvalidArgument("an interactive session needs its traces (and runs no scans)")
        return _session(session, limits, rewrite=rewrite, stacks=stacks)
    return _trace(start.request, start.generate, limits, rewrite=rewrite, stacks=stacks)


def prepare_continue(
    more: nnd_pb2.InteractContinue,
    size: int,
    run: worker_pb2.WorkerRunRequest,
    limits: Any,
    *,
    rewrite: Callable[[list[Any]], None],
    stacks: Callable[[list[str]], dict[str, worker_pb2.EditStack]],
) -> worker_pb2.WorkerInteractContinue:
    """A later message of `run`'s Interact stream (`size` bytes on the wire), held to the limits its
    first message was, alias paths rewritten; a session's new traces checked as `prepare` checks
    a session's, with the stored edits they name (looked up now: a later block may name one the
    first did not)."""
    check_part(more, size, limits, "a continuation")
    rewrite([more.graph])
    if not more.traces:
        return worker_pb2.WorkerInteractContinue(more=more)
    if not run.HasField("session"):
        raise errors.InvalidArgument("only an interactive session takes further traces")
    check_traces(run.session.model, more.traces, limits)
    rewrite([t.request.graph for t in more.traces])
    return worker_pb2.WorkerInteractContinue(more=more, edits=stacks([i for t in more.traces for i in t.request.edits]))


def check_traces(model: str, traces: Any, limits: Any, *, scan: bool = False) -> None:
    """A session's traces, each checked as a request; a trace naming no model is for the session's."""
    for trace in traces:
        if not trace.request.model:
            trace.request.model = model
        check(trace.request, limits, generate=trace.generate and not scan)


def _session(session: nnd_pb2.SessionRequest, limits: Any, *, rewrite: Any, stacks: Any) -> worker_pb2.WorkerRunRequest:
    check_traces(session.model, session.traces, limits, scan=session.scan)
    rewrite([t.request.graph for t in session.traces])
    ids = [i for t in session.traces for i in t.request.edits]
    return worker_pb2.WorkerRunRequest(session=session, edits=stacks(ids))


def _trace(
    request: nnd_pb2.TraceRequest, generate: bool, limits: Any, *, rewrite: Any, stacks: Any
) -> worker_pb2.WorkerRunRequest:
    check(request, limits, generate=generate)
    rewrite([request.graph])
    return worker_pb2.WorkerRunRequest(request=request, generate=generate, edits=stacks(list(request.edits)))
