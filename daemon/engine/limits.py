"""Per-request limits the engine enforces while a request runs (0 = unlimited). What can be checked
from the request alone (its size, its number of invokes) is checked before it runs: daemon/intake.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    max_saved_bytes: int = 0
    max_sequence_length: int = 0
    max_new_tokens: int = 0
    max_constant_bytes: int = 0
