"""concurrency: traces per second on GPT-2 4×64 with 1 client vs 8 concurrent clients.

Each client is its own process with its own nnd connection (threads in one
process would share one GIL and measure the client, not the daemon). Clients
start and warm up once, then run rounds: on "go" each runs its traces (one
`.save()` of a layer output each) and reports its monotonic start and end.
Throughput = all traces ÷ (last end − first start). The worker runs one forward
at a time; concurrent compatible traces are merged into one batched forward
(daemon/worker/batching.py, `--batch-window-ms`, default 2 ms), which targets
≥ 2.5× with 8 clients. Two daemons run side by side, one with batching off
(`--batch-window-ms 0`) and one on; each round measures one client (on the
batching-off daemon: no window to wait for), eight with batching off and eight
with it on, back to back, so the ratio of a round compares figures taken within
seconds of each other: on this VM the speed of the same loop drifts by 2× over
minutes, which one measurement of each would read as a change of ratio. The row
gives the median of the rounds' ratios and each round's.

Each cell also reports CPU time per trace of the clients, the daemon and the
worker: on a small machine the clients' own CPU (recording, gRPC, decoding)
bounds what batching in the worker can give. The row also prints that bound,
from figures measured in the same run: the plain forward of 1 row and of 8 rows
in-process, and one client's CPU per trace; with every trace merged and every
core busy, k clients reach at most cores ÷ (CPU per trace alone − forward(1) +
forward(k) ÷ k).

Run as a script (`python bench_concurrency.py ADDRESS MODEL N`) it is one client.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
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
    while sys.stdin.readline().strip() == "go":  # one line per round; EOF ends the client
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


class _Clients:
    """`k` warm client processes on one daemon, kept for every round."""

    def __init__(self, d: Any, path: str, k: int, n: int) -> None:
        self.d, self.n, self.worker = d, n, harness.worker_pid(d)
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, d.address, path, str(n)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(k)
        ]
        for p in self.procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client failed to start: {self._stderr(p)}")

    @staticmethod
    def _stderr(p: subprocess.Popen[str]) -> list[str]:
        p.kill()
        return p.communicate()[1].strip().splitlines()[-1:]

    def round(self, k: int) -> dict[str, float]:
        """Traces/s of the first `k` clients together, and CPU ms per trace of the clients, the daemon and
        the worker, with how the batcher merged them."""
        procs = self.procs[:k]
        daemon0, worker0, (merged0, runs0) = _cpu([self.d.proc.pid]), _cpu([self.worker]), _merged(self.d)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        spans = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a client failed: {self._stderr(p)}")
            spans.append(json.loads(line))
        traces = k * self.n
        wall = max(s["end"] for s in spans) - min(s["start"] for s in spans)
        merged, runs = _merged(self.d)
        merged, runs = merged - merged0, runs - runs0
        forwards = traces - merged + runs  # each merged forward ran several requests; every other one ran alone
        return {
            "tps": traces / wall,
            "client_ms": 1e3 * sum(s["cpu"] for s in spans) / traces,
            "daemon_ms": 1e3 * (_cpu([self.d.proc.pid]) - daemon0) / traces,
            "worker_ms": 1e3 * (_cpu([self.worker]) - worker0) / traces,
            "merged_share": merged / traces,
            "per_forward": traces / forwards,
            "load": os.getloadavg()[0],
        }

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _median(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The round with the median traces/s (its other figures with it, so a cell reads as one measurement)."""
    return sorted(rounds, key=lambda m: m["tps"])[len(rounds) // 2]


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

    k, n, rounds = (4, 20, 1) if quick else (8, 100, 5)
    path = harness.model("gpt2", layers=4, width=64)
    measured: dict[str, list[dict[str, float]]] = {"one": [], "off": [], "on": []}
    with contextlib.ExitStack() as stack:
        pools = {}
        for label, window in (("off", "0"), ("on", "2")):
            d = stack.enter_context(harness.daemon(f"{NAME}-{label}", "--batch-window-ms", window))
            nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)
            pools[label] = _Clients(d, path, k, n)
            stack.callback(pools[label].close)
        for _ in range(rounds):
            measured["one"].append(pools["off"].round(1))
            measured["off"].append(pools["off"].round(k))
            measured["on"].append(pools["on"].round(k))
    ratios = [on["tps"] / one["tps"] for one, on in zip(measured["one"], measured["on"], strict=True)]
    ratios_off = [off["tps"] / one["tps"] for one, off in zip(measured["one"], measured["off"], strict=True)]
    ratio, ratio_off = statistics.median(ratios), statistics.median(ratios_off)
    one, off, on = (_median(measured[label]) for label in ("one", "off", "on"))
    forward_1, forward_k = _forward_ms(path, (1, k), 30 if quick else 200)
    best_tps, best_ratio = _ceiling(one, k, forward_1, forward_k)
    raw: dict[str, Any] = {"clients": k, "traces_per_client": n, "rounds": measured, "ratios": ratios}
    raw |= {f"{a}_{b}": v for a, r in (("one", one), ("off", off), ("on", on)) for b, v in r.items()}
    raw |= {"forward_1_ms": forward_1, f"forward_{k}_ms": forward_k, "ceiling_tps": best_tps}
    each = ", ".join(f"{r:.2f}×" for r in ratios)
    return [
        Row(
            f"concurrency: traces/s, GPT-2 4×64, {n} traces per client, {k} clients, batching off",
            f"1 client ({_split(one)})",
            f"{one['tps']:.0f}/s",
            f"{off['tps']:.0f}/s ({_split(off)})",
            ratio_off,
        ),
        Row(
            f"concurrency: traces/s, GPT-2 4×64, {n} traces per client, {k} clients, batching on (2 ms)",
            "1 client",
            f"{one['tps']:.0f}/s",
            f"{on['tps']:.0f}/s ({on['merged_share']:.0%} of traces merged; {_split(on)}; ceiling on this machine "
            f"{best_tps:.0f}/s = {best_ratio:.2f}×: forward {forward_1:.2f} ms for 1 row, {forward_k:.2f} ms for {k}, "
            f"on {os.cpu_count()} cores)",
            ratio,
            target=harness.target("≥ 2.5", ratio >= 2.5)
            + f" (median of {rounds} paired rounds, 1 client then {k} back to back: {each}; cells: the median round)",
            raw=raw,
        ),
    ]


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: bench_concurrency.py ADDRESS MODEL N (run.py runs the benchmark)")
    _client(sys.argv[1], sys.argv[2], int(sys.argv[3]))
