"""Run tests/support/compat_blocks.py (or another module of blocks beside it, with a BLOCKS
dict) with nnsight 0.8.1 in a process of its own and save every block's results (or the name
of the error it raised).

Usage: python nnsight_compat_reference.py MODEL_PATH OUT.pt [BLOCKS_MODULE]
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
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def main(path: str, out: str, module: str = "compat_blocks") -> None:
    import importlib

    import nnsight
    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    blocks = importlib.import_module(module)

    model = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), device_map="cpu", dispatch=True)
    results = {}
    for name, block in blocks.BLOCKS.items():
        try:
            results[name] = _plain(block(model))
        except Exception as exc:  # noqa: BLE001 - recorded, the test says which block nnsight refused
            results[name] = {"nnsight_failed": f"{type(exc).__name__}: {exc}"}
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
