"""What every benchmark shares: environment, timing, tiny models, daemons, RSS sampling, rows.

Fairness rules, applied here once:
- one torch thread in-process (`torch.set_num_threads(1)`) and OMP_NUM_THREADS=1 in
  every process we start (the daemon passes it on to its workers);
- a warm-up, then the median of N; alternatives are timed interleaved with nnd
  (round-robin), so a noisy neighbour hurts both sides alike.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

# Before torch is imported anywhere in this process or its children.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BENCH = pathlib.Path(__file__).resolve().parent
ROOT = BENCH.parent
TESTS = ROOT / "tests" / "support"  # tinymodels
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

PROMPT = "The Eiffel Tower is in the city of"
MB = 1e6


def one_thread() -> None:
    """One torch thread in this process, and no progress bars or deprecation chatter."""
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*deprecated.*")


# ---------------------------------------------------------------- rows


@dataclass
class Row:
    """One line of the table. `ratio` is nnd ÷ alternative unless `ratio_note` says otherwise."""

    benchmark: str
    alternative: str
    alt: str
    nnd: str
    ratio: float | None = None
    target: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    def cells(self) -> list[str]:
        if self.ratio is None:
            ratio = "n/a"
        else:
            ratio = f"{self.ratio:.2f}×"
        if self.target:
            ratio += f" ({self.target})"
        return [self.benchmark, self.alternative, self.alt, self.nnd, ratio]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def plus_ms(seconds: float) -> str:
    """A signed difference: '+3.2 ms', '-0.9 ms'."""
    return f"{seconds * 1e3:+.1f} ms"


def secs(seconds: float) -> str:
    return f"{seconds:.2f} s"


def mbytes(n: float) -> str:
    return f"{n / MB:.0f} MB"


def target(text: str, ok: bool | None) -> str:
    """'target ≤ 1.25 ✓' (None: not measured)."""
    return f"target {text}" + ("" if ok is None else (" ✓" if ok else " ✗"))


# ---------------------------------------------------------------- timing


def median_time(fn: Callable[[], Any], *, warmup: int, repeats: int) -> float:
    """Median seconds of `repeats` calls after `warmup` calls."""
    return interleaved({"x": fn}, warmup=warmup, repeats=repeats)["x"]


def interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds per function, the functions called round-robin."""
    return {k: statistics.median(v) for k, v in interleaved_samples(fns, warmup=warmup, repeats=repeats).items()}


def _rounds(fns: dict[str, Callable[[], Any]], repeats: int) -> Iterator[list[tuple[str, Callable[[], Any]]]]:
    """`repeats` rounds, each calling every function once in an order shuffled per round (seeded):
    no function always runs right after the same other one (whose caches or sleep it would inherit)."""
    import random

    rng = random.Random(0)
    items = list(fns.items())
    for _ in range(repeats):
        rng.shuffle(items)
        yield list(items)


