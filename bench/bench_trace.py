"""trace: one forward with one `.save()` of a layer output, on CPU: GPT-2 4×64 (where the
per-trace overhead is most of the time) and GPT-2-small's shape 12×768 (the issue's targets
name both; --quick runs 4×64 alone).

Plain HF forward in-process vs nnsight 0.8.1 trace in-process (same weights) vs
the nnd client against a real daemon with the model dispatched. All three
tokenize the same prompt; all three run torch with one thread.

Wall time is what a user sees, but on a shared machine it moves with the
neighbours' load (and the scheduler favours the worker, which sleeps between
requests, over the busy benchmark process). So the overhead is also given in
CPU time per request: this process's for plain and nnsight; this process's
plus the daemon's and the worker's for nnd.
"""

from __future__ import annotations

import harness
from harness import PROMPT, Row, ms

NAME = "trace"


def run(quick: bool) -> list[Row]:
    shapes = [(4, 64)] if quick else [(4, 64), (12, 768)]
    return [row for layers, width in shapes for row in _run_shape(layers, width, quick)]


def _run_shape(layers: int, width: int, quick: bool) -> list[Row]:
    harness.one_thread()
    import torch

    import nnd

    small = width < 256  # a few ms per trace: more repeats for the same precision
    warmup, repeats = (2, 5) if quick else (5, 100) if small else (3, 30)
    path, tok, hf, lm = harness.gpt2_subjects(layers, width)
    mid = layers // 2

    def plain() -> torch.Tensor:
        with torch.no_grad():
            return hf(**tok(PROMPT, return_tensors="pt")).logits

    def with_nnsight() -> torch.Tensor:
        with lm.trace(PROMPT):
            h = lm.transformer.h[mid].output.save()
        return h

    with harness.daemon(NAME) as d:
        ours = nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)

        def with_nnd() -> torch.Tensor:
            with ours.trace(PROMPT):
                h = ours.transformer.h[mid].output.save()
            return h

        torch.testing.assert_close(with_nnd(), with_nnsight(), atol=1e-4, rtol=0)  # same work on both sides
        t = harness.interleaved(
            {"plain": plain, "nnsight": with_nnsight, "nnd": with_nnd}, warmup=warmup, repeats=repeats
        )
        # The same in CPU time, counting the daemon and the worker for nnd.
        # (CPU times tick every 10 ms: enough calls that a process's share of ~0.3 ms shows.)
        pids = {"nnd": {"daemon": d.proc.pid, "worker": harness.worker_pid(d)}}
        per = harness.interleaved_cpu(
            {"plain": plain, "nnsight": with_nnsight, "nnd": with_nnd}, repeats=max(repeats, 40), pids=pids
        )
        split = per["nnd"]
        cpu = {k: sum(v.values()) for k, v in per.items()}
        ours.release()

    shape = f"GPT-2 {layers}×{width}"
    over_ns, over_nnd = t["nnsight"] - t["plain"], t["nnd"] - t["plain"]
    raw = {k + "_s": v for k, v in t.items()} | {k + "_cpu_s": v for k, v in cpu.items()}
    raw |= {"nnd_cpu_split_s": split, "layers": layers, "width": width, "repeats": repeats}
    cpu_ns, cpu_nnd = cpu["nnsight"] - cpu["plain"], cpu["nnd"] - cpu["plain"]
    cpu_ratio = cpu_nnd / cpu_ns if cpu_ns > 0 else None
    ratio_over = over_nnd / over_ns if over_ns > 0 else None  # nnsight's overhead can vanish in the noise
    return [
        Row(
            f"trace ({shape}), vs plain forward",
            "HF forward in-process",
            ms(t["plain"]),
            ms(t["nnd"]),
            t["nnd"] / t["plain"],
            raw=raw,
        ),
        Row(
            f"trace ({shape}), vs nnsight",
            "nnsight trace in-process",
            ms(t["nnsight"]),
            ms(t["nnd"]),
            t["nnd"] / t["nnsight"],
        ),
        Row(
            f"trace overhead over plain forward ({shape})",
            "nnsight overhead",
            harness.plus_ms(over_ns),
            harness.plus_ms(over_nnd),
            ratio_over,
            target=harness.target("≤ 1", None if ratio_over is None else ratio_over <= 1),
        ),
        Row(
            f"trace overhead in CPU time ({shape}; client + daemon + worker for nnd)",
            "nnsight overhead",
            harness.plus_ms(cpu_ns),
            f"{harness.plus_ms(cpu_nnd)} (client {ms(split['self'])}, daemon {ms(split['daemon'])}, worker {ms(split['worker'])})",
            cpu_ratio,
            target=harness.target("≤ 1", None if cpu_ratio is None else cpu_ratio <= 1),
        ),
    ]
