"""Tiny models built once per session; a `run` helper that decodes results with engine.wire."""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))

import torch  # noqa: E402
import wire_results  # noqa: E402

from nnd.v1 import nnd_pb2  # noqa: E402
from nnd_daemon import engine  # noqa: E402

torch.set_num_threads(2)


class Loaded:
    def __init__(self, kind: str, path: pathlib.Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

        auto = AutoModelForMaskedLM if kind == "bert" else AutoModelForCausalLM
        self.kind = kind
        self.path = path
        self.model = auto.from_pretrained(path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        cfg = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            self.meta = auto.from_config(cfg)

    def run(self, request: nnd_pb2.TraceRequest, mode: str = "trace", **kw: Any) -> dict[int, Any]:
        out = self.stream(request, mode, **kw)
        assert out[-1].WhichOneof("kind") == "done"
        return wire_results.collect(out)

    def stream(self, request: nnd_pb2.TraceRequest, mode: str = "trace", **kw: Any) -> list[nnd_pb2.TraceResponse]:
        out: list[nnd_pb2.TraceResponse] = []
        model = self.meta if mode == "scan" else self.model
        engine.run(model, self.tokenizer, request, mode=mode, emit=out.append, **kw)
        return out


@pytest.fixture(scope="session")
def models(tiny_models: dict[str, str]) -> dict[str, Loaded]:
    """The session's tiny models (tests/conftest.py builds them once), loaded in this process."""
    return {k: Loaded(k, pathlib.Path(tiny_models[k])) for k in ("gpt2", "llama", "bert")}


@pytest.fixture(scope="session")
def gpt2(models: dict[str, Loaded]) -> Loaded:
    return models["gpt2"]


@pytest.fixture(scope="session")
def llama(models: dict[str, Loaded]) -> Loaded:
    return models["llama"]


@pytest.fixture(scope="session")
def bert(models: dict[str, Loaded]) -> Loaded:
    return models["bert"]
