"""Shared fixtures: tiny local models, and a real `nnd serve` subprocess on a
temporary unix socket."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tinymodels  # noqa: E402
from daemonproc import Daemon, start_daemon  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny gpt2, llama and bert models with real tokenizers."""
    root = tmp_path_factory.mktemp("models")
    return {kind: str(tinymodels.build(kind, root / kind)) for kind in ("gpt2", "llama", "bert")}


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the whole session (tests that kill or restart it use
    `start_daemon` for their own)."""
    d = start_daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(tmp_path: pathlib.Path) -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that change daemon-wide state."""
    d = start_daemon(tmp_path)
    yield d
    d.stop()
