"""Load: 16 concurrent clients x 200 traces each on the tiny GPT-2, through a
real daemon.

Client i sends its own prompt, adds i * v to layer 0's output at the last
position and saves lm_head's last position. Every result must be that
client's own, checked against transformers run in this process with the same
edit as a forward hook (no errors, no cross-talk), and the daemon's and the
worker's memory over the last 1000 traces must grow by less than 5%.

NND_LOAD_TRACES sets the traces per client (default 200, the full 3200); the
figures (time, throughput, RSS) are printed with -s.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd

CLIENTS = 16
TRACES = int(os.environ.get("NND_LOAD_TRACES", "200"))
TAIL = 1000  # RSS growth is measured over the last TAIL traces (all of them if fewer)
PROMPTS = [
    "The Eiffel Tower is in the city of",
    "The Colosseum is in the city of",
    "Hello world, this is",
    "Interpretability means looking inside",
    "A daemon keeps models loaded so that",
    "neural networks while they run",
    "every notebook shares one copy",
    "Hello",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("load"))
    d.cli("load", tiny_models["gpt2"])
    d.cli("dispatch", tiny_models["gpt2"])
    yield d
    assert d.stop() == 0


def _prompt(i: int) -> str:
    return f"{PROMPTS[i % len(PROMPTS)]} {'and so on ' * (i // len(PROMPTS))}".strip()


def _expected(path: str, vector: torch.Tensor) -> list[torch.Tensor]:
    """lm_head's last position for each client's prompt and edit, computed here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for i in range(CLIENTS):

        def add(module: Any, args: Any, output: Any, i: int = i) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            hidden[:, -1, :] += i * vector
            return output

        handle = model.transformer.h[0].register_forward_hook(add)
        try:
            with torch.no_grad():
                ids = torch.tensor([tok(_prompt(i))["input_ids"]])
                out.append(model(ids).logits[:, -1, :].clone())
        finally:
            handle.remove()
    return out


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids)


def test_16_clients_x_200_traces(served, tiny_models):
    path = tiny_models["gpt2"]
    vector = torch.randn(64, generator=torch.Generator().manual_seed(0))
    expected = _expected(path, vector)
    (worker,) = json.loads(served.cli("ps", "--json").stdout)[0]["worker_pids"]
    pids = [served.proc.pid, worker]
    total = CLIENTS * TRACES
    mark = max(0, total - TAIL)
    done = 0
    lock = threading.Lock()
    samples: dict[str, int] = {}

    def client(i: int) -> int:
        nonlocal done
        model = nnd.TransformersModel(path, address=served.address, device="cpu")
        prompt, scale = _prompt(i), float(i)
        for _ in range(TRACES):
            with model.trace(prompt):
                model.transformer.h[0].output[:, -1, :] += scale * vector
                last = model.lm_head.output[:, -1, :].save()
            assert torch.allclose(last, expected[i], atol=1e-4, rtol=1e-4), (
                f"client {i} got values that are not its own (max diff {(last - expected[i]).abs().max():.3g})"
            )
            with lock:
                done += 1
                if done == mark:
                    samples["start"] = _rss(pids)
        return i

    if mark == 0:
        samples["start"] = _rss(pids)
    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        finished = sorted(pool.map(client, range(CLIENTS)))
    elapsed = time.monotonic() - started
    samples["end"] = _rss(pids)
    assert finished == list(range(CLIENTS))
    assert served.proc.poll() is None
    start = samples["start"]
    growth = (samples["end"] - start) / start
    print(
        f"\n{CLIENTS} clients x {TRACES} traces = {total} in {elapsed:.1f} s ({total / elapsed:.0f} traces/s); "
        f"daemon+worker RSS over the last {total - mark} traces: {start / 2**20:.1f} -> "
        f"{samples['end'] / 2**20:.1f} MiB ({growth:+.2%})"
    )
    assert growth < 0.05, f"daemon+worker RSS grew {growth:.1%} over the last {total - mark} traces"
