"""Run weight_blocks.py with nnsight 0.8.1 in a process of its own and save every block's
results (or the error it raised).

Usage: python nnsight_weights_reference.py gpt2|llama MODEL_PATH OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def main(kind: str, path: str, out: str) -> None:
    import nnsight
    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import weight_blocks

    model = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), device_map="cpu", dispatch=True)
    blocks = weight_blocks.GPT2 if kind == "gpt2" else weight_blocks.LLAMA
    torch.save(_plain(weight_blocks.run(blocks, model)), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
