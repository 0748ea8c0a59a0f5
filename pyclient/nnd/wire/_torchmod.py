"""Finding torch without importing it at `import nnd` time, and what results become.

Results are torch tensors when the process has imported torch by the time they
arrive, else numpy arrays: a notebook that never touches torch does not pay
its ~1 s import to read an activation (`torch.from_numpy(x)` shares the
memory). `set_tensor_type` or NND_TENSORS=torch|numpy|auto overrides this.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

KINDS = ("auto", "torch", "numpy")
_installed: bool | None = None
_kind: str | None = None


def loaded() -> ModuleType | None:
    """torch if the user's process already imported it, else None (never imports)."""
    return sys.modules.get("torch")


def set_tensor_type(kind: str) -> None:
    """What saved tensors become in this process.

    - ``"auto"`` (the default): torch tensors if torch is imported when the
      results arrive, else numpy arrays, so ``import nnd`` never loads torch.
    - ``"torch"``: always torch tensors (imports torch on the first result).
    - ``"numpy"``: always numpy arrays (bfloat16 arrives as float32).

    The environment variable ``NND_TENSORS`` sets the same at start-up.
    """
    global _kind
    if kind not in KINDS:
        raise ValueError(f"tensor type must be one of {', '.join(KINDS)}, not {kind!r}")
    _kind = kind


def tensor_type() -> str:
    """The current setting (see `set_tensor_type`)."""
    if _kind is not None:
        return _kind
    env = os.environ.get("NND_TENSORS", "auto").strip().lower() or "auto"
    if env not in KINDS:
        raise ValueError(f"NND_TENSORS must be one of {', '.join(KINDS)}, not {env!r}")
    return env


def available() -> ModuleType | None:
    """torch if results should be torch tensors (see `set_tensor_type`), importing it if asked to; else None."""
    global _installed
    kind = tensor_type()
    if kind == "numpy":
        return None
    mod = sys.modules.get("torch")
    if mod is not None or kind == "auto":
        return mod
    if _installed is None:
        _installed = importlib.util.find_spec("torch") is not None
    if not _installed:
        return None
    import torch

    return torch
