"""A module's parameters and buffers as values of a graph (graph.proto's ModuleTensor).

A graph reads `model.lm_head.weight` as the tensor the model computes with,
whatever form the worker keeps it in:

- a plain parameter or buffer: itself, detached (autograd never reaches the
  model's weights, and the request cannot change them: plan.py refuses
  in-place writes into it);
- a bitsandbytes 4-bit or 8-bit weight: dequantized into its original dtype,
  because its storage is packed bytes whose numbers mean nothing as a matrix;
- a weight split over tensor-parallel ranks (a DTensor): gathered whole on
  every rank (each rank runs the same node, so the collective lines up),
  unless its split cannot be undone by concatenation (a packed projection);
- any other parameter class holding non-floating data: refused, because it is
  some storage format nnd does not know how to turn back into the matrix.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from nnd.v1 import graph_pb2

from .. import errors
from . import sharding
from .order import POST, PRE


def names(module: torch.nn.Module) -> list[str]:
    """The tensors a ModuleTensor may name on `module`: its own parameters, then its own buffers."""
    return [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]


def check(table: Mapping[str, torch.nn.Module], ref: graph_pb2.ModuleTensor, where: str) -> None:
    """NOT_FOUND unless `ref` names a parameter or buffer of a module of the model."""
    module = table.get(ref.path)
    if module is None:
        raise errors.NotFound(f"{where}\nthe model has no module {ref.path!r}")
    if ref.name not in names(module):
        owner = repr(ref.path) if ref.path else "the model"
        held = ", ".join(names(module)) or "none"
        raise errors.NotFound(
            f"{where}\nthe module {owner} ({type(module).__name__}) has no parameter or buffer {ref.name!r}; "
            f"its own are: {held}"
        )


# Per model: the address of its first parameter when indexed, and each weight's storage address ->
# (its module, its path, its name). Built once (~0.3 ms on GPT-2 4x64, ~0.9 ms on 12x768), again when the
# weights have moved (the first parameter's address tells).
_INDEXES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, dict[int, tuple[torch.nn.Module, str, str]]]] = (
    weakref.WeakKeyDictionary()
)


def storages(table: Mapping[str, torch.nn.Module]) -> dict[int, tuple[torch.nn.Module, str, str]]:
    """Where each parameter and buffer of the model keeps its numbers (its storage's address) -> whose it is.
    Meta tensors have none, and a tensor whose storage cannot be read (a DTensor's) is left out."""
    root = table.get("")
    first = _address(next(root.parameters(), None)) if root is not None else 0
    cached = _INDEXES.get(root) if root is not None else None
    if cached is not None and cached[0] == first:
        return cached[1]
    found: dict[int, tuple[torch.nn.Module, str, str]] = {}
    for path, module in table.items():
        for name in names(module):
            address = _address(getattr(module, name, None))
            if address:
                found.setdefault(address, (module, path, name))
    if root is not None:
        _INDEXES[root] = (first, found)
    return found


def _address(tensor: Any) -> int:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return 0
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - a wrapper subclass without a storage of its own
        return 0


def shared(tensor: Any, index: Mapping[int, tuple[torch.nn.Module, str, str]]) -> str | None:
    """The name of the model's weight whose memory `tensor` is (or views), if it is one. An entry is
    checked against the weight as it is now: memory a moved weight left may hold an activation."""
    address = _address(tensor)
    entry = index.get(address) if address else None
    if entry is None:
        return None
    module, path, name = entry
    if _address(getattr(module, name, None)) != address:
        return None
    return f"{path + '.' if path else ''}{name}"


def read(table: Mapping[str, torch.nn.Module], ref: graph_pb2.ModuleTensor, shard: sharding.Sharding) -> torch.Tensor:
    """The whole tensor `ref` names, as the model computes with it (see the module docstring)."""
    module = table[ref.path]
    tensor = getattr(module, ref.name)
    what = f"{ref.path + '.' if ref.path else ''}{ref.name}"
    kind = type(tensor).__name__
    if kind == "Params4bit":
        return _dequantize_4bit(tensor, what)
    if kind == "Int8Params":
        return _dequantize_8bit(module, tensor, _compute_dtype(table), what)
    if _is_dtensor(tensor):
        return _gather(tensor, ref.path, shard, what)
    if not isinstance(tensor, torch.Tensor):
        raise errors.InvalidArgument(f"{what} is a {kind}, not a tensor")
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and not (
        tensor.is_floating_point() or tensor.is_complex()
    ):
        raise errors.Unimplemented(
            f"{what} is stored as {kind} ({str(tensor.dtype).removeprefix('torch.')}), a format nnd cannot turn "
            "back into the weight matrix; read it from the model loaded without quantization"
        )
    return tensor.detach()


def _dequantize_4bit(tensor: Any, what: str) -> torch.Tensor:
    state = getattr(tensor, "quant_state", None)
    if state is None:
        raise errors.Unimplemented(f"{what} is a 4-bit weight without its quantization state; it cannot be read")
    import bitsandbytes.functional as bnb_functional

    return bnb_functional.dequantize_4bit(tensor.data, state).to(state.dtype)


def _dequantize_8bit(module: torch.nn.Module, tensor: Any, dtype: torch.dtype, what: str) -> torch.Tensor:
    # An 8-bit weight is int8 rows (CB) and one scale per row (SCB): W = CB * SCB / 127.
    codes = getattr(tensor, "CB", None)
    scales = getattr(tensor, "SCB", None)
    if codes is None or scales is None:
        state = getattr(module, "state", None)
        codes, scales = getattr(state, "CB", None), getattr(state, "SCB", None)
    if codes is None or scales is None:
        if tensor.dtype != torch.int8:  # not quantized (yet): the weight is itself
            return tensor.detach()
        raise errors.Unimplemented(f"{what} is an 8-bit weight without its row scales; it cannot be read")
    return (codes.float() * scales.float().unsqueeze(1) / 127.0).to(dtype)


def _compute_dtype(table: Mapping[str, torch.nn.Module]) -> torch.dtype:
    """The dtype the model computes in: that of its first floating parameter (a quantized model's
    norms and embeddings keep it), as transformers' `model.dtype` says."""
    for p in table[""].parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _gather(tensor: Any, path: str, shard: sharding.Sharding, what: str) -> torch.Tensor:
    from torch.distributed.tensor import Replicate, Shard

    layouts = getattr(shard, "layouts", {})
    packed = any(getattr(s, "blocks", 1) > 1 for hook in (PRE, POST) for s in layouts.get((path, hook), {}).values())
    placements = tuple(tensor.placements)
    if packed or not all(isinstance(p, (Shard, Replicate)) for p in placements):
        raise errors.Unimplemented(
            f"{what} is split across the tensor-parallel ranks in a way nnd cannot make whole "
            f"({'a packed projection' if packed else placements}); read it with tp_size=1"
        )
    return tensor.full_tensor().detach()