def interleaved_samples(fns: dict[str, Callable[[], Any]], *, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Every call's seconds per function, the functions called round-robin in a shuffled order
    (sample i of each is one round)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for items in _rounds(fns, repeats):
        for k, fn in items:
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def paired_over(samples: dict[str, list[float]], base: str = "plain") -> dict[str, float]:
    """Each function's extra over `base`: the median of its per-round differences (samples from
    interleaved_samples, sample i of each one round). A box whose speed drifts between rounds moves
    both alike, where a difference of two medians carries that drift whole."""
    return {k: statistics.median(a - b for a, b in zip(v, samples[base], strict=True)) for k, v in samples.items()}


def median_interval(diffs: list[float], draws: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of `diffs` resampled with replacement."""
    return _bootstrap_90(lambda rng: statistics.median(rng.choices(diffs, k=len(diffs))), draws)


def ratio_interval(
    samples: dict[str, list[float]], top: str, bottom: str, base: str = "plain", draws: int = 2000
) -> tuple[float, float]:
    """90% interval (bootstrap over rounds) of paired_over's `top` extra ÷ its `bottom` extra."""
    n = len(samples[base])

    def ratio(rng: Any) -> float:
        rounds = rng.choices(range(n), k=n)
        over_top = statistics.median(samples[top][i] - samples[base][i] for i in rounds)
        over_bottom = statistics.median(samples[bottom][i] - samples[base][i] for i in rounds)
        return over_top / over_bottom if over_bottom > 0 else float("inf")

    return _bootstrap_90(ratio, draws)


def _bootstrap_90(statistic: Callable[[Any], float], draws: int) -> tuple[float, float]:
    """The 5th and 95th percentiles of `statistic(rng)` over `draws` resamplings (seeded)."""
    import random

    rng = random.Random(0)
    values = sorted(statistic(rng) for _ in range(draws))
    return values[draws // 20], values[draws - 1 - draws // 20]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread, those that ended included) another process has used.
    On Linux this reads its CPU clock, which counts in nanoseconds; /proc and psutil count in 10 ms
    ticks, too coarse for a per-call figure of a millisecond. Elsewhere, psutil."""
    if sys.platform.startswith("linux"):
        try:  # the process-wide CPU clock of `pid`: (~pid << 3) | CPUCLOCK_SCHED (clock_getcpuclockid)
            return time.clock_gettime(((~pid) << 3) | 2)
        except OSError:
            pass
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def interleaved_cpu(
    fns: dict[str, Callable[[], Any]], *, repeats: int, pids: dict[str, dict[str, int]] | None = None
) -> dict[str, dict[str, float]]:
    """CPU seconds (user + system) per call of each function, called round-robin,
    in this process ("self") and in the named pids given for that function
    (`pids[fn_name] = {"daemon": pid, ...}`). Unlike wall time, CPU time barely
    moves when other work shares the cores. Other processes' CPU is read from their
    CPU clocks (`process_cpu`).

    Another process may go on working for a call after the call has returned (a worker that
    answers before it unwinds): what a process uses from the start of a call that names it
    until the start of the next call that names it (or the end) counts for the first call. So
    its work is counted whole, and its idle wake-ups meanwhile count against it too."""
    totals: dict[str, dict[str, float]] = {fn: {} for fn in fns}
    # pid -> (the function of the last call that named it, the name it gave it, its clock then)
    open_since: dict[int, tuple[str, str, float]] = {}

    def settle(pid: int, now: float) -> None:
        last = open_since.pop(pid, None)
        if last is not None:
            fn, label, then = last
            totals[fn][label] = totals[fn].get(label, 0.0) + now - then

    for items in _rounds(fns, repeats):
        for name, fn in items:
            named = (pids or {}).get(name, {})
            for label, pid in named.items():
                now = process_cpu(pid)
                settle(pid, now)
                open_since[pid] = (name, label, now)
            before = time.process_time()
            fn()
            totals[name]["self"] = totals[name].get("self", 0.0) + time.process_time() - before
    for pid in list(open_since):
        settle(pid, process_cpu(pid))
    return {fn: {k: v / repeats for k, v in t.items()} for fn, t in totals.items()}


def subprocess_seconds(cmd: list[str], *, repeats: int, env: dict[str, str] | None = None) -> float:
    """Median wall seconds of running `cmd` to completion (it must succeed)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        times.append(time.perf_counter() - t0)
        if res.returncode != 0:
            raise RuntimeError(f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return statistics.median(times)


# ---------------------------------------------------------------- models and daemons

_ROOT: pathlib.Path | None = None
_MODELS: dict[tuple[str, int, int], pathlib.Path] = {}


def workdir() -> pathlib.Path:
    """This run's temp folder; models built here are reused by the later benchmarks
    of the run (run.py passes it to each benchmark's process as $NND_BENCH_WORKDIR)."""
    global _ROOT
    if _ROOT is None:
        given = os.environ.get("NND_BENCH_WORKDIR")
        if given:
            _ROOT = pathlib.Path(given)
        else:  # our own: removed when this process ends, whoever forgets cleanup()
            _ROOT = pathlib.Path(tempfile.mkdtemp(prefix="nnd-bench-"))
            atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


def cleanup() -> None:
    global _ROOT
    if _ROOT is not None:
        shutil.rmtree(_ROOT, ignore_errors=True)
        _ROOT = None
        _MODELS.clear()


def model(kind: str = "gpt2", *, layers: int = 2, width: int = 64) -> str:
    """Path of a tiny-vocab model (tests/support/tinymodels.py), built once per run."""
    key = (kind, layers, width)
    if key not in _MODELS:
        import tinymodels

        folder = workdir() / "models" / f"{kind}-{layers}x{width}"
        if not (folder / "config.json").exists() or not list(folder.glob("*.safetensors")):
            with quiet():
                tinymodels.build(kind, folder, layers=layers, width=width)
        _MODELS[key] = folder
    return str(_MODELS[key])


def config_only(name: str, config: dict[str, Any]) -> str:
    """A folder with config.json and a tiny tokenizer, no weights."""
    import tinymodels

    with quiet():
        return str(tinymodels.write_config_only(workdir() / "models" / name, config))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence stdout/stderr at the file-descriptor level (tokenizers' trainer and
    transformers' progress bars write there directly)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(null)
        os.close(saved[0])
        os.close(saved[1])


def weights_bytes(path: str) -> int:
    """Bytes of the weight files in a model folder."""
    return sum(p.stat().st_size for p in pathlib.Path(path).glob("*.safetensors"))


@contextlib.contextmanager
def daemon(name: str, *extra: str) -> Iterator[Any]:
    """A real `nnd serve` in its own temp folder; stopped (with its workers) on exit."""
    import psutil
    from daemonproc import start_daemon

    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"d-{name}-", dir=workdir()))
    d = start_daemon(folder, *extra)
    try:
        yield d
    finally:
        try:
            children = psutil.Process(d.proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        d.stop()
        _, alive = psutil.wait_procs(children, timeout=10)
        for p in alive:  # workers we started through this daemon
            with contextlib.suppress(psutil.Error):
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)


def worker_pid(d: Any) -> int:
    """The pid of the daemon's (only) worker."""
    import psutil

    kids = [
        p
        for p in psutil.Process(d.proc.pid).children(recursive=True)
        if "-m nnd_daemon.worker" in " ".join(p.cmdline())
    ]
    if len(kids) != 1:
        raise RuntimeError(f"expected one worker, found {len(kids)}")
    return kids[0].pid


# ---------------------------------------------------------------- memory


def rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


class RssSampler:
    """Samples the RSS of a process (or of whatever `find()` returns) every `interval` s in a thread."""

    def __init__(self, pid: int | None = None, *, find: Callable[[], int | None] | None = None, interval: float = 0.02):
        self._pid = pid
        self._find = find
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self.pid: int | None = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import psutil

        proc = None
        while not self._stop.is_set():
            try:
                if proc is None:
                    pid = self._pid if self._pid is not None else (self._find() if self._find else None)
                    if pid:
                        self.pid = pid
                        proc = psutil.Process(pid)
                if proc is not None:
                    self.peak = max(self.peak, proc.memory_info().rss)
                    self.samples += 1
            except psutil.Error:
                pass
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------- machine


def machine() -> dict[str, str]:
    import torch
    import transformers

    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    }
    with contextlib.suppress(ImportError):
        import nnsight

        info["nnsight"] = nnsight.__version__
    with contextlib.suppress(OSError):
        info["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return info


def hf_model(path: str) -> tuple[Any, Any]:
    """The tokenizer and the HF model (eval mode) in `path`, in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def gpt2_subjects(layers: int, width: int) -> tuple[str, Any, Any, Any]:
    """One GPT-2-shaped model, three ways: its directory (for nnd), an HF model
    with its tokenizer (plain PyTorch), and an nnsight LanguageModel on the same
    weights. Returns (path, tokenizer, hf_model, nnsight_model)."""
    import nnsight

    path = model("gpt2", layers=layers, width=width)
    tok, hf = hf_model(path)
    lm = nnsight.LanguageModel(path, tokenizer=tok, device_map="cpu", dispatch=True)
    return path, tok, hf, lm
