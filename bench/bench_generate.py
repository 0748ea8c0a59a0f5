"""generate: 32 new tokens, greedy, with one `.save()` of a layer output per step.

Plain HF `generate` in-process (no saves; `min_new_tokens=32` so all 32 come) vs
nnd `model.generate(..., max_new_tokens=32)` with `for step in tracer.iter[:]:
hs.append(layer.output.save())`, and nnsight 0.8.1's generate with the same per-step
save as a second alternative. nnd cannot ask for min_new_tokens, so the run
checks that nnd produced all 32 steps too. A third row gives CPU time, which
a busy machine disturbs much less than wall time (see bench_trace.py).
"""

from __future__ import annotations

import harness
from harness import PROMPT, Row, ms

NAME = "generate"
NEW = 32


def run(quick: bool) -> list[Row]:
    harness.one_thread()
    import torch

    import nnd

    layers, width = (4, 256) if quick else (12, 768)
    warmup, repeats = (1, 3) if quick else (1, 7)
    path, tok, hf, lm = harness.gpt2_subjects(layers, width)
    mid = layers // 2

    def plain() -> torch.Tensor:
        with torch.no_grad():
            enc = tok(PROMPT, return_tensors="pt")
            return hf.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)

    def with_nnsight() -> list:
        with lm.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            hs = list().save()
            for _ in tracer.iter[0:NEW]:  # bounded: an open iter[:] stops the statements after it
                hs.append(lm.transformer.h[mid].output)
        return hs

    with harness.daemon(NAME) as d:
        ours = nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)

        def with_nnd() -> list:
            hs = []
            with ours.generate(PROMPT, max_new_tokens=NEW) as tracer:
                for _ in tracer.iter[:]:  # the body runs per step, as in nnsight: one append each
                    hs.append(ours.transformer.h[mid].output.save())
            return hs

        got, ref, theirs = with_nnd(), plain(), with_nnsight()
        if (
            len(got) != NEW
            or len(theirs) != NEW
            or ref.shape[1] - tok(PROMPT, return_tensors="pt")["input_ids"].shape[1] != NEW
        ):
            raise RuntimeError(f"not {NEW} steps everywhere: nnd {len(got)}, nnsight {len(theirs)}, HF {ref.shape}")
        t = harness.interleaved(
            {"plain": plain, "nnsight": with_nnsight, "nnd": with_nnd}, warmup=warmup, repeats=repeats
        )
        # The same in CPU time (this process; plus the daemon and the worker for nnd).
        pids = {"nnd": {"daemon": d.proc.pid, "worker": harness.worker_pid(d)}}
        per = harness.interleaved_cpu({"plain": plain, "nnd": with_nnd}, repeats=repeats, pids=pids)
        split = per["nnd"]
        cpu = {k: sum(v.values()) for k, v in per.items()}
        ours.release()

    shape = f"GPT-2 {layers}×{width}"
    raw = {k + "_s": v for k, v in t.items()} | {
        "layers": layers,
        "width": width,
        "new_tokens": NEW,
        "repeats": repeats,
        "plain_cpu_s": cpu["plain"],
        "nnd_cpu_s": cpu["nnd"],
        "nnd_cpu_split_s": split,
    }
    r = t["nnd"] / t["plain"]
    rc = cpu["nnd"] / cpu["plain"]
    return [
        Row(
            f"generate {NEW} tokens, 1 save/step ({shape})",
            "HF generate in-process, no saves",
            ms(t["plain"]),
            ms(t["nnd"]),
            r,
            target=harness.target("≤ 1.25", r <= 1.25),
            raw=raw,
        ),
        Row(
            f"generate {NEW} tokens, 1 save/step ({shape})",
            "nnsight generate in-process, 1 save/step",
            ms(t["nnsight"]),
            ms(t["nnd"]),
            t["nnd"] / t["nnsight"],
        ),
        Row(
            f"generate {NEW} tokens, CPU time (client + daemon + worker for nnd)",
            "HF generate in-process, no saves",
            ms(cpu["plain"]),
            f"{ms(cpu['nnd'])} (client {ms(split['self'])}, daemon {ms(split['daemon'])}, worker {ms(split['worker'])})",
            rc,
            target=harness.target("≤ 1.25", rc <= 1.25),
        ),
    ]
