"""The systemd unit: it verifies cleanly, its hardening scores below 3.0 on
`systemd-analyze security`, and its stop timing fits the daemon's drain."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

SYSTEMD = pathlib.Path(__file__).resolve().parent.parent / "systemd"
UNIT = SYSTEMD / "nnd.service"
BINARY = "/usr/local/bin/nnd"

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


def _settings(text: str) -> dict[str, list[str]]:
    """Key -> values of a unit file (keys may repeat)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The unit with ExecStart pointed at an executable that exists here (the
    real one lives in /usr/local/bin on an installed box)."""
    root = tmp_path_factory.mktemp("unit")
    wrapper = root / "nnd"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m nnd.cli "$@"\n')
    wrapper.chmod(0o755)
    text = UNIT.read_text()
    assert f"ExecStart={BINARY} serve" in text
    path = root / "nnd.service"
    path.write_text(text.replace(BINARY, str(wrapper)))
    return path


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60)


def test_unit_verifies_cleanly(unit):
    res = _analyze("verify", str(unit))
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr


def test_exposure_score_below_3(unit):
    res = _analyze("security", "--offline=yes", str(unit))
    text = res.stdout + res.stderr
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", text)
    assert match, text
    score = float(match.group(1))
    print(f"systemd-analyze security exposure: {score}")
    assert score < 3.0, text


def test_unit_settings():
    s = _settings(UNIT.read_text())
    exec_start = s["ExecStart"][0]
    assert exec_start.startswith(f"{BINARY} serve --socket-group nnd")
    assert s["User"] == ["nnd"] and s["Group"] == ["nnd"]
    assert s["RuntimeDirectory"] == ["nnd"] and s["RuntimeDirectoryMode"] == ["0750"]
    assert s["StateDirectory"] == ["nnd"] and s["CacheDirectory"] == ["nnd"]
    assert "HF_HOME=%C/nnd" in s["Environment"]
    assert s["Restart"] == ["on-failure"]
    # SIGTERM to the daemon alone (it drains, then ends its workers), and time
    # for the drain plus the workers' exit before systemd SIGKILLs the rest.
    assert s["KillMode"] == ["mixed"]
    grace = float(re.search(r"--grace (\S+)", exec_start).group(1))
    stop = float(s["TimeoutStopSec"][0].rstrip("s"))
    assert stop >= grace + 15, (grace, stop)
    assert s["DevicePolicy"] == ["closed"]
    assert any(v.startswith("char-nvidia*") for v in s["DeviceAllow"])
    assert s["CapabilityBoundingSet"] == [""]
    assert s["SystemCallFilter"] == ["@system-service"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules"):
        assert s[key] == ["yes"], key
    assert s["ProtectSystem"] == ["strict"]


def test_sysusers_creates_the_nnd_user(tmp_path):
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    res = subprocess.run(
        ["systemd-sysusers", "--dry-run", f"--root={tmp_path}", str(SYSTEMD / "nnd.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "Creating user 'nnd'" in res.stdout + res.stderr
