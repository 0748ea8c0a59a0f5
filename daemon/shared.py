"""Definitions the control plane and the workers share: gRPC options and the
metadata keys of the data path (routes)."""

from __future__ import annotations

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
