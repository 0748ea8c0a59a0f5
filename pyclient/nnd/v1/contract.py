"""The parts of the wire contract that are not messages: metadata keys, which methods are data
methods, the transport's message-size limit, how a status's trailers are read, and which steps a
step selector picks.

Written by hand beside the generated stubs (and address.py, shm.py) so that the daemon, its
workers, its helper and the Python client read one definition: a key spelled twice can drift, and
the message-size limit once did (512 MiB on one side, 256 MiB on the other). Imports nothing but
the stubs; installs without torch. docs/protocol.md is the reference for other languages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from nnd.v1 import graph_pb2

# ---------------------------------------------------------------- metadata keys (docs/protocol.md §1.1, §9)

# Request metadata: the route epoch a client followed (GetRoute). A worker refuses a call on its route
# without it, and answers a wrong one with ROUTE_KEY=STALE before anything ran.
EPOCH_KEY = "nnd-epoch"
# Trailing metadata of a refused routed call; the value STALE means: ask GetRoute again, then resend.
ROUTE_KEY = "nnd-route"
STALE = "stale"
# ... and STREAM: this TraceOnce cannot be answered in one message; send it as Trace.
STREAM = "stream"
# Request metadata the daemon sets when it forwards bytes it did not parse: which model they are for.
MODEL_KEY = "nnd-model"
# Request metadata the daemon sets on a forwarded call whose client sent no deadline: the worker
# applies the daemon's --deadline itself (and says so when it ends the call); the forwarded call's
# own gRPC timeout is that plus FORWARD_GRACE_S, a backstop that must not win the race.
DEFAULT_DEADLINE_KEY = "nnd-default-deadline"
FORWARD_GRACE_S = 5.0
# Request metadata naming a call's client for `nnd ps` (the Python client sends user@host:pid).
CLIENT_KEY = "nnd-client"
# Request metadata: the signed ticket the daemon's `.who` socket minted for the caller's uid.
USER_KEY = "nnd-user"
# Trailing metadata of a failed call: the Python exception type the code would have raised in-process.
EXC_TYPE_KEY = "nnd-exception-type"
# Initial metadata a worker sends with a request's Queued message: it waits behind others.
QUEUED_KEY = "nnd-queued"
# Initial metadata a worker sends once a queued request has the model (it runs, no longer waits).
STARTED_KEY = "nnd-started"

# ---------------------------------------------------------------- request defaults

# New tokens a Generate makes when GenerateOptions.max_new_tokens is 0 and the model's
# generation_config names none (transformers' own default).
DEFAULT_MAX_NEW_TOKENS = 20

# ---------------------------------------------------------------- methods and transport

# The unary-request data methods a worker serves to clients and the daemon forwards to it unparsed
# (Interact, a bidirectional stream, is routed too but forwarded by its own path).
DATA_METHODS = ("Trace", "Generate", "Session")
# A Trace answered in one unary message, served on routes only (nnd.proto, TraceOnce).
TRACE_ONCE = "TraceOnce"

# One gRPC message, either way, on every channel and server (daemon, workers, helper, client).
# Results stream in chunks of a few MiB; a request is bounded separately by Limits.max_request_bytes
# (default 256 MiB), which an operator may raise up to this.
MAX_MESSAGE = 512 * 2**20
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


def trailer(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str:
    """The value of `key` in a call's trailing (or initial) metadata; "" when absent. The last one
    wins, as a server that sets a key twice means its later value."""
    value = ""
    for k, v in metadata or ():
        if k == key:
            value = v
    return value


def exc_type_of(err: Any) -> str:
    """The `nnd-exception-type` trailer of a failed call (a grpc.RpcError); "" when it has none."""
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return trailer(trailing, EXC_TYPE_KEY)


def started_from(metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """Whether a worker had begun running a call, from the initial metadata it sent (None: none came):
    it says `nnd-started` once a queued request has the model; one that never said `nnd-queued` had
    it at once (a header on every unqueued trace would be one more write)."""
    keys = {key for key, _ in metadata or ()}
    return STARTED_KEY in keys or QUEUED_KEY not in keys


# ---------------------------------------------------------------- step selectors (graph.proto, StepSelector)


def steps_of(sel: graph_pb2.StepSelector, total: int) -> Sequence[int]:
    """The steps (calls of a module, generation steps) a selector picks out of `total`, in order:
    `all` every one; `range` Python's slice of range(total); `steps` each index, negative from the
    end, an index outside range(total) picking nothing."""
    span = range(total)
    kind = sel.WhichOneof("kind")
    if kind == "all":
        return span
    if kind == "range":
        r = sel.range
        return span[
            slice(
                r.start if r.HasField("start") else None,
                r.stop if r.HasField("stop") else None,
                r.step if r.HasField("step") else None,
            )
        ]
    return [span[s] for s in sel.steps.steps if -total <= s < total]


def selects(sel: graph_pb2.StepSelector, total: int, step: int) -> bool:
    """Whether `sel` picks `step` when the run has `total` steps (a step beyond a total not yet known
    counts the run as that long)."""
    if sel.WhichOneof("kind") == "all":
        return True
    return step in steps_of(sel, max(total, step + 1))
