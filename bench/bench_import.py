"""import: how long a fresh Python process takes to import nnd, and to get its first trace result.

`python -c "import nnd"` vs `python -c "import torch"` (median of 5 runs each),
and a fresh process that imports nnd, connects to a daemon where the tiny
model is already dispatched, runs one trace with one `.save()` and prints the
shape, vs a fresh process that does the same in-process with transformers
(import, from_pretrained of the same tiny model, tokenize, forward).
The nnd process asks for numpy results (`nnd.set_tensor_type("numpy")`), so
torch is never imported for it; a third row is the same process with the
default setting, whose result is a torch tensor (torch imported for it).
`python -c pass` is measured too and shown in the raw numbers.
"""

from __future__ import annotations

import sys

import harness
from harness import PROMPT, Row, secs

NAME = "import"

FIRST_NUMPY = f"""
import sys, nnd
nnd.set_tensor_type("numpy")
model = nnd.TransformersModel(sys.argv[1], address=sys.argv[2])
with model.trace({PROMPT!r}):
    h = model.transformer.h[0].output.save()
print(tuple(h.shape))
"""

FIRST_NND = FIRST_NUMPY
FIRST_NND_TORCH = FIRST_NUMPY.replace('nnd.set_tensor_type("numpy")\n', "")

FIRST_HF = f"""
import sys, torch, transformers
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
with torch.no_grad():
    out = model(**tok({PROMPT!r}, return_tensors="pt"), output_hidden_states=True)
print(tuple(out.hidden_states[1].shape))
"""


def run(quick: bool) -> list[Row]:
    import nnd

    repeats = 1 if quick else 5
    py = sys.executable
    empty = harness.subprocess_seconds([py, "-c", "pass"], repeats=repeats)
    imp_torch = harness.subprocess_seconds([py, "-c", "import torch"], repeats=repeats)
    imp_nnd = harness.subprocess_seconds([py, "-c", "import nnd"], repeats=repeats)
    path = harness.model("gpt2")
    with harness.daemon(NAME) as d:
        nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)
        first_nnd = harness.subprocess_seconds([py, "-c", FIRST_NND, path, d.address], repeats=repeats)
        first_nnd_torch = harness.subprocess_seconds([py, "-c", FIRST_NND_TORCH, path, d.address], repeats=repeats)
    first_hf = harness.subprocess_seconds([py, "-c", FIRST_HF, path], repeats=repeats)
    raw = {
        "python_pass_s": empty,
        "import_torch_s": imp_torch,
        "import_nnd_s": imp_nnd,
        "first_trace_nnd_s": first_nnd,
        "first_trace_nnd_torch_s": first_nnd_torch,
        "first_forward_hf_s": first_hf,
        "repeats": repeats,
    }
    return [
        Row(
            "import: `python -c 'import nnd'`",
            "`python -c 'import torch'`",
            secs(imp_torch),
            secs(imp_nnd),
            imp_nnd / imp_torch,
            target=harness.target("nnd < 0.3 s", imp_nnd < 0.3),
            raw=raw,
        ),
        Row(
            "import: fresh process to its first trace result (tiny model, already dispatched)",
            "fresh process: transformers from_pretrained + forward",
            secs(first_hf),
            secs(first_nnd),
            first_nnd / first_hf,
            target=harness.target("nnd < 1 s", first_nnd < 1.0),
        ),
        Row(
            "import: the same with the default setting (results are torch tensors, torch imported)",
            "fresh process: transformers from_pretrained + forward",
            secs(first_hf),
            secs(first_nnd_torch),
            first_nnd_torch / first_hf,
        ),
    ]
