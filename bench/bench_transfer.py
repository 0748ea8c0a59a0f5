"""transfer: a ~256 MiB saved tensor from the worker to the client over the unix socket.

The graph saves `h[0, 0, 0].expand(N)` of a layer output of the tiny model: N
float32 values that exist in the worker only as a view, so, as for any saved
activation, their bytes are made as they are sent (into chunks, or straight into
the client's shared-memory region), shipped worker → daemon → client and made a
tensor there. (A `.clone()` in the graph would add a 256 MiB copy into fresh
memory, ~0.1 s ± 0.06 s here, to every trace: noise larger than an shm transfer.)
Two figures per row: bytes ÷ the trace's end-to-end wall time, and bytes ÷ (that
time − the same trace saving one element of the view), the rate of the transfer
itself, on which the target is judged; through shared memory that difference is
a few ms, and a figure within the timing noise is shown as a bound.

Rows:
- streamed (Chunk messages through two gRPC hops), against the ceiling of one
  bare gRPC hop on this machine: a unary-stream server in a process of its own
  (no nnd, no protobuf: ready-made 4 MiB `bytes` messages) and a client that
  copies them into one buffer of the result's size, as nnd's client does;
- shared memory (`shm=True`), repeated traces whose results are dropped before
  the next one: the client's region pool is warm (worker/shm.py, nnd/_shm.py),
  the steady state of a notebook; the first shm trace of a process is
  streamed instead (and so is every one of a client that names no region:
  the row says which it measured). The ceiling is a copy into memory already
  touched. (The client and daemon here are one user: the worker maps the
  region. For a daemon of another user it pwrites instead: docs/protocol.md, 10.5.)

Both against a plain in-process `torch.clone` (a memcpy into fresh memory, page
faults included) and a `copy_` into memory already touched (the bare memcpy).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator

import harness
from harness import PROMPT, Row

NAME = "transfer"
CHUNK = 4 * 1024 * 1024 - 64 * 1024  # nnd's chunk size (wire.CHUNK_SIZE)

# One bare gRPC hop: the server streams `total` bytes in ready-made CHUNK-sized messages.
GRPC_SERVER = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    address, total, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = bytes(total)
    parts = [data[i : i + chunk] for i in range(0, total, chunk)]
    def stream(request, context):
        yield from parts
    handler = grpc.method_handlers_generic_handler(
        "bench.Bytes", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    opts = [("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=opts)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()
    """
)


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


@contextlib.contextmanager
def bare_grpc(nbytes: int) -> Iterator[object]:
    """A callable that receives `nbytes` over one bare gRPC hop into a fresh buffer."""
    import grpc

    folder = tempfile.mkdtemp(prefix="grpc-", dir=harness.workdir())
    address = f"unix://{folder}/bytes.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", GRPC_SERVER, address, str(nbytes), str(CHUNK)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        # The client options nnd's client uses (connection.CHANNEL_OPTIONS).
        opts = [("grpc.max_receive_message_length", 64 * 2**20), ("SingleThreadedUnaryStream", 1)]
        channel = grpc.insecure_channel(address, options=opts)
        call = channel.unary_stream("/bench.Bytes/Stream")

        def receive() -> bytearray:
            out = bytearray(nbytes)
            at = 0
            for part in call(b""):
                out[at : at + len(part)] = part
                at += len(part)
            if at != nbytes:
                raise RuntimeError(f"bare gRPC stream gave {at} bytes, {nbytes} expected")
            return out

        yield receive
        channel.close()
    finally:
        proc.kill()
        proc.wait()


