"""GPU tests: run by `scripts/gpu-check` on a machine with CUDA, skipped elsewhere.

`NND_GPU_CHECK_DEVICE=cpu` runs the same tests with the weights on the CPU, to
debug the tests themselves on a machine without a GPU (tests that only mean
something on a GPU still skip then). Without that variable and without CUDA,
every test marked `cuda` skips with the reason.
"""

from __future__ import annotations

import os

import pytest

DEVICE = os.environ.get("NND_GPU_CHECK_DEVICE", "cuda")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if DEVICE != "cuda" or _cuda():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU here (scripts/gpu-check runs these on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    """Where the tests put the weights: "cuda", or "cpu" for a dry run."""
    return DEVICE


@pytest.fixture
def on_gpu(device: str) -> None:
    """Skip a test whose assertion is about GPU memory or kernels when dry-running on the CPU."""
    if device != "cuda":
        pytest.skip("only meaningful on a GPU (dry run on the CPU)")
