"""concurrency: traces per second on GPT-2 4×64 with 1 client vs 8 concurrent clients.

Each client is its own process with its own nnd connection (threads in one
process would share one GIL and measure the client, not the daemon). Clients
start, warm up, say "ready", and all get "go" together; each runs its traces
(one `.save()` of a layer output each) and reports its monotonic start and end.
Throughput = all traces ÷ (last end − first start). The worker runs one forward
at a time; concurrent compatible traces are merged into one batched forward
(daemon/worker/batching.py, `--batch-window-ms`, default 2 ms), which targets
≥ 2.5× with 8 clients. The same clients also run against a daemon started with
batching off (`--batch-window-ms 0`), and each run reports CPU time per trace
of the clients, the daemon and the worker: on a small machine the clients'
own CPU (recording, gRPC, decoding) bounds what batching in the worker can give.
The row also prints that bound, from figures measured in the same run: the
plain forward of 1 row and of 8 rows in-process, and one client's CPU per
trace; with every trace merged and every core busy, k clients reach at most
cores ÷ (CPU per trace alone − forward(1) + forward(k) ÷ k).

Run as a script (`python bench_concurrency.py ADDRESS MODEL N`) it is one client.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

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
    cpu0 = time.process_time()
    start = time.monotonic()
    for _ in range(n):
        with model.trace(PROMPT):
            h = model.transformer.h[0].output.save()
    end = time.monotonic()
    cpu = time.process_time() - cpu0
    assert h.ndim == 3
    print(json.dumps({"start": start, "end": end, "cpu": cpu}), flush=True)


def _cpu(pids: list[int]) -> float:
    return sum(harness.process_cpu(pid) for pid in pids)


def _merged(d: Any) -> tuple[int, int]:
    """Requests the worker ran merged with others so far, and the merged forwards they ran in (from the
    batcher's log lines)."""
    import glob
    import re

    text = "".join(pathlib.Path(p).read_text(errors="replace") for p in glob.glob(f"{d.state_dir}/logs/*"))
    found = [int(m) for m in re.findall(r"batched (\d+) requests", text)]
    return sum(found), len(found)


def _measure(d: Any, path: str, k: int, n: int) -> dict[str, float]:
    """Traces/s of `k` clients, and CPU ms per trace of the clients, the daemon and the worker."""
    worker = harness.worker_pid(d)
    base: dict[str, float] = {}

    def snapshot() -> None:  # once every client is warm, just before "go"
        base.update(daemon=_cpu([d.proc.pid]), worker=_cpu([worker]), merged=_merged(d))

    tps, client_cpu = _clients(d.address, path, k, n, snapshot)
    daemon0, worker0, (merged0, runs0) = base["daemon"], base["worker"], base["merged"]
    traces = k * n
    merged, runs = _merged(d)
    merged, runs = merged - merged0, runs - runs0
    forwards = traces - merged + runs  # each merged forward ran several requests; every other one ran alone
    return {
        "tps": tps,
        "client_ms": 1e3 * client_cpu / traces,
        "daemon_ms": 1e3 * (_cpu([d.proc.pid]) - daemon0) / traces,
        "worker_ms": 1e3 * (_cpu([worker]) - worker0) / traces,
        "merged_share": merged / traces,
        "per_forward": traces / forwards,
        "load": os.getloadavg()[0],
    }


def _clients(address: str, path: str, k: int, n: int, ready: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """Traces per second of `k` concurrent client processes running `n` traces each, and their CPU seconds."""
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
        ready()
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
    return k * n / wall, sum(s["cpu"] for s in spans)


def _split(m: dict[str, float]) -> str:
    return (
        f"CPU/trace: client {m['client_ms']:.1f} ms, daemon {m['daemon_ms']:.1f} ms, worker {m['worker_ms']:.1f} ms; "
        f"{m['per_forward']:.1f} requests per forward; load {m['load']:.1f}"
    )


def _forward_ms(path: str, rows: tuple[int, ...], repeats: int) -> list[float]:
    """CPU ms of the plain HF forward of PROMPT repeated in each of `rows` batch rows (in this process),
    the mean of `repeats`: CPU time, as the per-trace figures it is set against (wall time on a loaded
    box would count the neighbours)."""
    import torch

    tok, model = harness.hf_model(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = []
    with torch.no_grad():
        for r in rows:
            batch = ids.repeat(r, 1)
            for _ in range(10):
                model(batch)
            cpu0 = time.process_time()
            for _ in range(repeats):
                model(batch)
            out.append(1e3 * (time.process_time() - cpu0) / repeats)
    return out


def _ceiling(one: dict[str, float], k: int, forward_1: float, forward_k: float) -> tuple[float, float]:
    """Traces/s k clients could reach at best on this machine, and that ÷ one client's rate.

    Best case: every trace is merged with k-1 others (its forward costs forward_k / k instead of
    forward_1) and every core is busy; the rest of a trace's CPU (client, daemon, worker) is what one
    client measured. On a machine with fewer cores than processes, this bounds the ratio."""
    alone = one["client_ms"] + one["daemon_ms"] + one["worker_ms"]
    merged = alone - forward_1 + forward_k / k
    tps = (os.cpu_count() or 1) * 1e3 / merged
    return tps, tps / one["tps"]


def run(quick: bool) -> list[Row]:
    import nnd

    k, n = (4, 20) if quick else (8, 100)
    path = harness.model("gpt2", layers=4, width=64)
    results: dict[str, dict[str, float]] = {}
    for label, window in (("off", "0"), ("on", "2")):
        with harness.daemon(f"{NAME}-{label}", "--batch-window-ms", window) as d:
            nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)
            if label == "off":
                results["one"] = _measure(d, path, 1, n)
            results[label] = _measure(d, path, k, n)
    one, off, on = results["one"], results["off"], results["on"]
    forward_1, forward_k = _forward_ms(path, (1, k), 30 if quick else 200)
    best_tps, best_ratio = _ceiling(one, k, forward_1, forward_k)
    raw = {"clients": k, "traces_per_client": n, **{f"{a}_{b}": v for a, r in results.items() for b, v in r.items()}}
    raw |= {"forward_1_ms": forward_1, f"forward_{k}_ms": forward_k, "ceiling_tps": best_tps}
    ratio = on["tps"] / one["tps"]
    return [
        Row(
            f"concurrency: traces/s, GPT-2 4×64, {n} traces per client, {k} clients, batching off",
            f"1 client ({_split(one)})",
            f"{one['tps']:.0f}/s",
            f"{off['tps']:.0f}/s ({_split(off)})",
            off["tps"] / one["tps"],
            raw=raw,
        ),
        Row(
            f"concurrency: traces/s, GPT-2 4×64, {n} traces per client, {k} clients, batching on (2 ms)",
            "1 client",
            f"{one['tps']:.0f}/s",
            f"{on['tps']:.0f}/s ({on['merged_share']:.0%} of traces merged; {_split(on)}; ceiling on this machine "
            f"{best_tps:.0f}/s = {best_ratio:.2f}×: forward {forward_1:.2f} ms for 1 row, {forward_k:.2f} ms for {k}, "
            f"on {os.cpu_count()} cores)",
            ratio,
            target=harness.target("≥ 2.5", ratio >= 2.5),
        ),
    ]


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: bench_concurrency.py ADDRESS MODEL N (run.py runs the benchmark)")
    _client(sys.argv[1], sys.argv[2], int(sys.argv[3]))
