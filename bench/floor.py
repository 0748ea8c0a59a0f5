"""The floor: a minimal out-of-process tracer, written for the bench.

One unary gRPC call over a unix socket carries the prompt; the server (a
process of its own, the model loaded once) tokenizes it, runs the forward with
one forward hook on a layer, and sends that layer's output back as raw bytes
with its shape. No graph, no limits, no queue, no batching: what any
out-of-process tracer must pay on this machine. nnd's overhead is judged
against it (target: within 1.5× of the floor's) in the same run.

    python bench/floor.py serve MODEL_DIR SOCKET LAYER   # the server (FloorTracer starts it)
"""

from __future__ import annotations

import atexit
import os
import struct
import subprocess
import sys
import time
from typing import Any

_METHOD = "/floor.Floor/Trace"
# Also a bidi echo: what one round trip on an open stream costs here (a sync point's floor).


def _serve(path: str, socket: str, layer: int) -> None:
    from concurrent import futures

    import grpc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    module = model.transformer.h[layer]

    def trace(request: bytes, _context: Any) -> bytes:
        got: list[torch.Tensor] = []
        handle = module.register_forward_hook(lambda _m, _i, out: got.append(out[0] if isinstance(out, tuple) else out))
        try:
            with torch.no_grad():
                model(**tok(request.decode(), return_tensors="pt"))
        finally:
            handle.remove()
        value = got[0].contiguous()
        header = struct.pack("<B", value.dim()) + struct.pack(f"<{value.dim()}q", *value.shape)
        return header + value.numpy().tobytes()

    def echo(requests: Any, _context: Any) -> Any:
        yield from requests  # each message straight back: one round trip on an open bidi stream

    handler = grpc.method_handlers_generic_handler(
        "floor.Floor",
        {"Trace": grpc.unary_unary_rpc_method_handler(trace), "Echo": grpc.stream_stream_rpc_method_handler(echo)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


class FloorTracer:
    """The client side: `trace(prompt)` is one call, returning the layer's output as a tensor."""

    def __init__(self, path: str, socket: str, layer: int) -> None:
        import grpc

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # Its stderr is not ours: a server left behind must not hold the bench's output pipe open.
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", path, socket, str(layer)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        atexit.register(self.close)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the floor tracer's server did not start")
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        self._call = self.channel.unary_unary(_METHOD)
        deadline = time.monotonic() + 30
        while True:
            try:
                self._call(b"warm", timeout=5)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def open_echo(self) -> Any:
        """A bidi stream kept open; `round_trip()` sends one small message on it and waits for it back."""
        import queue

        outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        replies = self.channel.stream_stream("/floor.Floor/Echo")(iter(outbox.get, None))

        def round_trip() -> None:
            outbox.put(b"x" * 16)
            next(replies)

        round_trip.close = lambda: outbox.put(None)  # type: ignore[attr-defined]
        return round_trip

    def trace(self, prompt: str) -> Any:
        import torch

        data = self._call(prompt.encode())
        dim = data[0]
        shape = struct.unpack_from(f"<{dim}q", data, 1)
        return torch.frombuffer(bytearray(data[1 + 8 * dim :]), dtype=torch.float32).reshape(shape)

    def close(self) -> None:
        if self.proc.poll() is None:
            channel = getattr(self, "channel", None)
            if channel is not None:
                channel.close()
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "serve":
    _serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
