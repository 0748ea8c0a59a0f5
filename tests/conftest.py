"""Shared fixtures: tiny local models, and a real `nnd serve` subprocess on a
temporary unix socket."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "processes: the module's `daemon` runs its workers and helper as processes (what the test is about "
        "is processes: pids, deaths, memory coming back, what a process imports)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that start real daemons first, each module's tests in their own order. Under xdist
    (--dist loadfile) a module goes to the next free worker in collection order, and these are the
    long ones (a daemon start is ~8 s of CPU): started last, one of them kept a worker busy after the
    others had finished (on one run's durations, the last worker ended at 537 s; heaviest first, 515 s)."""
    heavy: set[pathlib.Path] = set()
    read: dict[pathlib.Path, bool] = {}
    for item in items:
        path = item.path
        if path not in read:
            read[path] = "start_daemon(" in path.read_text(encoding="utf-8", errors="replace")
        names = set(getattr(item, "fixturenames", ()))
        if read[path] or names & _REAL_DAEMONS or item.get_closest_marker("processes") is not None:
            heavy.add(path)
    items.sort(key=lambda item: item.path not in heavy)  # stable: a module's order is kept


# Fixtures that start a daemon with real worker and helper processes.
_REAL_DAEMONS = {"process_daemon", "fresh_daemon"}


@pytest.fixture(scope="session")
def long_gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny GPT-2 with 1024 positions and 4 layers: long enough generations
    and traces (seconds) to kill things in the middle of."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tinymodels.build("gpt2", tmp_path_factory.mktemp("models") / "long-gpt2")
    cfg = GPT2Config.from_pretrained(path)
    cfg.n_positions, cfg.n_layer = 1024, 4
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def inprocess_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the whole session whose workers and helper are threads of its own process
    (nnd_daemon/inprocess.py): clients still reach the worker over gRPC, but a dispatch costs no
    process start and no torch import."""
    d = start_daemon(tmp_path_factory.mktemp("daemon"), in_process=True)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def process_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the whole session with real worker and helper processes, for tests about
    processes (started only if one asks)."""
    d = start_daemon(tmp_path_factory.mktemp("process-daemon"))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def daemon(request: pytest.FixtureRequest) -> Daemon:
    """The session's shared daemon: the in-process one, or for a module marked
    `pytest.mark.processes` the one with real processes (tests that kill or restart a daemon
    use `start_daemon` for their own)."""
    marked = request.node.get_closest_marker("processes") is not None  # the module's node: its pytestmark
    return request.getfixturevalue("process_daemon" if marked else "inprocess_daemon")


@pytest.fixture
def fresh_daemon(tmp_path: pathlib.Path) -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that change daemon-wide state."""
    d = start_daemon(tmp_path)
    yield d
    d.stop()
