"""Definitions the control plane and the workers share: gRPC options, the
metadata keys of the data path (routes), and the files a tensor-parallel
group leaves beside its socket."""

from __future__ import annotations

import os

# Both servers and the daemon's channels to workers: results stream in chunks
# of a few MiB, but a single message may be large.
MAX_MESSAGE = 512 * 2**20
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]

# Metadata of the data path (protos/nnd/v1/nnd.proto, Route).
EPOCH_KEY = "nnd-epoch"  # the route epoch a client followed
ROUTE_KEY = "nnd-route"  # trailing metadata "stale": wrong epoch, nothing ran
STALE = "stale"
MODEL_KEY = "nnd-model"  # set by the daemon when it forwards bytes it did not parse

# The data methods a worker serves to clients (the rest of nnd.v1.Nnd is the daemon's).
DATA_METHODS = ("Trace", "Generate", "Session")

# Tensor-parallel groups (control/tplaunch.py starts them, worker/tp.py runs them).
# Seconds a rank may wait in one collective, or for the other ranks at the end of a request,
# before the group counts as hung and is stopped (env NND_TP_TIMEOUT_S).
DEFAULT_TP_TIMEOUT_S = 300.0


def timeout_s() -> float:
    try:
        return float(os.environ.get("NND_TP_TIMEOUT_S", "") or DEFAULT_TP_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TP_TIMEOUT_S


def pids_path(sock: str) -> str:
    """Rank pids, in rank order, written by rank 0 before it serves."""
    return sock + ".pids"


def reason_path(sock: str) -> str:
    """Why a group stopped itself, written by the rank that stopped it."""
    return sock + ".reason"
