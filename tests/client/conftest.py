"""Fixtures for client tests: a fake daemon and a model handle on it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
from fakedaemon import FakeNnd, gpt2_modules, serve

import nnd


@pytest.fixture(scope="session")
def _gpt2_modules():
    return gpt2_modules()


@pytest.fixture
def fake(_gpt2_modules) -> Iterator[tuple[FakeNnd, str]]:
    """A fresh fake daemon and its address."""
    service = FakeNnd(modules=_gpt2_modules)
    folder = tempfile.mkdtemp(prefix="nnd-fake-")
    address = f"unix://{folder}/nnd.sock"
    server = serve(service, f"{folder}/nnd.sock")
    yield service, address
    server.stop(None)


@pytest.fixture
def model(fake) -> nnd.TransformersModel:
    service, address = fake
    return nnd.TransformersModel("tiny-gpt2", address=address)
