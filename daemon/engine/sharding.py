"""Tensor-parallel transparency: the graph sees whole module values, each rank keeps its shard.

Under tensor parallelism every rank holds only a slice of some module values:
a column-parallel projection's output, a row-parallel projection's input, and
whatever runs between them (an MLP's activation). The engine asks `of(model)`
for the model's `Sharding` and calls it at the points where a module value is
taken and written back:

- `enter(path, hook, value)` when a hook the graph touches fires: the whole value
  (every rank runs the same hook and takes part in the all-gather);
- `leave(path, hook, value)` when the hook's nodes have run: this rank's shard of
  the (possibly edited) whole value, to hand back to the model;
- `call(path, module, args, kwargs)` for an out-of-place call of a module
  (`lm_head(h)`): whole value in, whole value out.

`sharded(path, hook)` says whether a hook needs `leave`. A model without a
sharding (a single-process worker, the meta model of a Scan) gets `NONE`, whose
methods are the identity. Values are addressed by their tensor leaves, in the
order `leaves` walks them: for a pre hook the `[args, kwargs]` pair, for a post
hook the output.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import errors

ATTR = "_nnd_sharding"


class Sharding:
    """No sharding: every value is already whole."""

    def sharded(self, path: str, hook: str) -> bool:
        return False

    def enter(self, path: str, hook: str, value: Any) -> Any:
        return value

    def leave(self, path: str, hook: str, value: Any) -> Any:
        return value

    def call(self, path: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return module(*args, **kwargs)


NONE = Sharding()


def of(model: torch.nn.Module) -> Sharding:
    """The model's sharding (NONE unless a tensor-parallel worker attached one)."""
    found = model.__dict__.get(ATTR)
    return found if isinstance(found, Sharding) else NONE


def attach(model: torch.nn.Module, sharding: Sharding) -> None:
    model.__dict__[ATTR] = sharding


# ---------------------------------------------------------------- tensor leaves


