"""scan-8b: LoadModel + Scan of a Llama-3-8B-shaped config (config.json and a tiny tokenizer, no weights).

nnd: a fresh daemon; wall time of LoadModel (the client's `TransformersModel(...)`),
of the first Scan (a save of the last layer's output and of the logits), and the
daemon's RSS growth across both (psutil on the daemon pid, sampled every 20 ms for
the peak). Alternative: nnsight's `LanguageModel(path)` without dispatch (meta
weights) and `model.scan(...)` on the same folder, in a fresh subprocess measured
the same way (its own RSS after importing torch, transformers and nnsight is the
baseline). Both sides first load and scan a 2-layer Llama, so first-use imports
(modeling code, tokenizer machinery) are not counted against the 8B.

Run as a script (`python bench_scan8b.py --nnsight PATH`) it is that subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import harness
from harness import PROMPT, Row, mbytes, secs

NAME = "scan-8b"

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,  # ids inside the tiny tokenizer's vocabulary
    "eos_token_id": 0,
    "pad_token_id": 1,
}
REPEATS = 3  # warm scans after the first


def _nnsight_child(path: str) -> None:
    """In a fresh process: nnsight's meta load and scan, with RSS before and after."""
    import os
    import threading

    import psutil

    harness.one_thread()
    import nnsight
    from transformers import AutoTokenizer

    proc = psutil.Process(os.getpid())
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.02)

    warmup = sys.argv[3]  # a tiny Llama: first-use imports and caches are not counted
    small = nnsight.LanguageModel(warmup, tokenizer=AutoTokenizer.from_pretrained(warmup))
    with small.scan(PROMPT):
        small.model.layers[-1].output.save()
    threading.Thread(target=sample, daemon=True).start()
    tok = AutoTokenizer.from_pretrained(path)
    base = proc.memory_info().rss
    t0 = time.perf_counter()
    lm = nnsight.LanguageModel(path, tokenizer=tok)  # no dispatch: meta weights
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    with lm.scan(PROMPT):
        h = lm.model.layers[-1].output.save()
        logits = lm.lm_head.output.save()
    scan = time.perf_counter() - t0
    warm = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        with lm.scan(PROMPT):
            lm.model.layers[-1].output.save()
        warm.append(time.perf_counter() - t0)
    stop.set()
    after = proc.memory_info().rss
    out = {
        "load_s": load,
        "scan_s": scan,
        "warm_scan_s": sorted(warm)[len(warm) // 2],
        "rss_growth": after - base,
        "peak_growth": max(peak[0], after) - base,
        "shapes": [list(h.shape), list(logits.shape)],
    }
    print("RESULT " + json.dumps(out))


def _nnsight(path: str, warmup: str) -> dict | str:
    cmd = [sys.executable, __file__, "--nnsight", path, warmup]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    lines = (res.stderr or res.stdout).strip().splitlines() or ["no output"]
    return lines[-1][:100]


def run(quick: bool) -> list[Row]:
    harness.one_thread()  # torch and transformers imported before the clock, as in the nnsight process
    import nnd

    config = dict(LLAMA3_8B)
    if quick:
        config["num_hidden_layers"] = 4
    path = harness.config_only(f"llama3-8b-shape-{config['num_hidden_layers']}L", config)
    tiny = harness.model("llama")
    with harness.daemon(NAME) as d:
        # A tiny Llama first, so the daemon's first-use imports are not counted against the 8B.
        t0 = time.perf_counter()
        first = nnd.TransformersModel(tiny, address=d.address)
        with first.scan(PROMPT):
            first.model.layers[-1].output.save()
        first.unload()
        first_use = time.perf_counter() - t0
        pid = d.proc.pid
        before = harness.rss(pid)
        with harness.RssSampler(pid) as sampler:
            t0 = time.perf_counter()
            model = nnd.TransformersModel(path, address=d.address)
            load = time.perf_counter() - t0
            t0 = time.perf_counter()
            with model.scan(PROMPT):
                h = model.model.layers[-1].output.save()
                logits = model.lm_head.output.save()
            scan = time.perf_counter() - t0
        growth = harness.rss(pid) - before
        peak = max(sampler.peak, before + growth) - before
        n = len(model.tokenizer(PROMPT)["input_ids"])
        if tuple(h.shape) != (1, n, 4096) or tuple(logits.shape) != (1, n, 128256):
            raise RuntimeError(f"unexpected scan shapes {tuple(h.shape)} {tuple(logits.shape)}")

        def again() -> None:
            with model.scan(PROMPT):
                model.model.layers[-1].output.save()

        warm = harness.median_time(again, warmup=0, repeats=REPEATS)
        params = model.info.num_parameters

    theirs = _nnsight(path, tiny)
    label = f"Llama-3-8B shape, {config['num_hidden_layers']} layers"
    raw = {
        "load_s": load,
        "scan_s": scan,
        "warm_scan_s": warm,
        "rss_growth": growth,
        "peak_growth": peak,
        "num_parameters": params,
        "first_use_tiny_load_scan_s": first_use,
        "nnsight": theirs,
    }
    if isinstance(theirs, str):
        why = f"n/a ({theirs})"
        return [
            Row(f"scan-8b: LoadModel ({label})", "nnsight LanguageModel (meta)", why, secs(load), raw=raw),
            Row("scan-8b: first Scan", "nnsight scan", why, secs(scan)),
            Row(
                "scan-8b: daemon RSS growth (peak)",
                "nnsight process RSS growth",
                why,
                f"{mbytes(growth)} ({mbytes(peak)})",
            ),
        ]
    return [
        Row(
            f"scan-8b: LoadModel ({label})",
            "nnsight LanguageModel, no dispatch (meta)",
            secs(theirs["load_s"]),
            secs(load),
            load / theirs["load_s"],
            raw=raw,
        ),
        Row(
            "scan-8b: first Scan (warm scan)",
            "nnsight scan in-process",
            f"{secs(theirs['scan_s'])} ({secs(theirs['warm_scan_s'])})",
            f"{secs(scan)} ({secs(warm)})",
            scan / theirs["scan_s"],
        ),
        Row(
            "scan-8b: RSS growth, load + scan (peak)",
            "nnsight process RSS growth",
            f"{mbytes(theirs['rss_growth'])} ({mbytes(theirs['peak_growth'])})",
            f"{mbytes(growth)} ({mbytes(peak)})",
            growth / theirs["rss_growth"] if theirs["rss_growth"] > 0 else None,
        ),
    ]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--nnsight":
        _nnsight_child(sys.argv[2])
    else:
        raise SystemExit("usage: bench_scan8b.py --nnsight MODEL_DIR WARMUP_DIR (run.py runs the benchmark)")
