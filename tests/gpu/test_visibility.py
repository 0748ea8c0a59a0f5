"""CUDA_VISIBLE_DEVICES as the daemon reads it: runs on every machine (no GPU needed)."""

from __future__ import annotations

import json

import pytest
from daemonproc import start_daemon


def _ps(d) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(d.cli("ps", "--json").stdout)}


@pytest.mark.parametrize("hidden", ["", "99"])
def test_cuda_visible_devices_is_respected(tmp_path, tiny_models, hidden, monkeypatch):
    """With no GPU visible (here by the variable) a cuda placement is refused before a worker starts,
    saying why, instead of failing deep in torch."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    d = start_daemon(tmp_path)
    try:
        d.cli("load", tiny_models["gpt2"])
        res = d.cli("dispatch", tiny_models["gpt2"], "--device", "cuda", check=False)
        assert res.returncode == 1
        assert "sees 0 GPUs" in res.stderr and "CUDA_VISIBLE_DEVICES" in res.stderr, res.stderr
        assert _ps(d)[tiny_models["gpt2"]]["state"] == "META"
    finally:
        d.stop()

