"""Finding torch without importing it at `import nnd` time."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

_installed: bool | None = None


def loaded() -> ModuleType | None:
    """torch if the user's process already imported it, else None (never imports)."""
    return sys.modules.get("torch")


def available() -> ModuleType | None:
    """torch, importing it if it is installed (used when results arrive), else None."""
    global _installed
    mod = sys.modules.get("torch")
    if mod is not None:
        return mod
    if _installed is None:
        _installed = importlib.util.find_spec("torch") is not None
    if not _installed:
        return None
    import torch

    return torch
