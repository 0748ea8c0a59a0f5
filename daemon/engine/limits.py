"""Per-request limits the engine enforces (0 = unlimited)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    max_saved_bytes: int = 0
    max_invokes: int = 0
    max_sequence_length: int = 0
    max_new_tokens: int = 0
    max_constant_bytes: int = 0
