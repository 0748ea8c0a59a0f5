"""concurrency: traces per second on GPT-2 4×64 with 1 client vs 8 concurrent clients.

Each client is its own process with its own nnd connection (threads in one
process would share one GIL and measure the client, not the daemon). Clients
start and warm up once, then run rounds: on "go" each runs its traces (one
`.save()` of a layer output each) and reports its monotonic start and end.
Throughput = all traces ÷ (last end − first start). The worker runs one forward
at a time; concurrent compatible traces are merged into one batched forward
(daemon/worker/batching.py, `--batch-window-ms`, default 2 ms), which targets
≥ 2.5× with 8 clients. Two daemons run side by side, one with batching off
(`--batch-window-ms 0`) and one on; each round measures eight clients with
batching off and eight with it on between two runs of one client (on the
batching-off daemon: no window to wait for), and sets them against the
geometric mean of those two, so the ratio of a round compares figures taken
within seconds of each other: on this VM the speed of the same loop drifts by
2× over minutes (and by 1.5× within a round), which one measurement of each
would read as a change of ratio. The row gives the median of the rounds'
ratios and each round's.

Each cell also reports CPU time per trace of the clients, the daemon and the
worker, and the row prints what that CPU allows: the worker serves on one
thread, so it passes at most 1000 ÷ (its CPU ms per trace) traces a second, and
all cores busy pass at most cores × 1000 ÷ (client + daemon + worker CPU ms per
trace), both from the batching round itself. (It used to set in-process forwards
of 1 and 8 rows against one client's CPU; the two are taken minutes apart, and on
this VM a forward's CPU after a sleep differs by 2x, which once gave a "ceiling"
of 16x.)

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


def _ceiling(on: dict[str, float], one: dict[str, float]) -> tuple[float, float, float]:
    """What the batching round's own CPU per trace allows on this machine: the worker serves on one
    thread (one forward at a time, its handling under the GIL), so it passes at most 1000 / its CPU ms
    per trace; all cores busy pass at most cores x 1000 / (client + daemon + worker CPU ms per trace).
    Returns (the lower of the two, that / one client's traces/s, the all-cores figure)."""
    worker = 1e3 / on["worker_ms"]
    cores = (os.cpu_count() or 1) * 1e3 / (on["client_ms"] + on["daemon_ms"] + on["worker_ms"])
    best = min(worker, cores)
    return best, best / one["tps"], cores


def run(quick: bool) -> list[Row]:
    import nnd

    k, n, rounds = (4, 20, 1) if quick else (8, 100, 7)
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
        measured["one"].append(pools["off"].round(1))  # each round's 8-client figures are bracketed
    # A round's one-client figure: the geometric mean of the one-client runs just before and just after its
    # eight-client ones (the VM's speed drifts within a round too).
    brackets = [
        (before["tps"] * after["tps"]) ** 0.5 for before, after in zip(measured["one"][:-1], measured["one"][1:], strict=True)
    ]
    ratios = [on["tps"] / one for one, on in zip(brackets, measured["on"], strict=True)]
    ratios_off = [off["tps"] / one for one, off in zip(brackets, measured["off"], strict=True)]
    ratio, ratio_off = statistics.median(ratios), statistics.median(ratios_off)
    one, off, on = (_median(measured[label]) for label in ("one", "off", "on"))
    best_tps, best_ratio, cores_tps = _ceiling(on, one)
    raw: dict[str, Any] = {"clients": k, "traces_per_client": n, "rounds": measured, "ratios": ratios}
    raw |= {f"{a}_{b}": v for a, r in (("one", one), ("off", off), ("on", on)) for b, v in r.items()}
    raw |= {"ceiling_tps": best_tps, "cores_tps": cores_tps}
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
            f"{on['tps']:.0f}/s ({on['merged_share']:.0%} of traces merged; {_split(on)}; ceiling at this CPU per "
            f"trace {best_tps:.0f}/s = {best_ratio:.2f}×: the worker's one thread at {on['worker_ms']:.1f} ms a trace; "
            f"all {os.cpu_count()} cores would pass {cores_tps:.0f}/s)",
            ratio,
            target=harness.target("≥ 2.5", ratio >= 2.5)
            + f" (median of {rounds} rounds, {k} clients between two 1-client runs: {each}; cells: the median runs)",
            raw=raw,
        ),
    ]


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: bench_concurrency.py ADDRESS MODEL N (run.py runs the benchmark)")
    _client(sys.argv[1], sys.argv[2], int(sys.argv[3]))
