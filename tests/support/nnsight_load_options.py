"""nnsight 0.8.1's side of tests/test_load_options.py: load the tiny GPT-2 with
`attn_implementation="eager"` and a `config=` of one layer, run the test's
trace, and save what it gave (a process of its own: importing nnsight patches
torch).

Usage: python nnsight_load_options.py MODEL_PATH OUT.pt
"""

from __future__ import annotations

import sys
from typing import Any

import torch

PROMPT = "The Eiffel Tower is in"


def main(path: str, out: str) -> None:
    import nnsight
    from transformers import AutoConfig, AutoTokenizer

    got: dict[str, Any] = {}
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    config.n_layer = 1
    model = nnsight.LanguageModel(
        path, tokenizer=tok, config=config, attn_implementation="eager", device_map="cpu", dispatch=True
    )
    got["modules"] = [p for p, _ in model._module.named_modules()]  # the torch tree nnsight built
    with model.trace(PROMPT):
        weights = model.transformer.h[0].attn.output[1].save()
        logits = model.lm_head.output.save()
    got["weights"], got["logits"] = weights.detach(), logits.detach()
    torch.save(got, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