def run(quick: bool) -> list[Row]:
    harness.one_thread()
    import torch

    import nnd

    n = (8 if quick else 64) * 2**20  # float32 values: 32 MiB / 256 MiB
    nbytes = n * 4
    warmup, repeats = (2, 3) if quick else (2, 9)  # the transfer is a small difference of two noisy times
    path = harness.model("gpt2")
    src = torch.randn(n)
    dst = torch.empty_like(src)

    def memcpy() -> torch.Tensor:
        return src.clone()

    def warm_copy() -> torch.Tensor:
        return dst.copy_(src)

    with harness.daemon(NAME) as d, bare_grpc(nbytes) as grpc_hop:
        model = nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)

        def big(shm: bool = False) -> torch.Tensor:
            with model.trace(PROMPT, shm=shm):
                h = model.transformer.h[0].output
                out = h[0, 0, 0].expand(n).save()
            return out

        def big_shm() -> torch.Tensor:
            return big(shm=True)

        def baseline() -> torch.Tensor:
            """The same N-value view in the worker, one element of it saved."""
            with model.trace(PROMPT):
                h = model.transformer.h[0].output
                out = h[0, 0, 0].expand(n)[:1].save()
            return out

        got = big()
        if got.shape != (n,) or got.dtype != torch.float32:
            raise RuntimeError(f"unexpected saved tensor {tuple(got.shape)} {got.dtype}")
        for _ in range(3):  # the first fills the client's region pool; then regions are reused
            if not torch.equal(big_shm(), got):
                raise RuntimeError("the shared-memory result differs from the streamed one")
        if not torch.equal(baseline(), got[:1]):
            raise RuntimeError("the baseline computes something else")
        del got
        from nnd.wire import _shm

        # Whether the client names a region of its pool in its requests (else: results are streamed).
        pool = _shm.pool()
        pooled, created, busy = bool(pool.regions), pool.created, pool.busy
        time.sleep(0.1)
        samples = harness.interleaved_samples(
            {
                "memcpy": memcpy,
                "warm_copy": warm_copy,
                "big": big,
                "big_shm": big_shm,
                "baseline": baseline,
                "grpc_hop": grpc_hop,
            },
            warmup=warmup,
            repeats=repeats,
        )
        t = {k: statistics.median(v) for k, v in samples.items()}
        model.release()
        # While timed: regions made, and traces that found every region still held by an earlier
        # result (0 and 0 when results free their region before the next trace).
        created, busy = pool.created - created, pool.busy - busy

    streamed = max(t["big"] - t["baseline"], 1e-9)
    # Through shared memory the transfer is a few ms, a small difference of two ~100 ms times: take the
    # median of each round's difference, and never claim more than the rounds' spread can resolve.
    shm_measured = statistics.median(a - b for a, b in zip(samples["big_shm"], samples["baseline"], strict=True))
    noise = statistics.median(abs(x - t["baseline"]) for x in samples["baseline"])
    shm = max(shm_measured, noise, 1e-9)
    shm_text = gbps(nbytes, shm) if shm_measured >= noise else f"≥ {gbps(nbytes, shm)}: within the timing noise"
    raw = {k + "_s": v for k, v in t.items()} | {"bytes": nbytes, "repeats": repeats}
    mib = f"{nbytes / 2**20:.0f} MiB"
    return [
        Row(
            f"transfer: saved tensor of {mib} to the client, streamed (end to end; beyond computing it)",
            "torch clone in-process (ceiling)",
            f"{gbps(nbytes, t['memcpy'])} ({gbps(nbytes, t['warm_copy'])} into memory already touched)",
            f"{gbps(nbytes, t['big'])} ({gbps(nbytes, streamed)})",
            t["memcpy"] / streamed,
            target=harness.target("≥ 1.5 GB/s beyond computing it", nbytes / streamed >= 1.5e9),
            raw=raw,
        ),
        Row(
            f"transfer: the same {mib} streamed, against one bare gRPC hop on this machine (a routed client's path is one hop, worker → client)",
            "bare gRPC unary-stream, 4 MiB messages, no nnd",
            gbps(nbytes, t["grpc_hop"]),
            f"{gbps(nbytes, streamed)} (beyond computing it)",
            t["grpc_hop"] / streamed,
        ),
        Row(
            f"transfer: saved tensor of {mib} through shared memory (shm=True), repeated traces: "
            + (
                "streamed (this client names no region)"
                if not pooled
                else "the client's region pool is warm"
                if not created and not busy
                else f"the client's region pool made {created} regions and {busy} of {warmup + repeats} traces "
                "found every region still held by an earlier result (streamed)"
            )
            + " (end to end; beyond computing it)",
            "torch copy_ into memory already touched (ceiling)",
            f"{gbps(nbytes, t['warm_copy'])}",
            f"{gbps(nbytes, t['big_shm'])} ({shm_text})",
            t["warm_copy"] / shm,
            target=harness.target("≥ 4 GB/s beyond computing it", nbytes / shm >= 4e9),
            raw={
                "region_pool": pooled,
                "regions_created": created,
                "regions_busy": busy,
                "shm_transfer_s": shm_measured,
                "baseline_noise_s": noise,
            },
        ),
    ]
