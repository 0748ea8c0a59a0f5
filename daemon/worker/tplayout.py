"""Which module values a tensor-parallel model holds in shards, and how.

Two sources, measured once after loading, on every rank alike:

1. transformers' tp_plan (`model.tp_plan`, module path pattern -> style name) and
   the style objects it names (`ALL_PARALLEL_STYLES`): a ColwiseParallel with a
   `Shard` output layout and a local output leaves each rank its slice of the
   module's output along the last dim; a RowwiseParallel with a `Shard` input
   layout takes its input that way; a PackedColwiseParallel output is packed
   (gate|up: each rank holds its slice of every block). Styles with replicated
   outputs (colwise_gather_output, rowwise_rep, embeddings) leave values whole.
2. A probe: one forward of a short prompt with hooks on every module, on the
   sharded model and on a meta copy of it (fake tensors, no weights). A value
   whose shape differs between the two is sharded along the dim that differs;
   the ranks' widths are exchanged so every rank knows every rank's slice. This
   finds what the plan only implies (an MLP's activation module sits between a
   colwise and a rowwise projection and sees the slice too) and checks the plan.

The probe wins where the two disagree; the plan supplies the packing, and the
layout of planned modules the probe did not see.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from nnd_daemon.engine import sharding
from nnd_daemon.engine.sharding import Layout, Opaque, Shard, TensorParallel
from nnd_daemon.modelclass import meta_safe_experts

log = logging.getLogger("nnd.worker.tp")

PRE, POST = "pre", "post"
Shapes = dict[tuple[str, str], list[tuple[int, ...]]]


def plan_of(model: torch.nn.Module) -> dict[str, str]:
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    return dict(plan) if isinstance(plan, dict) else {}


def _style_for(path: str, plan: dict[str, str]) -> str | None:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    return plan.get(path) or plan.get(replace_layer_number_by_wildcard(path))


def _even(width: int, n: int) -> tuple[int, ...]:
    """Rank widths of a dim of `width` split like DTensor's Shard (torch.chunk: ceil-sized, the rest shorter)."""
    step = -(-width // n)
    return tuple(max(0, min(step, width - r * step)) for r in range(n))


def from_plan(model: torch.nn.Module, world: int) -> dict[tuple[str, str], tuple[Shard, str]]:
    """(path, hook) -> (layout of leaf 0, style name) for the modules the tp_plan splits."""
    from torch.distributed.tensor import Shard as DShard
    from transformers.distributed.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        ColwiseParallel,
        PackedColwiseParallel,
        RowwiseParallel,
    )

    plan = plan_of(model)
    out: dict[tuple[str, str], tuple[Shard, str]] = {}
    for path, module in model.named_modules():
        name = _style_for(path, plan) if path else None
        if name is None:
            continue
        try:
            style = ALL_PARALLEL_STYLES[name]
        except KeyError:
            continue
        if isinstance(style, PackedColwiseParallel) and style.use_local_output:
            width = int(getattr(module, "out_features", 0))
            out[(path, POST)] = (Shard(-1, _even(width, world), style.split_factor, f"tp_plan {name}"), name)
        elif isinstance(style, ColwiseParallel) and isinstance(style.output_layouts, DShard) and style.use_local_output:
            width = int(getattr(module, "out_features", 0))
            out[(path, POST)] = (Shard(-1, _even(width, world), 1, f"tp_plan {name}"), name)
        elif isinstance(style, RowwiseParallel) and isinstance(style.input_layouts, DShard):
            width = int(getattr(module, "in_features", 0))
            out[(path, PRE)] = (Shard(-1, _even(width, world), 1, f"tp_plan {name}"), name)
    return out


