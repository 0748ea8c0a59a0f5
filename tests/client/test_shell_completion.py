"""`nnd completion SHELL` prints a hook, and the hook's protocol completes commands and options."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_the_completion_script_names_nnd(shell):
    res = subprocess.run([sys.executable, "-m", "nnd.cli", "completion", shell], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "nnd" in res.stdout and "_ARGCOMPLETE" in res.stdout


def _complete(tmp_path, line: str) -> set[str]:
    out = tmp_path / "completions"
    env = {**os.environ, "_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line)),
           "_ARGCOMPLETE_STDOUT_FILENAME": str(out), "_ARGCOMPLETE_IFS": "\n"}
    subprocess.run([sys.executable, "-m", "nnd.cli"], env=env, capture_output=True, timeout=60)
    return {w.strip() for w in out.read_text().split("\n") if w.strip()}


def test_commands_and_options_complete(tmp_path):
    assert {"dispatch"} <= _complete(tmp_path, "nnd dis")
    assert {"--device", "--device-map"} <= _complete(tmp_path, "nnd dispatch gpt2 --dev")