def map_leaves(value: Any, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> Any:
    """`value` with each tensor leaf replaced by fn(index, leaf); containers keep their types."""
    counter = [0]

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            i = counter[0]
            counter[0] += 1
            return fn(i, v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            items = [walk(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        if isinstance(v, Mapping):
            out = copy.copy(v) if isinstance(v, dict) else dict(v)
            for k in list(v.keys()):
                out[k] = walk(v[k])
            return out
        return v

    return walk(value)


def leaves(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_leaves(value, lambda i, t: found.append(t) or t)
    return found


# ---------------------------------------------------------------- tensor parallel


@dataclass(frozen=True)
class Shard:
    """How one tensor leaf is split across ranks.

    `dim` counts from the end (-1: the last dim). `sizes[r]` is rank r's width
    along it. `blocks` > 1 is a packed layout (a fused gate|up projection): the
    whole value is `blocks` equal blocks, and every rank holds its slice of each.
    """

    dim: int
    sizes: tuple[int, ...]
    blocks: int = 1
    source: str = ""  # where this layout came from, for messages ("tp_plan colwise", "probe")


@dataclass(frozen=True)
class Opaque:
    """A leaf that differs between ranks in a way that cannot be gathered; touching it is refused."""

    reason: str


Layout = dict[int, Shard | Opaque]  # leaf index -> how it is split (leaves absent: whole)


class TensorParallel(Sharding):
    """Gathers and splits the leaves named by `layouts[(path, hook)]` over a torch.distributed group."""

    def __init__(self, layouts: dict[tuple[str, str], Layout], rank: int, world: int, group: Any = None) -> None:
        self.layouts = {k: v for k, v in layouts.items() if v}
        self.rank = rank
        self.world = world
        self.group = group

    def sharded(self, path: str, hook: str) -> bool:
        return (path, hook) in self.layouts

    def describe(self) -> dict[str, str]:
        """(path.hook) -> a short description, for logs."""
        out = {}
        for (path, hook), layout in sorted(self.layouts.items()):
            parts = []
            for i, s in sorted(layout.items()):
                if isinstance(s, Shard):
                    packed = f" x{s.blocks} packed" if s.blocks > 1 else ""
                    parts.append(f"leaf {i}: dim {s.dim} {list(s.sizes)}{packed} ({s.source})")
                else:
                    parts.append(f"leaf {i}: opaque ({s.reason})")
            out[f"{path}.{hook}"] = "; ".join(parts)
        return out

    # -- the engine's interface
    def enter(self, path: str, hook: str, value: Any) -> Any:
        layout = self.layouts.get((path, hook))
        if not layout:
            return value
        return map_leaves(value, lambda i, t: self.gather(t, layout[i], path, hook) if i in layout else t)

    def leave(self, path: str, hook: str, value: Any) -> Any:
        layout = self.layouts.get((path, hook))
        if not layout:
            return value
        return map_leaves(value, lambda i, t: self.split(t, layout[i], path, hook) if i in layout else t)

    def call(self, path: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = self.leave(path, "pre", [list(args), dict(kwargs)])
        out = module(*state[0], **state[1])
        return self.enter(path, "post", out)

    # -- collectives
    def _check(self, t: torch.Tensor, s: Shard | Opaque, path: str, hook: str, width: int) -> Shard:
        name = f"{path or 'the model'} ({'input' if hook == 'pre' else 'output'})"
        if isinstance(s, Opaque):
            raise errors.Unimplemented(
                f"{name} is split across the tensor-parallel ranks in a way nnd cannot make whole ({s.reason}); "
                "read it with tp_size=1, or read a neighbouring module's value"
            )
        if t.dim() < -s.dim or t.shape[s.dim] != width:
            raise errors.Unimplemented(
                f"{name}: expected a tensor of width {width} along dim {s.dim} here, got shape {list(t.shape)}; "
                "this value's tensor-parallel layout changed since the worker measured it"
            )
        return s

    def _no_grad(self, t: torch.Tensor, path: str, hook: str) -> None:
        # Each rank would see only its own shard's part of the gradient of a whole value.
        if torch.is_grad_enabled() and t.requires_grad:
            raise errors.Unimplemented(
                f"{path} ({'input' if hook == 'pre' else 'output'}) is split across the tensor-parallel ranks, and "
                "gradients through split values are not supported yet; use tp_size=1 for backward passes, or "
                "take gradients of whole values (a decoder layer's output)"
            )

    def gather(self, t: torch.Tensor, s: Shard | Opaque, path: str, hook: str) -> torch.Tensor:
        s = self._check(t, s, path, hook, s.sizes[self.rank] if isinstance(s, Shard) else -1)
        self._no_grad(t, path, hook)
        import torch.distributed as dist

        dim = t.dim() + s.dim
        local = t.detach().contiguous()
        widest = max(s.sizes)
        if local.shape[dim] < widest:  # uneven shards: all_gather wants equal sizes
            pad = list(local.shape)
            pad[dim] = widest - local.shape[dim]
            local = torch.cat([local, local.new_zeros(pad)], dim=dim)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        parts = [p.narrow(dim, 0, n) for p, n in zip(parts, s.sizes, strict=True)]
        if s.blocks == 1:
            return torch.cat(parts, dim=dim)
        chunks = [p.chunk(s.blocks, dim=dim) for p in parts]
        return torch.cat([chunks[r][b] for b in range(s.blocks) for r in range(self.world)], dim=dim)

    def split(self, t: torch.Tensor, s: Shard | Opaque, path: str, hook: str) -> torch.Tensor:
        s = self._check(t, s, path, hook, sum(s.sizes) if isinstance(s, Shard) else -1)
        self._no_grad(t, path, hook)
        dim = t.dim() + s.dim
        if s.blocks == 1:
            start = sum(s.sizes[: self.rank])
            return t.narrow(dim, start, s.sizes[self.rank]).contiguous()
        widths = [n // s.blocks for n in s.sizes]
        start = sum(widths[: self.rank])
        blocks = t.chunk(s.blocks, dim=dim)
        return torch.cat([b.narrow(dim, start, widths[self.rank]) for b in blocks], dim=dim).contiguous()