def _record(model: torch.nn.Module, run: Any) -> Shapes:
    """Leaf shapes of every module's first call's [args, kwargs] and output during `run()`."""
    shapes: Shapes = {}
    handles = []

    def pre(path: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            key = (path, PRE)
            if key not in shapes:
                shapes[key] = [tuple(t.shape) for t in sharding.leaves([list(args), dict(kwargs)])]

        return hook

    def post(path: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            key = (path, POST)
            if key not in shapes:
                shapes[key] = [tuple(t.shape) for t in sharding.leaves(output)]

        return hook

    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
            handles.append(module.register_forward_hook(post(path)))
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return shapes


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> Any:
    try:
        return model(input_ids=ids, use_cache=False)
    except TypeError:
        return model(input_ids=ids)


def probe_ids(config: Any) -> torch.Tensor:
    vocab = int(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", 0))
    return torch.tensor([[i % max(vocab, 1) for i in (1, 2, 3, 4)]])


def measure_full(model: torch.nn.Module) -> Shapes | None:
    """Shapes on an unsharded meta copy of the model (fake tensors: no weights, no compute)."""
    from nnd_daemon.engine import scan

    try:
        config = copy.deepcopy(model.config)
        if hasattr(config, "distributed_config"):
            config.distributed_config = None
        meta_safe_experts(config)  # as the helper's META models (modelclass.py)
        cls = type(model)
        with torch.device("meta"):
            meta = cls._from_config(config)
        meta.eval()
        ids = probe_ids(config)
        with scan.fake_mode():
            return _record(meta, lambda: _forward(meta, ids))
    except Exception as exc:  # noqa: BLE001 - the plan alone still works
        log.warning(
            "tensor-parallel probe on the meta model failed (%s: %s); using the tp_plan only", type(exc).__name__, exc
        )
        return None


def _exchange(local: Shapes, keys: list[tuple[str, str]], world: int, group: Any) -> list[Shapes]:
    """Every rank's shapes for `keys` (all ranks must have seen the same modules and leaves)."""
    import torch.distributed as dist

    flat: list[int] = []
    for key in keys:
        for shape in local[key]:
            flat += [len(shape), *shape]
    mine = torch.tensor(flat, dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(flat)], dtype=torch.int64), group=group)
    if len({int(x) for x in lengths}) != 1:
        raise RuntimeError("the tensor-parallel ranks saw different module structures in the probe forward")
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    out = []
    for part in parts:
        values, pos, shapes = part.tolist(), 0, {}
        for key in keys:
            leaves = []
            for _ in local[key]:
                nd = values[pos]
                leaves.append(tuple(values[pos + 1 : pos + 1 + nd]))
                pos += 1 + nd
            shapes[key] = leaves
        out.append(shapes)
    return out


def _compare(full: list[tuple[int, ...]], ranks: list[list[tuple[int, ...]]]) -> Layout:
    layout: Layout = {}
    if any(len(r) != len(full) for r in ranks):
        # The fake forward took another path here (e.g. it builds an attention mask the real one skips):
        # nothing to compare with, so only a difference between the ranks themselves can show a shard.
        return _between_ranks(ranks)
    for i, shape in enumerate(full):
        per = [r[i] for r in ranks]
        if all(p == shape for p in per):
            continue
        if any(len(p) != len(shape) for p in per):
            layout[i] = Opaque(f"shape {list(shape)} unsharded, {[list(p) for p in per]} on the ranks")
            continue
        dims = [d for d in range(len(shape)) if any(p[d] != shape[d] for p in per)]
        if len(dims) == 1 and sum(p[dims[0]] for p in per) == shape[dims[0]]:
            d = dims[0]
            layout[i] = Shard(d - len(shape), tuple(p[d] for p in per), 1, "probe")
        else:
            layout[i] = Opaque(f"shape {list(shape)} unsharded, {[list(p) for p in per]} on the ranks")
    return layout


def _between_ranks(ranks: list[list[tuple[int, ...]]]) -> Layout:
    """Without an unsharded reference: leaves that differ between the ranks cannot be placed."""
    if any(len(r) != len(ranks[0]) for r in ranks):
        return {i: Opaque("the ranks pass different numbers of tensors") for i in range(max(map(len, ranks)))}
    return {
        i: Opaque(f"the ranks hold shapes {[list(r[i]) for r in ranks]} and there is no unsharded reference")
        for i in range(len(ranks[0]))
        if any(r[i] != ranks[0][i] for r in ranks)
    }


def measure(model: torch.nn.Module, rank: int, world: int, control: Any = None, group: Any = None) -> TensorParallel:
    """The model's TensorParallel sharding. Every rank must call this together (it runs a forward).

    `control` is a gloo group for exchanging shapes (CPU tensors); `group` the one values are gathered over.
    """
    from nnd_daemon.engine import inputs

    planned = from_plan(model, world)
    full = measure_full(model)
    ids = probe_ids(model.config).to(inputs.input_device(model))
    local = _record(model, lambda: _forward(model, ids))
    keys = sorted(local)
    everyone = _exchange(local, keys, world, control)

    layouts: dict[tuple[str, str], Layout] = {}
    for key in keys:
        ranks = [shapes[key] for shapes in everyone]
        if full is not None and key in full:
            layout = _compare(full[key], ranks)
        else:
            layout = _between_ranks(ranks)
        plan = planned.get(key)
        if plan is not None:
            shard, style = plan
            seen = layout.get(0)
            if isinstance(seen, Shard):
                layout[0] = Shard(seen.dim, seen.sizes, shard.blocks, f"tp_plan {style}, probe")
            elif full is None or key not in full:
                layout[0] = shard
            else:
                log.warning(
                    "%s.%s: the tp_plan (%s) says sharded, the probe says whole; trusting the probe", *key, style
                )
        if layout:
            layouts[key] = layout
    for key, (shard, _style) in planned.items():  # planned modules the probe forward never called
        layouts.setdefault(key, {0: shard})
    return TensorParallel(layouts, rank, world, group)
