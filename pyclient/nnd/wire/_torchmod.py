"""Finding torch without importing it at `import nnd` time, and what results become.

The rule is one setting, never what happens to be imported: results are torch
tensors when torch is installed (as nnsight's are, so nnsight code runs
unchanged), numpy arrays when it is not or when the user asks for numpy
(`set_tensor_type("numpy")` or NND_TENSORS=numpy). `import nnd` stays light
either way: torch is imported when the first result arrives, not before.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

KINDS = ("torch", "numpy", "auto")
_installed: bool | None = None
_kind: str | None = None
_from_env: str | None = None  # NND_TENSORS, as first read


def loaded() -> ModuleType | None:
    """torch if the user's process already imported it, else None (never imports): for telling
    whether a value the user passed is a torch object, which it cannot be without the import."""
    return sys.modules.get("torch")


def set_tensor_type(kind: str) -> None:
    """What saved tensors become in this process, whatever else it imported.

    - ``"torch"`` (the default): torch tensors, as nnsight gives; torch is
      imported when the first result arrives. Without torch installed,
      numpy arrays.
    - ``"numpy"``: numpy arrays (bfloat16 arrives as float32); torch is never
      imported for a result. ``torch.from_numpy(x)`` shares the memory.
    - ``"auto"``: torch tensors if the process has imported torch by the
      time a result arrives, else numpy arrays.

    The environment variable ``NND_TENSORS`` sets the same at start-up; a
    call of this function wins over it.
    """
    global _kind
    if kind not in KINDS:
        raise ValueError(f"tensor type must be one of {', '.join(KINDS)}, not {kind!r}")
    _kind = kind


def tensor_type() -> str:
    """The current setting (see `set_tensor_type`)."""
    global _from_env
    if _kind is not None:
        return _kind
    if _from_env is None:  # a start-up setting: read once (a lookup that misses costs a KeyError each time)
        env = os.environ.get("NND_TENSORS", "torch").strip().lower() or "torch"
        if env not in KINDS:
            raise ValueError(f"NND_TENSORS must be one of {', '.join(KINDS)}, not {env!r}")
        _from_env = env
    return _from_env


def available() -> ModuleType | None:
    """torch if results should be torch tensors (see `set_tensor_type`), importing it if needed; else None."""
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
