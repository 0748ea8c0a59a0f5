"""What the daemon and a tensor-parallel group agree on: how long a rank may wait, the files the
group leaves beside its socket (control/tplaunch.py starts groups, worker/tp.py runs them), and the
config fields that decide whether a model can be split."""

from __future__ import annotations

import os

# Tensor-parallel groups (control/tplaunch.py starts them, worker/tp.py runs them).
# Seconds a rank may wait in one collective, or for the other ranks at the end of a request,
# before the group counts as hung and is stopped (env NND_TP_TIMEOUT_S).
DEFAULT_TP_TIMEOUT_S = 300.0


def timeout_s() -> float:
    try:
        return float(os.environ.get("NND_TP_TIMEOUT_S", "") or DEFAULT_TP_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TP_TIMEOUT_S


def pids_path(sock: str) -> str:
    """Rank pids, in rank order, written by rank 0 before it serves."""
    return sock + ".pids"


def reason_path(sock: str) -> str:
    """Why a group stopped itself, written by the rank that stopped it."""
    return sock + ".reason"


# Config fields that mean "mixture of experts" when positive.
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# Config fields a TP degree must divide (the column-parallel projections split along them).
DIVIDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
