"""The GPUs the control plane may place models on, found without initialising CUDA.

The daemon never imports CUDA state of its own (a CUDA context costs hundreds of
MB of GPU memory and pins the device), so it counts the NVIDIA device nodes and
honours `CUDA_VISIBLE_DEVICES` the way the CUDA runtime does, and asks
`nvidia-smi` for free memory when a dispatch needs a budget. One place for all
three questions: how many, which, and how much is free.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Protocol


class GpuQuery(Protocol):
    """The two questions the registry asks of the GPUs (placement checks, budgets). This module
    answers them (`count`, `free_bytes`); lifecycle tests pass a fixed list instead."""

    def count(self) -> int: ...

    def free_bytes(self, index: int) -> int | None: ...


def _device_nodes() -> list[int]:
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    return sorted(int(d[6:]) for d in names if d.startswith("nvidia") and d[6:].isdigit())


def visible() -> list[int]:
    """Physical indices of the GPUs a worker started now would see, in CUDA's order.

    `CUDA_VISIBLE_DEVICES` unset: every device node. Set: its comma-separated
    entries up to the first invalid one (CUDA's rule); an empty value hides
    every GPU. UUID entries (`GPU-...`) are counted but cannot be mapped to an
    index here, so they keep their position with index -1.
    """
    nodes = _device_nodes()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return nodes
    out: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        if item.isdigit() and int(item) in nodes and int(item) not in out:
            out.append(int(item))
        elif item.startswith(("GPU-", "MIG-")) and nodes:
            out.append(-1)
        else:
            break  # CUDA stops at the first entry it cannot use
    return out


def count() -> int:
    """How many GPUs a worker started now would see."""
    return len(visible())


def free_bytes(index: int) -> int | None:
    """Free memory of visible GPU `index` (CUDA's numbering) in bytes, or None when it cannot be read."""
    gpus = visible()
    if not 0 <= index < len(gpus) or gpus[index] < 0 or shutil.which("nvidia-smi") is None:
        return None
    try:
        res = subprocess.run(
            ["nvidia-smi", f"--id={gpus[index]}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return int(res.stdout.strip().splitlines()[0]) * 2**20 if res.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def process_memory() -> dict[int, int]:
    """GPU memory in bytes held by each process (pid -> bytes), read from outside the processes."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[int, int] = {}
    for line in res.stdout.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit() and used.strip().isdigit():
            out[int(pid)] = out.get(int(pid), 0) + int(used) * 2**20
    return out
