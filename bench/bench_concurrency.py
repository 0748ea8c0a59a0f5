"""concurrency: traces per second on the tiny model with 1 client vs 8 concurrent clients.

Each client is its own process with its own nnd connection (threads in one
process would share one GIL and measure the client, not the daemon). Clients
start, warm up, say "ready", and all get "go" together; each runs its traces
(one `.save()` of a layer output each) and reports its monotonic start and end.
Throughput = all traces ÷ (last end − first start). The worker runs one request
at a time today; a later batching feature targets ≥ 3× with 8 clients.

Run as a script (`python bench_concurrency.py ADDRESS MODEL N`) it is one client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import harness
from harness import PROMPT, Row

NAME = "concurrency"


def _client(address: str, path: str, n: int) -> None:
    harness.one_thread()
    import nnd

    model = nnd.TransformersModel(path, address=address)
    for _ in range(3):
        with model.trace(PROMPT):
            h = model.transformer.h[0].output.save()
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    for _ in range(n):
        with model.trace(PROMPT):
            h = model.transformer.h[0].output.save()
    end = time.monotonic()
    assert h.ndim == 3
    print(json.dumps({"start": start, "end": end}), flush=True)


def _clients(address: str, path: str, k: int, n: int) -> float:
    """Traces per second of `k` concurrent client processes running `n` traces each."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, address, path, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(k)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client failed to start: {p.communicate()[1].strip().splitlines()[-1:]}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        spans = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"a client failed: {err.strip().splitlines()[-1:]}")
            spans.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    return k * n / wall


def run(quick: bool) -> list[Row]:
    import nnd

    k, n = (4, 20) if quick else (8, 100)
    path = harness.model("gpt2")
    with harness.daemon(NAME) as d:
        nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)
        one = _clients(d.address, path, 1, n)
        many = _clients(d.address, path, k, n)
    raw = {"clients": k, "traces_per_client": n, "one_tps": one, "many_tps": many}
    ratio = many / one
    return [
        Row(
            f"concurrency: traces/s, tiny GPT-2 2×64, {n} traces per client",
            "1 client",
            f"{one:.0f}/s",
            f"{many:.0f}/s ({k} clients)",
            ratio,
            target=harness.target("≥ 3 (later batching)", ratio >= 3),
            raw=raw,
        )
    ]


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: bench_concurrency.py ADDRESS MODEL N (run.py runs the benchmark)")
    _client(sys.argv[1], sys.argv[2], int(sys.argv[3]))
