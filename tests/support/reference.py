"""Plain-PyTorch reference runs: the same interventions written as register_forward_hook code."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def inputs(tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded ids, mask and position ids, built independently of the engine."""
    seqs = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + list(s) for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


@contextlib.contextmanager
def hooks(model: torch.nn.Module, **fns: Callable[..., Any]) -> Iterator[None]:
    """Forward hooks by module path (dots written as '__' in the keyword)."""
    modules = dict(model.named_modules())
    handles = [modules[path.replace("__", ".")].register_forward_hook(fn) for path, fn in fns.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def forward(model: torch.nn.Module, tokenizer: Any, texts: list[str], **fns: Callable[..., Any]) -> Any:
    with torch.no_grad(), hooks(model, **fns):
        return model(**inputs(tokenizer, texts))


def capture(store: dict[str, Any], key: str) -> Callable[..., None]:
    def fn(module: torch.nn.Module, args: Any, output: Any) -> None:
        store[key] = output.clone() if isinstance(output, torch.Tensor) else output

    return fn
