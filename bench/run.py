"""Run nnd's benchmarks side by side and print one markdown table.

    python bench/run.py [--quick] [--only NAME[,NAME...]] [--json OUT]

Each benchmark runs in a fresh Python process of its own (so one's memory and
warm caches do not colour the next); models are built once per run into a temp
folder they share, removed at the end. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import harness  # noqa: E402  (sets OMP_NUM_THREADS & co. before anything imports torch)

# Table order; each module has NAME and run(quick) -> list[Row].
MODULES = {
    "trace": "bench_trace",
    "sync": "bench_sync",
    "generate": "bench_generate",
    "scan-8b": "bench_scan8b",
    "load-rss": "bench_load_rss",
    "start": "bench_start",
    "transfer": "bench_transfer",
    "concurrency": "bench_concurrency",
    "fairness": "bench_fairness",
    "import": "bench_import",
    "gpu": "bench_gpu",  # one "no GPU" row without CUDA
}

NOTES = [
    "ratio = nnd ÷ alternative (times, bytes: lower is better; GB/s and traces/s: higher is better).",
    "Models are tests/support/tinymodels.py builds with random weights and a 320-token vocabulary, so the "
    "embedding and lm_head are tiny: 'GPT-2 12×768' has GPT-2-small's blocks but ~85M parameters (341 MB).",
    "Timings: warm-up, then the median of N, alternatives interleaved with nnd; torch uses one thread "
    "everywhere (torch.set_num_threads(1) in-process, OMP_NUM_THREADS=1 for the daemon and its workers).",
]


def _child(name: str, quick: bool, out: str) -> int:
    import importlib

    module = importlib.import_module(MODULES[name])
    rows = module.run(quick)
    pathlib.Path(out).write_text(json.dumps([r.to_json() for r in rows]))
    return 0


def _run_one(name: str, quick: bool, env: dict[str, str], python: str) -> tuple[list[harness.Row], float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    t0 = time.perf_counter()
    cmd = [python, __file__, "--child", name, "--child-out", out] + (["--quick"] if quick else [])
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    try:
        if res.returncode != 0:
            tail = "\n".join(res.stdout.strip().splitlines()[-15:])
            print(f"[{name}] failed ({res.returncode}):\n{tail}", file=sys.stderr)
            last = (res.stdout.strip().splitlines() or ["?"])[-1][:120]
            return [harness.Row(name, "-", "-", f"error: {last}")], wall
        rows = [harness.Row(**r) for r in json.loads(pathlib.Path(out).read_text())]
        return rows, wall
    finally:
        os.unlink(out)


def _src_python(src: str) -> str:
    """An interpreter that imports nnd and nnd_daemon from the source tree `src`: a virtual environment
    (in the bench's temp folder) that sees this Python's packages, with `src` installed into it editable.
    Workers run as `sys.executable -I -m nnd_daemon.worker`, and -I ignores PYTHONPATH: only an
    interpreter of its own makes the daemon's workers run `src` too, not the installed nnd."""
    root = pathlib.Path(src).resolve()
    if not (root / "pyclient" / "nnd").is_dir() or not (root / "daemon").is_dir():
        raise SystemExit(f"--src {src}: not an nnd source tree (no pyclient/nnd or daemon/)")
    venv = harness.workdir() / "src-venv"
    python = venv / "bin" / "python"
    print(f"[src] an environment for {root} in {venv}...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-e", str(root)]
    subprocess.run(pip, check=True)
    where = subprocess.run(
        [str(python), "-I", "-c", "import nnd_daemon; print(nnd_daemon.__file__)"], capture_output=True, text=True
    ).stdout.strip()
    if not where.startswith(str(root)):
        raise SystemExit(f"--src {src}: a worker there would import nnd_daemon from {where or '?'}, not from {root}")
    return str(python)


def _nnd_source(env: dict[str, str], python: str) -> str:
    """Where the benchmarked nnd came from, and its git commit when that is a checkout."""
    code = (
        "import nnd, nnd_daemon, os; print(os.path.realpath(os.path.join(os.path.dirname(nnd.__file__), '..', '..')))"
    )
    res = subprocess.run([python, "-I", "-c", code], env=env, capture_output=True, text=True)
    where = res.stdout.strip() or "?"

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True).stdout.strip()

    top = git("rev-parse", "--show-toplevel")
    if not top:
        return where
    commit = git("log", "-1", "--format=%h")
    dirty = git("status", "--porcelain", "--", "pyclient", "daemon", "protos")
    return f"{top} at {commit}" + (" with uncommitted changes to pyclient/daemon/protos" if dirty else "")


def table(rows: list[harness.Row]) -> str:
    header = ["benchmark", "alternative", "alternative figure", "nnd figure", "ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models, few repeats: a smoke test (< 2 min)")
    parser.add_argument("--only", help=f"comma-separated benchmarks: {', '.join(MODULES)}")
    parser.add_argument("--json", metavar="OUT", help="also write machine + rows (with raw numbers) as JSON")
    parser.add_argument(
        "--src",
        metavar="DIR",
        help="benchmark the nnd source tree in DIR (e.g. `git archive HEAD | tar -x -C DIR`) instead of the "
        "installed one: it is installed into a virtual environment of the run's own, whose Python runs the "
        "client, the daemon and its workers",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        return _child(ns.child, ns.quick, ns.child_out)

    names = list(MODULES)
    if ns.only:
        names = [n.strip() for n in ns.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODULES]
        if unknown:
            parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")

    env = {**os.environ, "NND_BENCH_WORKDIR": str(harness.workdir())}
    python = _src_python(ns.src) if ns.src else sys.executable
    source = _nnd_source(env, python)
    rows: list[harness.Row] = []
    walls: dict[str, float] = {}
    failed = False
    try:
        for name in names:
            print(f"[{name}] running{' (quick)' if ns.quick else ''}...", file=sys.stderr, flush=True)
            got, walls[name] = _run_one(name, ns.quick, env, python)
            failed |= any(r.nnd.startswith("error:") for r in got)
            print(f"[{name}] {walls[name]:.0f} s", file=sys.stderr, flush=True)
            rows += got
    finally:
        harness.cleanup()

    info = harness.machine()
    info["nnd_source"] = source
    print(table(rows))
    print()
    print(
        f"Machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, torch {info['torch']}, "
        f"transformers {info['transformers']}, nnsight {info.get('nnsight', '-')}; {info['date']}; "
        f"load average at the end {info.get('load', '?')}{'; --quick' if ns.quick else ''}."
    )
    print(f"nnd from {info['nnd_source']}.")
    for note in NOTES:
        print(f"- {note}")
    if ns.json:
        data = {"machine": info, "quick": ns.quick, "wall_s": walls, "rows": [r.to_json() for r in rows]}
        pathlib.Path(ns.json).write_text(json.dumps(data, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
