"""How a request's forward runs with respect to autograd.

A request that reads or writes no gradient runs under `torch.inference_mode` where
that is safe, else under `torch.no_grad`; one that does runs under `enable_grad`
with every weight frozen. Inference mode skips autograd's per-op bookkeeping
(version counters, view tracking): on GPT-2 4×64 on CPU a trace's worker CPU
fell by ~0.25 ms of ~4.5 ms. The numbers are the same: it changes what autograd
records, not what is computed.

Its one hazard is state that outlives the request: a tensor made in inference
mode cannot later be saved for a backward pass, nor written in place outside
that mode. So:

- a session's traces (which share values across requests) and scans run under
  `no_grad`, never inference mode;
- a model whose weights are not plain parameters (bitsandbytes keeps quantization
  state it fills during the forward; a tensor-parallel model's are DTensors) is
  never run in inference mode;
- a module that kept a tensor made during a fast run (a buffer or a tensor
  attribute it set in its forward) gets a normal copy of it before the next
  request that is not fast (`_thaw`), so that request sees no inference tensor.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

# Per model: whether its weights allow inference mode (decided once: quantization and sharding happen
# before the first request), and whether a fast run happened since the last `_thaw`.
_PLAIN: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
_DIRTY: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def enter(model: torch.nn.Module, stack: contextlib.ExitStack, *, needs_grad: bool, may_be_fast: bool) -> None:
    """Enter the request's autograd mode on `stack`.

    `may_be_fast`: the request keeps nothing after it ends (not a session's trace, not a scan)."""
    if not needs_grad and may_be_fast and _plain_weights(model):
        stack.enter_context(torch.inference_mode())
        _DIRTY[model] = True
        # And again at its end: a generation lends the model between steps (worker/turns.py), and what its
        # later steps keep comes after a lent request's `_thaw`.
        stack.callback(_DIRTY.__setitem__, model, True)
        return
    if _DIRTY.pop(model, False):
        _thaw(model)
    if not needs_grad:
        stack.enter_context(torch.no_grad())
        return
    stack.enter_context(torch.enable_grad())
    thawed = [p for p in model.parameters() if p.requires_grad]
    for p in thawed:
        p.requires_grad_(False)

    def restore() -> None:
        for p in thawed:
            p.requires_grad_(True)

    stack.callback(restore)


def _plain_weights(model: torch.nn.Module) -> bool:
    plain = _PLAIN.get(model)
    if plain is None:
        plain = _PLAIN[model] = all(type(p) is torch.nn.Parameter for p in model.parameters())
    return plain


def _thaw(model: torch.nn.Module) -> None:
    """Replace each inference tensor a module kept (a buffer, a tensor attribute) by a normal copy.
    (Parameters are not among them: they live in `_parameters`, and were made before any request.)"""
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_inference():
                    module._buffers[name] = buffer.clone()
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.is_inference():
                    setattr(module, name, value.clone())
