"""fairness: how long a one-step trace waits while another client generates on the same model.

One client streams a long generation (`model.stream`, 100 new tokens); once its
first token has arrived, a second client sends a one-step trace and times it.
Before fair turns the trace waited for the whole generation; now the worker
lends the model between generation steps (worker/turns.py), so it should wait
about one step. Side by side in one run: the trace alone, one generation step
(the generation's time ÷ its steps), the whole generation (what the trace
used to wait), and the trace during the generation.
"""

from __future__ import annotations

import statistics
import threading
import time

import harness
from harness import PROMPT, Row, ms

NAME = "fairness"
NEW = 100


def run(quick: bool) -> list[Row]:
    harness.one_thread()
    import nnd

    layers, width = (4, 256) if quick else (12, 768)
    rounds = 3 if quick else 7
    path = harness.model("gpt2", layers=layers, width=width)
    with harness.daemon(NAME, "--batch-window-ms", "0") as d:
        gen_client = nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)
        trace_client = nnd.TransformersModel(path, address=d.address, device="cpu")

        def trace() -> float:
            t0 = time.perf_counter()
            with trace_client.trace(PROMPT):
                trace_client.lm_head.output[:, -1].argmax(-1).save()
            return time.perf_counter() - t0

        def generation(first: threading.Event | None = None) -> float:
            t0 = time.perf_counter()
            for token in gen_client.stream(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW):
                if first is not None and token.step == 0:
                    first.set()
            return time.perf_counter() - t0

        for _ in range(2):  # warm-up
            trace()
            generation()
        alone = statistics.median(trace() for _ in range(rounds * 3))
        whole = statistics.median(generation() for _ in range(rounds))
        waited: list[float] = []
        for _ in range(rounds):
            first = threading.Event()
            gen = threading.Thread(target=generation, args=(first,))
            gen.start()
            first.wait(120)
            waited.append(trace())
            gen.join()
        during = statistics.median(waited)
        gen_client.release()

    step = whole / NEW
    shape = f"GPT-2 {layers}×{width}"
    raw = {"trace_alone_s": alone, "generation_s": whole, "step_s": step, "trace_during_s": waited}
    return [
        Row(
            f"fairness: a one-step trace while another client generates {NEW} tokens ({shape})",
            "waiting for the whole generation (before fair turns)",
            ms(whole),
            f"{ms(during)} (alone {ms(alone)}; one step {ms(step)}; ≈ {max(0.0, during - alone) / step:.1f} steps' wait)",
            during / whole,
            target=harness.target("≤ a few steps", during - alone <= 5 * step),
            raw=raw,
        )
    ]
