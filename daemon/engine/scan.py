"""Scan support: run the graph under FakeTensorMode on the meta model, computing shapes only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

from . import rows


@contextlib.contextmanager
def fake_mode() -> Iterator[FakeTensorMode]:
    # Non-fake inputs (the meta model's parameters, our CPU index tensors) are converted on use.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        yield mode


def faker(mode: FakeTensorMode) -> Callable[[Any], Any]:
    """Turns decoded constants into fake tensors, so a Scan never computes on real data."""
    return lambda value: rows.map_tensors(value, mode.from_tensor)
