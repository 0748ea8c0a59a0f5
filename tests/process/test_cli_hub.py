"""`nnd pull` and `nnd list` (issue #30), the real command against a stand-in for the Hub on loopback
(tests/support/fakehub.py; no network): a pulled model lands in the Hugging Face cache with progress,
`nnd list` shows it with its size, a daemon loads it by its repo id offline, and the offline and
not-found cases say what happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fakehub
from daemonproc import start_daemon

REPO = "org/tiny"


def _nnd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nnd.cli", *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )


def test_pull_fills_the_cache_list_shows_it_and_the_daemon_loads_it_offline(tmp_path, tiny_models):
    cache = str(tmp_path / "hf-cache")
    with fakehub.serve(tiny_models["gpt2"], REPO) as endpoint:
        online = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
        pulled = _nnd("pull", REPO, env=online)
        assert pulled.returncode == 0, pulled.stderr
        assert "Fetching" in pulled.stderr and "100%" in pulled.stderr  # huggingface_hub's progress
        missing = _nnd("pull", "org/missing", env=online)
        assert missing.returncode == 1 and "org/missing is not on the Hub" in missing.stderr, missing.stderr
    snapshot = pulled.stdout.strip().rsplit(" ", 1)[1]
    for name in os.listdir(tiny_models["gpt2"]):
        with open(os.path.join(tiny_models["gpt2"], name), "rb") as a, open(os.path.join(snapshot, name), "rb") as b:
            assert a.read() == b.read(), name

    listed = _nnd("list", "--json", env={"HF_HUB_CACHE": cache})
    rows = {r["model"]: r for r in json.loads(listed.stdout)}
    size = sum(os.path.getsize(os.path.join(tiny_models["gpt2"], n)) for n in os.listdir(tiny_models["gpt2"]))
    assert rows[REPO]["size_bytes"] == size and rows[REPO]["revisions"] == ["main"], rows
    table = _nnd("list", env={"HF_HUB_CACHE": cache}).stdout
    assert table.startswith("NAME") and REPO in table and "KB" in table, table
    empty = _nnd("list", env={"HF_HUB_CACHE": str(tmp_path / "none")})
    assert empty.returncode == 0 and "nnd pull MODEL" in empty.stdout

    # A daemon reading that cache, offline, loads the pulled model by its repo id.
    d = start_daemon(tmp_path / "daemon", env={"HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"})
    try:
        loaded = d.cli("load", REPO)
        assert loaded.stdout.startswith(f"{REPO}: META GPT2LMHeadModel"), loaded.stdout
    finally:
        d.stop()


def test_pull_offline_says_so_and_how_to_turn_it_on(tmp_path):
    res = _nnd("pull", REPO, env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert res.returncode == 1
    assert "HF_HUB_OFFLINE=1" in res.stderr and "unset it" in res.stderr, res.stderr
    assert not os.listdir(tmp_path)  # nothing written
