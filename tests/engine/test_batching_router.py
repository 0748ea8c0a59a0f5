"""The batched run's router (worker/batching.py) with a saved value that travels serialized
(`Saved.value_blob`): each member gets its own value back, under its own node and blob ids."""

from __future__ import annotations

from nnd import _results
from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon.engine import wire
from nnd_daemon.worker import batching


def _member(offset: int, end: int) -> batching.Member:
    return batching.Member(
        request=worker_pb2.WorkerRunRequest(),
        length=1,
        ids=[[1]],
        emit=lambda _: None,
        cancelled=lambda: False,
        started=lambda: None,
        offset=offset,
        end=end,
    )


def test_serialized_values_reach_their_members() -> None:
    a, b = _member(0, 10), _member(10, 20)
    router = batching.Router([a, b])
    values = {3: [float(i) for i in 200_000 * [1]], 13: list(range(300_000))}  # both over 1 MiB encoded
    encoder = wire.Encoder()
    for node, value in values.items():
        msg, raw = encoder.saved(value)
        assert raw is not None
        blob = encoder.next_blob
        encoder.next_blob += 1
        for response in wire.saved_messages(node, msg, [(blob, raw)], blob):
            router(response)
    router(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone()))
    assert _results.collect(iter(a.buffer)).saved == {3: values[3]}
    assert _results.collect(iter(b.buffer)).saved == {3: values[13]}
