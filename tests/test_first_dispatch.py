"""Loading weights shows progress (issue #30), against a real daemon: the first trace of a META
model and `model.dispatch()` print what `nnd dispatch` prints, on stderr in a script, and nothing
when asked to be quiet (the `progress=` keyword, `nnd.set_progress`). The trace
after such a dispatch gives transformers' numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tinymodels
import torch
import transformers
from daemonproc import Daemon

PROMPT = "The Eiffel Tower is in the city of"

# One process goes through the cases in turn (a fresh process and a dispatch cost seconds each):
# each phase starts from a META model and says where its output begins on stderr.
SCRIPT = """
import json, sys
import nnd
model = nnd.LanguageModel(sys.argv[1], address=sys.argv[2], device="cpu"{keyword})
sums = {{}}

def phase(name):
    model.release()
    print("--- " + name, file=sys.stderr, flush=True)

def trace(name):
    with model.trace({prompt!r}):
        h = model.transformer.h[0].output.save()
    sums[name] = float(h.double().abs().sum())

{phases}
print(json.dumps(sums))
"""

DEFAULT_PHASES = """
phase("first trace")
trace("first trace")
phase("dispatch")
model.dispatch()
print("--- trace after dispatch", file=sys.stderr, flush=True)
trace("after dispatch")
phase("callable")
seen = []
model.dispatch(progress=lambda m: seen.append((m.stage, m.done, m.total)))
print("SEEN", json.dumps(seen), file=sys.stderr, flush=True)
phase("set_progress(False)")
nnd.set_progress(False)
trace("quiet")
"""

QUIET_PHASES = """
phase("quiet")
trace("quiet")
"""


@pytest.fixture(scope="module")
def served(daemon) -> Daemon:
    # The shared in-process daemon: what is shown comes from the worker's Load stream, the same
    # messages whether the worker is a process or a thread (and a dispatch then starts no process).
    return daemon


@pytest.fixture(scope="module")
def gpt2(tiny_models, tmp_path_factory) -> str:
    """A model of this module's own: its phases release it, which no other module may see."""
    return tinymodels.private_copy(tiny_models["gpt2"], tmp_path_factory.mktemp("first-dispatch"))


@pytest.fixture(scope="module")
def expected(gpt2) -> float:
    path = gpt2
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model(**tok(PROMPT, return_tensors="pt"), output_hidden_states=True)
    return float(out.hidden_states[1].double().abs().sum())


def _run(served, gpt2, *, phases, keyword="", env=None) -> tuple[dict[str, str], dict]:
    code = SCRIPT.format(phases=phases, keyword=keyword, prompt=PROMPT)
    out = subprocess.run(
        [sys.executable, "-c", code, gpt2, served.address],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    sections = {}
    for part in out.stderr.split("--- ")[1:]:
        name, _, text = part.partition("\n")
        sections[name] = text
    return sections, json.loads(out.stdout.strip().splitlines()[-1])


def test_weights_loading_is_shown_on_a_first_trace_and_a_dispatch_unless_asked_not_to(served, gpt2, expected):
    shown, sums = _run(served, gpt2, phases=DEFAULT_PHASES)
    # The first trace of a META model: the worker's count of tensors, as `nnd dispatch` shows it.
    first = shown["first trace"]
    assert "loading" in first and "tensors" in first and "weights loaded in" in first, shown
    assert "weights loaded in" in shown["dispatch"], shown
    assert "loading" not in shown["trace after dispatch"], shown  # dispatched already: nothing to show
    assert "loading" not in shown["set_progress(False)"], shown
    # A callable gets every message instead of the display.
    seen = json.loads(shown["callable"].split("SEEN ", 1)[1].splitlines()[0])
    loading = [s for s in seen if s[0] == "loading" and s[2]]
    assert loading and loading[-1][1] == loading[-1][2], seen  # counted up to its total
    assert seen[-1][0] == "ready" and "weights loaded" not in shown["callable"], shown
    for name, value in sums.items():  # a dispatch made by the client computes what transformers does
        assert value == pytest.approx(expected, rel=1e-6), name


def test_quiet_by_the_handle_keyword(served, gpt2, expected):
    # (NND_PROGRESS and dispatch(progress=False) take the same path: tests/client/test_progress.py)
    shown, sums = _run(served, gpt2, phases=QUIET_PHASES, keyword=", progress=False")
    assert "loading" not in shown["quiet"] and "weights loaded" not in shown["quiet"], shown
    assert sums["quiet"] == pytest.approx(expected, rel=1e-6)
