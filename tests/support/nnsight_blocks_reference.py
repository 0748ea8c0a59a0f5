"""Run a module of blocks (tests/support/compat_blocks.py, compat_api_blocks.py) with nnsight 0.8.1
in a process of its own and save every block's results (or the error it raised).

Usage: python nnsight_blocks_reference.py BLOCKS_MODULE MODEL_PATH OUT.pt
(tests call `results(BLOCKS_MODULE, MODEL_PATH, FOLDER)`, which runs it and loads what it saved).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def results(blocks_module: str, path: str, folder: os.PathLike) -> dict:
    """nnsight 0.8.1's results of every block of `blocks_module` on the model at `path`."""
    import warmfork

    out = os.path.join(folder, f"{blocks_module}.pt")
    warmfork.run([sys.executable, os.path.abspath(__file__), blocks_module, path, out], check=True, timeout=900)
    return torch.load(out, weights_only=False)


def main(blocks_module: str, path: str, out: str) -> None:
    import nnsight
    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    blocks = importlib.import_module(blocks_module).BLOCKS

    model = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), device_map="cpu", dispatch=True)
    results = {}
    for name, block in blocks.items():
        try:
            results[name] = _plain(block(model))
        except Exception as exc:  # noqa: BLE001 - recorded, the test says which block nnsight refused
            results[name] = {"nnsight_failed": f"{type(exc).__name__}: {exc}"}
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
