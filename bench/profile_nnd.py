"""Where an nnd request's time goes: client (cProfile), daemon and worker (stack sampling).

    python bench/profile_nnd.py [trace|sync|generate|transfer] [--n N] [--layers L --width W] [--top K]

Runs N requests of one benchmark's shape against a real daemon whose processes
sample their stacks (bench/sampler/sitecustomize.py), profiles the client with
cProfile, and prints for each process the file:line where its busy samples sit
(self) and the nnd functions they pass through (cumulative). Not part of run.py.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pathlib
import pstats
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import harness  # noqa: E402

SAMPLER = pathlib.Path(__file__).resolve().parent / "sampler"
NND_PATHS = ("/nnd/", "nnd_daemon", "/daemon/", "/pyclient/")
# A thread is serving a request when its stack passes through one of these.
HANDLERS = {"daemon": "control/servicer.py", "worker": "worker/"}


def _short(key: str) -> str:
    path, _, rest = key.partition(":")
    for marker in ("/site-packages/", "/pyclient/", "/work/main/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{rest}"


def _is_nnd(key: str) -> bool:
    return any(p in key for p in NND_PATHS) and "/bench/" not in key


def _report_samples(label: str, path: pathlib.Path, handler: str, n_requests: int, top: int) -> None:
    lines = path.read_text().splitlines()
    ticks, seconds = int(lines[0].split()[2]), float(lines[0].split()[4])
    ms_per_sample = 1e3 * seconds / max(ticks, 1)
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for line in lines[1:]:
        stack, _, n = line.rpartition(" ")
        frames = tuple(stack.split(";"))
        if any(handler in f for f in frames):  # threads serving a request
            stacks[frames] += int(n)
    total = sum(stacks.values())
    per = ms_per_sample / n_requests
    print(
        f"\n## {label}: {total} samples of request-serving threads ({ms_per_sample:.2f} ms apart; "
        f"~{total * per:.1f} ms of thread time per request)"
    )
    if not total:
        return
    self_: collections.Counter[str] = collections.Counter()
    cum: collections.Counter[str] = collections.Counter()
    for frames, n in stacks.items():
        self_[frames[-1]] += n
        for f in set(frames):
            if _is_nnd(f):
                cum[f] += n
    print("self (innermost frame: file:line function) — ms per request, share:")
    for key, n in self_.most_common(top):
        print(f"  {n * per:6.2f} ms {100 * n / total:5.1f}%  {_short(key)}")
    print("cumulative through nnd lines — ms per request, share:")
    for key, n in cum.most_common(top):
        print(f"  {n * per:6.2f} ms {100 * n / total:5.1f}%  {_short(key)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="trace", choices=["trace", "sync", "generate", "transfer"])
    parser.add_argument("--n", type=int, default=100, help="requests to profile")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--top", type=int, default=15)
    ns = parser.parse_args()

    harness.one_thread()
    import torch

    import nnd

    layers, width = (2, 64) if ns.what == "transfer" else (ns.layers, ns.width)
    path = harness.model("gpt2", layers=layers, width=width)
    mid = layers // 2
    samples = pathlib.Path(tempfile.mkdtemp(prefix="samples-", dir=harness.workdir()))
    saved_env = dict(os.environ)
    os.environ["NND_BENCH_SAMPLE_DIR"] = str(samples)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SAMPLER), os.environ.get("PYTHONPATH")]))
    os.environ["NND_WORKER_SAMPLER"] = str(SAMPLER)  # workers run under `python -I`: they load it themselves
    try:
        with harness.daemon("profile") as d:
            os.environ.clear()
            os.environ.update(saved_env)  # the CLI and client are not sampled
            model = nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)
            daemon_pid, worker = d.proc.pid, harness.worker_pid(d)

            def once() -> None:
                if ns.what == "trace":
                    with model.trace(harness.PROMPT):
                        model.transformer.h[mid].output.save()
                elif ns.what == "sync":  # one sync point: the trace becomes an Interact stream
                    with model.trace(harness.PROMPT):
                        model.transformer.h[mid].output.sum().item()
                        model.transformer.h[mid].output.save()
                elif ns.what == "generate":
                    with model.generate(harness.PROMPT, max_new_tokens=32) as tracer:
                        for _ in tracer.iter[:]:
                            model.transformer.h[mid].output.save()
                else:
                    with model.trace(harness.PROMPT):
                        model.transformer.h[0].output[0, 0, 0].expand(64 * 2**20).clone().save()

            for _ in range(3):
                once()
            (samples / "epoch").write_text("measure")  # the samplers forget everything before
            time.sleep(1.0)
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(ns.n):
                once()
            prof.disable()
            wall = time.perf_counter() - t0
            time.sleep(1.5)  # let the samplers write their last second
            print(f"# {ns.what}: {ns.n} requests, GPT-2 {layers}×{width}: {1e3 * wall / ns.n:.1f} ms each")
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("tottime").print_stats(ns.top)
            stats.sort_stats("cumulative").print_stats(ns.top)
            print("\n## client (cProfile; times are the whole run, divide by N)")
            print(buf.getvalue())
            for label, pid in (("daemon", daemon_pid), ("worker", worker)):
                f = samples / f"{pid}.txt"
                if f.exists():
                    _report_samples(f"{label} (pid {pid})", f, HANDLERS[label], ns.n, ns.top)
                else:
                    print(f"\n## {label}: no samples written")
            model.release()
            del torch
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        harness.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
