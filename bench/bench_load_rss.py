"""load-rss: peak RSS of the process that loads a model's weights, over the weights' size.

nnd: `nnd dispatch MODEL --device cpu` (the CLI) while a thread samples the
worker's RSS (psutil, every 20 ms; the worker is found as the daemon's child);
the worker's own VmHWM (the kernel's exact peak) is read afterwards as a check.
Alternative: `AutoModelForCausalLM.from_pretrained(MODEL)` in a fresh
subprocess, sampled the same way. From both peaks we subtract the same
baseline, the RSS of a fresh process that has imported torch and transformers
(so the ratio is the memory the load itself costs); the worker also holds
grpc and nnd, which stays in its figure.

transformers 5 maps safetensors files and loads CPU weights lazily: right after
from_pretrained most weight pages are not yet resident, so a second row gives the
RSS after one forward (every weight touched; those pages are file-backed page
cache, shared by every process that maps the same file).

Model: GPT-2-small blocks (12 layers × 768, tiny vocabulary) ≈ 341 MB of float32.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import harness
from harness import PROMPT, Row, mbytes, secs

NAME = "load-rss"

BASELINE = "import torch, transformers, time; time.sleep(0.5)"
# The alternative's process: load, say so, wait for a line on stdin, run one forward, report RSS.
LOAD = """
import json, os, sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
print("loaded", flush=True)
sys.stdin.readline()
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}))
"""


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _hf(path: str) -> dict[str, float]:
    """from_pretrained in a fresh process: sampled peak and VmHWM up to 'loaded', then RSS after one forward."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", LOAD, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    with harness.RssSampler(proc.pid) as sampler:
        line = proc.stdout.readline()
    wall = time.perf_counter() - t0
    if line.strip() != "loaded":
        raise RuntimeError(f"from_pretrained failed: {proc.communicate()[1].strip().splitlines()[-1:]}")
    loaded = _status(proc.pid)
    out, err = proc.communicate("go\n", timeout=300)
    after = json.loads(out.strip().splitlines()[-1])
    return {
        "peak": max(sampler.peak, loaded["VmRSS"]),
        "hwm": loaded["VmHWM"],
        "wall": wall,
        "after_forward": after["VmRSS"],
        "after_forward_file": after["RssFile"],
    }


def _baseline() -> int:
    """RSS of a fresh process after `import torch, transformers` (the child reports its own)."""
    code = BASELINE + "; import psutil, os; print(psutil.Process(os.getpid()).memory_info().rss)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


def _worker_finder(d: Any) -> Callable[[], int | None]:
    def find() -> int | None:
        import psutil

        for p in psutil.Process(d.proc.pid).children(recursive=True):
            try:
                if "nnd_daemon.worker" in " ".join(p.cmdline()):
                    return p.pid
            except psutil.Error:
                pass
        return None

    return find


def _nnd(d: Any, path: str, repeats: int) -> list[dict[str, float]]:
    """`nnd dispatch` `repeats` times (a fresh worker each): sampled peak, VmHWM, wall, RSS after one trace."""
    import nnd

    d.cli("load", path, "--device", "cpu")
    client = nnd.TransformersModel(path, address=d.address)
    runs = []
    for _ in range(repeats):
        with harness.RssSampler(find=_worker_finder(d)) as sampler:
            t0 = time.perf_counter()
            d.cli("dispatch", path, "--device", "cpu")
            wall = time.perf_counter() - t0
        pid = harness.worker_pid(d)
        loaded = _status(pid)
        with client.trace(PROMPT):
            client.lm_head.output.save()
        after = _status(pid)
        runs.append(
            {
                "peak": max(sampler.peak, loaded["VmRSS"]),
                "hwm": loaded["VmHWM"],
                "wall": wall,
                "after_forward": after["VmRSS"],
                "after_forward_file": after["RssFile"],
            }
        )
        d.cli("release", path)
    client.unload()
    return runs


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run(quick: bool) -> list[Row]:
    harness.one_thread()

    layers, width = (4, 256) if quick else (12, 768)
    repeats = 1 if quick else 3
    path = harness.model("gpt2", layers=layers, width=width)
    tiny = harness.model("gpt2")  # 2 × 64: the same procedure with ~no weights, for the marginal figure
    weights, tiny_weights = harness.weights_bytes(path), harness.weights_bytes(tiny)
    base = statistics.median(_baseline() for _ in range(repeats))

    a = _median([_hf(path) for _ in range(repeats)])
    a0 = None if quick else _hf(tiny)
    with harness.daemon(NAME) as d:
        o = _median(_nnd(d, path, repeats))
        o0 = None if quick else _nnd(d, tiny, 1)[0]

    alt_peak, peak, alt_wall, wall = a["peak"], o["peak"], a["wall"], o["wall"]
    r_alt, r_ours = (alt_peak - base) / weights, (peak - base) / weights
    f_alt, f_ours = (a["after_forward"] - base) / weights, (o["after_forward"] - base) / weights
    extra = weights - tiny_weights
    if a0 is not None and o0 is not None:
        m_alt = (a["after_forward"] - a0["after_forward"]) / extra
        m_ours = (o["after_forward"] - o0["after_forward"]) / extra
        marginal = Row(
            "load-rss: marginal RSS per weight byte after a forward (vs the same on a 2×64 model)",
            "from_pretrained + forward",
            f"{m_alt:.2f}",
            f"{m_ours:.2f}",
            m_ours / m_alt,
        )
    else:
        marginal = Row("load-rss: marginal RSS per weight byte (skipped with --quick)", "-", "-", "-")
    raw = {
        "weights_bytes": weights,
        "baseline_rss": base,
        "hf": a,
        "nnd_worker": o,
        "hf_tiny": a0,
        "nnd_worker_tiny": o0,
        "tiny_weights_bytes": tiny_weights,
        "hf_ratio_vmhwm": (a["hwm"] - base) / weights,
        "worker_ratio_vmhwm": (o["hwm"] - base) / weights,
        "layers": layers,
        "width": width,
        "repeats": repeats,
    }
    label = f"GPT-2 {layers}×{width}, {mbytes(weights)} f32"
    return [
        Row(
            f"load-rss: peak RSS while loading − baseline, ÷ weights ({label})",
            "from_pretrained in a subprocess",
            f"{r_alt:.2f} ({mbytes(alt_peak - base)})",
            f"{r_ours:.2f} ({mbytes(peak - base)})",
            r_ours / r_alt,
            target=harness.target("nnd < 1.3", None if quick else r_ours < 1.3),  # meaningless on --quick's tiny model
            raw=raw,
        ),
        Row(
            "load-rss: RSS after the first forward − baseline, ÷ weights",
            "from_pretrained + forward",
            f"{f_alt:.2f} ({mbytes(a['after_forward'] - base)})",
            f"{f_ours:.2f} ({mbytes(o['after_forward'] - base)})",
            f_ours / f_alt,
        ),
        marginal,
        Row(
            "load-rss: wall time, process start to loaded",
            "from_pretrained in a subprocess",
            secs(alt_wall),
            f"{secs(wall)} (`nnd dispatch`)",
            wall / alt_wall,
        ),
    ]
