"""start: how long a worker takes to start, forked from the fork server against exec.

`nnd dispatch MODEL --device cpu` (the CLI, wall clock until the model answers)
on two daemons side by side: the default, whose workers fork from a process that
imported torch and transformers once (control/forking.py), and one started with
`--worker-start exec`, whose workers are fresh interpreters as before. Each
dispatch is followed by a release, so every one starts a new worker. The floor is
what any process that loads the model pays: a fresh `python -c "import torch,
transformers; from_pretrained(MODEL)"`. The same CLI call's own start (`nnd ps`)
is measured too, since it is part of both nnd figures.

Also the workers' memory: PSS (proportional set size: pages shared with the fork
server counted by share), the fair figure when several workers run beside it.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import harness
from harness import Row, mbytes, secs

NAME = "start"

LOAD = "import sys, torch, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])"


def _dispatches(d: Any, path: str, repeats: int) -> tuple[list[float], list[int]]:
    """`repeats` dispatches of a loaded model, each released again (a new worker every time)."""
    import psutil

    walls, pss = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        d.cli("dispatch", path, "--device", "cpu")
        walls.append(time.perf_counter() - t0)
        pss.append(psutil.Process(harness.worker_pid(d)).memory_full_info().pss)
        d.cli("release", path)
    return walls, pss


def _cli_floor(d: Any, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        d.cli("ps")
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def run(quick: bool) -> list[Row]:
    harness.one_thread()
    repeats = 2 if quick else 5
    layers, width = 4, 64
    path = harness.model("gpt2", layers=layers, width=width)
    fresh = harness.subprocess_seconds([sys.executable, "-c", LOAD, path], repeats=repeats)
    with harness.daemon(NAME) as forked, harness.daemon(NAME + "-exec", "--worker-start", "exec") as execd:
        for d in (forked, execd):
            d.cli("load", path, "--device", "cpu")
        fork_walls, fork_pss, exec_walls, exec_pss = [], [], [], []
        for _ in range(repeats):  # interleaved: the box's moment weighs on both alike
            w, p = _dispatches(forked, path, 1)
            fork_walls += w
            fork_pss += p
            w, p = _dispatches(execd, path, 1)
            exec_walls += w
            exec_pss += p
        cli = _cli_floor(forked, repeats)
    fork, exe = statistics.median(fork_walls), statistics.median(exec_walls)
    fpss, epss = statistics.median(fork_pss), statistics.median(exec_pss)
    shape = f"GPT-2 {layers}×{width}"
    raw = {"fork_s": fork_walls, "exec_s": exec_walls, "fresh_from_pretrained_s": fresh, "cli_s": cli,
           "fork_pss": fork_pss, "exec_pss": exec_pss}
    return [
        Row(
            f"start: `nnd dispatch` ({shape}, CLI wall clock; a `nnd ps` costs {secs(cli)})",
            "the same daemon with --worker-start exec",
            secs(exe),
            secs(fork),
            fork / exe,
            raw=raw,
        ),
        Row(
            f"start: the same dispatch against a fresh process's from_pretrained ({shape})",
            "python -c 'import torch, transformers; from_pretrained'",
            secs(fresh),
            secs(fork),
            fork / fresh,
        ),
        Row(
            f"start: a dispatched worker's PSS ({shape}, pages shared with the fork server counted by share)",
            "the same worker started by exec",
            mbytes(epss),
            mbytes(fpss),
            fpss / epss,
        ),
    ]


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print(row.cells())
