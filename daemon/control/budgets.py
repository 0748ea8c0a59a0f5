"""Placement and budgets: whether a dispatch fits before any worker starts. The device a placement
puts its weights on, the GPUs the daemon sees, the placement's own max_memory, the device's budget
(--max-memory, else its free memory) and the per-user caps. The registry (registry.py) calls these
under its lock with the entries it holds; they only read."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psutil

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.control.settings import parse_bytes

if TYPE_CHECKING:
    from nnd_daemon.control.registry import Entry

DISPATCHING, DISPATCHED = nnd_pb2.DISPATCHING, nnd_pb2.DISPATCHED


def check_budget(
    entry: Entry, placement: nnd_pb2.Placement, entries: Iterable[Entry], max_memory: dict[str, int], gpus: Any
) -> None:
    """Refuse a dispatch whose weights do not fit the device's budget: --max-memory for it (less what the
    other models dispatched there hold), else what the device has free."""
    need = entry.meta.estimate_bytes(placement.dtype)
    cuda = gpus.count() > 0
    device = primary_device(placement, cuda)
    budget = max_memory.get(device)
    if budget is None and device == "cpu":
        budget = psutil.virtual_memory().available
        source = "free host memory"
    elif budget is None and device.startswith("cuda"):
        budget = gpus.free_bytes(int(device.partition(":")[2] or 0))  # None where nvidia-smi cannot say
        source = f"free memory of {device}"
    else:
        source = f"--max-memory {device}"
    if budget is not None:
        used = (
            sum(
                e.meta.estimate_bytes(e.dtype or e.placement.dtype)
                for e in entries
                if e is not entry
                and e.state in (DISPATCHED, DISPATCHING)
                and primary_device(e.dispatched_placement or e.placement, cuda) == device
            )
            if source.startswith("--max-memory")
            else 0
        )
        if need + used > budget:
            raise errors.ResourceExhausted(
                f"dispatching {entry.name} needs about {gib(need)} of weights on {device} "
                f"({placement.dtype or 'default dtype'}), but the budget ({source}) is {gib(budget)}"
                + (f" of which {gib(used)} is taken by other models" if used else "")
                + "; release a model, pick a smaller dtype (e.g. nf4) or raise the budget"
            )


def check_user(entry: Entry, placement: nnd_pb2.Placement, user: str, entries: Iterable[Entry], caps: Any) -> None:
    """The per-user caps (settings.UserLimits) on what `user` has dispatched; under the registry's lock."""
    if not user or not (caps.max_models or caps.max_memory_bytes):
        return
    mine = [
        e for e in entries
        if e is not entry and e.state in (DISPATCHED, DISPATCHING) and e.dispatched_by == user
    ]
    if caps.max_models and len(mine) >= caps.max_models:
        raise errors.ResourceExhausted(
            f"{user} has {len(mine)} model(s) dispatched ({', '.join(e.name for e in mine)}), the per-user cap "
            f"(max_models_per_user={caps.max_models}); release one first"
        )
    if caps.max_memory_bytes:
        held = sum(e.meta.estimate_bytes(e.dtype or e.placement.dtype) for e in mine)
        need = entry.meta.estimate_bytes(placement.dtype)
        if held + need > caps.max_memory_bytes:
            raise errors.ResourceExhausted(
                f"dispatching {entry.name} for {user} needs about {gib(need)} of weights; {user}'s models hold "
                f"{gib(held)} and the per-user cap is {gib(caps.max_memory_bytes)} "
                f"(max_memory_per_user={caps.max_memory_bytes}); release a model or pick a smaller dtype"
            )


def primary_device(placement: nnd_pb2.Placement | None, cuda: bool) -> str:
    if placement is None:
        return "cpu"
    text = placement.device or placement.device_map or ""
    if text.isdigit():
        return f"cuda:{text}"
    if text in ("", "cpu"):
        return "cpu" if text == "cpu" or not cuda else "cuda:0"
    if text == "cuda":
        return "cuda:0"
    if text.startswith("cuda"):
        return text
    return "cuda:0" if cuda else "cpu"


def check_gpus_visible(placement: nnd_pb2.Placement, seen: int) -> None:
    """Refuse a placement on a GPU the workers cannot see, before a worker starts (and fails deep in torch)."""
    text = (placement.device or placement.device_map or "").strip()
    if text.startswith("{"):  # an explicit device map: its values name the devices
        import json

        try:
            values = [str(v) for v in json.loads(text).values()]
        except (ValueError, AttributeError):
            return  # the worker reports a malformed map with its own message
    else:
        values = [text]
    wanted = [v for v in values if v.startswith("cuda") or v.isdigit()]
    if not wanted:
        return
    for value in wanted:
        index = int(value) if value.isdigit() else int(value.partition(":")[2] or 0)
        if index >= seen:
            hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
            raise errors.FailedPrecondition(
                f"the placement asks for {value}, but the daemon sees {seen} GPU{'s' if seen != 1 else ''}{why}; "
                "use --device cpu, or start nnd serve where that GPU is visible"
            )


def check_fits_max_memory(entry: Entry, placement: nnd_pb2.Placement) -> None:
    """Refuse a max_memory whose devices together cannot hold the weights, before any worker starts
    (transformers would put the rest on meta or disk; the worker's check_resident is the final word)."""
    if not placement.max_memory:
        return
    total = sum(parse_bytes(v) for v in placement.max_memory.values())
    need = entry.meta.estimate_bytes(placement.dtype)
    if need > total:
        limits = ", ".join(f"{k}={v}" for k, v in sorted(placement.max_memory.items()))
        raise errors.ResourceExhausted(
            f"the placement's max_memory ({limits}) allows {gib(total)} in all, but {entry.name} needs about "
            f"{gib(need)} of weights ({placement.dtype or 'default dtype'}); the rest would be left on meta "
            "or disk: raise max_memory or pick a smaller dtype"
        )


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
