"""What the daemon needs for a tensor-parallel worker group, without starting one
(control plane; the group's own side is worker/tp.py).

- `check`: the refusals Dispatch makes before any process starts (degree vs the
  model's heads and widths, mixture-of-experts, GPU count, placements TP cannot honour);
- `command`/`environment`: the torchrun command line of a group;
- `read_pids`, `group_exit_reason`: what the group's ranks left behind.

A group is `python -m torch.distributed.run --nproc_per_node N ... -m nnd_daemon.worker`:
torchrun's agent is the daemon's child, the ranks are the agent's children, rank 0
serves the Worker service on the unix socket and the other ranks follow it.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from typing import Any

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.modelclass import QUANTIZED
from nnd_daemon.tpgroup import DIVIDED_FIELDS, MOE_FIELDS, pids_path, reason_path, timeout_s

# How long the daemon waits for torchrun to stop the rest of a group once one rank is gone.
GROUP_EXIT_WAIT_S = 10.0


def tp_size(placement: nnd_pb2.Placement | None) -> int:
    return max(1, placement.tp_size) if placement is not None else 1




def on_gpu(placement: nnd_pb2.Placement, gpus: int) -> bool:
    """Whether a TP placement runs on GPUs: cuda asked for, or nothing asked for on a box with GPUs."""
    text = (placement.device or placement.device_map or "").strip()
    if text == "cpu":
        return False
    return text.startswith("cuda") or text.isdigit() or (text in ("", "auto") and gpus > 0)


def check(config: Any, placement: nnd_pb2.Placement, gpus: int) -> None:
    """Refuse a tensor-parallel placement this model or box cannot run; silent for tp_size <= 1."""
    n = placement.tp_size
    if n < 0:
        raise errors.InvalidArgument(f"tp_size must be 1 or more, got {n}")
    if n <= 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "?")
    experts = {f: getattr(text, f, None) for f in MOE_FIELDS}
    experts = {f: v for f, v in experts.items() if isinstance(v, int) and v > 0}
    if experts:
        shown = ", ".join(f"{k}={v}" for k, v in experts.items())
        raise errors.Unimplemented(
            f"tensor parallel is not supported for mixture-of-experts models ({model_type}: {shown}): "
            "nnd cannot yet make expert-parallel values whole for the graph; dispatch it without --tp"
        )
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise errors.Unimplemented(
            f"transformers has no tensor-parallel plan for {model_type} models, so they cannot be split "
            "across ranks; dispatch it without --tp"
        )
    sizes = {f: getattr(text, f, None) for f in DIVIDED_FIELDS}
    if sizes.get("num_key_value_heads") is None:
        sizes["num_key_value_heads"] = sizes.get("num_attention_heads")
    bad = {f: v for f, v in sizes.items() if isinstance(v, int) and v % n}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in bad.items())
        fits = [d for d in range(2, 65) if all(not isinstance(v, int) or v % d == 0 for v in sizes.values())]
        hint = f"; degrees that fit: {', '.join(map(str, fits[:8]))}" if fits else ""
        raise errors.InvalidArgument(f"tensor-parallel degree {n} does not divide {shown}{hint}")
    if placement.dtype in QUANTIZED:
        raise errors.Unimplemented(
            f"tensor parallel with a quantized dtype ({placement.dtype}) is not supported; "
            "use float32, float16 or bfloat16 with --tp"
        )
    dm = placement.device_map.strip()
    if dm.startswith("{") or placement.max_memory:
        raise errors.InvalidArgument(
            "tensor parallel places the shards itself (one rank per device): drop device_map/max_memory"
        )
    device = (placement.device or dm).strip()
    if device not in ("", "auto", "cpu", "cuda"):
        raise errors.InvalidArgument(
            f"tensor parallel uses devices 0..{n - 1} itself; use --device cuda or cpu, not {device!r}"
        )
    if on_gpu(placement, gpus) and n > gpus:
        raise errors.InvalidArgument(
            f"tensor-parallel degree {n} needs {n} GPUs, but this machine has {gpus}; "
            f"use --tp {gpus} or fewer{' (or --device cpu)' if gpus else ''}"
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(n: int, worker_args: list[str], port: int | None = None) -> list[str]:
    """The torchrun command of a one-node group of `n` ranks running the worker module."""
    return [
        sys.executable,
        "-I",  # see supervisor.isolated_python; the ranks get PYTHONSAFEPATH from environment()
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(n),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port or free_port()),
        "--max_restarts",
        "0",
        "--monitor_interval",
        "0.2",
        "-m",
        "nnd_daemon.worker",
        *worker_args,
    ]


def environment(placement: nnd_pb2.Placement, gpus: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if not on_gpu(placement, gpus):
        # transformers picks the mesh's device from the visible accelerator: hide GPUs for a CPU group.
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["NND_TP_TIMEOUT_S"] = str(timeout_s())
    # torchrun starts each rank as `python -u -m nnd_daemon.worker`: keep the working directory off its sys.path.
    env["PYTHONSAFEPATH"] = "1"
    return env


def read_pids(sock: str) -> list[int]:
    """Rank pids in rank order, as rank 0 wrote them before it started serving."""
    try:
        with open(pids_path(sock)) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def group_exit_reason(sock: str, log_text: str) -> str:
    """Why a group ended: a rank killed by a signal (torchrun's root cause), else the account of the rank
    that stopped the group (a hang, ranks out of lockstep), else whatever torchrun says."""
    try:
        with open(reason_path(sock)) as f:
            own = f.read().strip()
    except OSError:
        own = ""
    # torchrun's summary: "Root Cause (first observed failure):" then "rank : 1 (local_rank: 1)",
    # "exitcode : -9 (pid: 858)", "traceback : Signal 9 (SIGKILL) received by PID 858".
    block = log_text.rsplit("Root Cause", 1)[-1] if "Root Cause" in log_text else ""
    rank = re.search(r"rank\s*:\s*(\d+)", block)
    code = re.search(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", block)
    signame = re.search(r"\((SIG[A-Z0-9]+)\)", block)
    if rank and code and (int(code.group(1)) < 0 or not own):
        what = f"killed by {signame.group(1)}" if signame else f"exit code {code.group(1)}"
        return f"rank {rank.group(1)} (pid {code.group(2)}) {what}; torchrun stopped the whole group"
    return own
