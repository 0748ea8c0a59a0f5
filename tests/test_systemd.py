"""The systemd unit: it verifies cleanly (alone and with the lab drop-in), its hardening
scores below 3.0 on `systemd-analyze security` (the drop-in costs nothing), its stop timing
fits the daemon's drain, and its ExecStart reads the shipped config file."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SYSTEMD = pathlib.Path(__file__).resolve().parent.parent / "systemd"
UNIT = SYSTEMD / "nnd.service"
LAB = SYSTEMD / "nnd-lab.conf"
CONFIG = SYSTEMD / "nnd.toml"
BINARY = "/opt/nnd/bin/nnd"  # the venv of the recipe (PEP 668: not the system interpreter)
ETC_CONFIG = "/etc/nnd/nnd.toml"

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


@pytest.fixture(scope="module")
def lab_unit(unit: pathlib.Path) -> pathlib.Path:
    """The unit with the lab drop-in merged in (a second [Service] section, as systemd merges drop-ins)."""
    path = unit.parent / "lab" / "nnd.service"
    path.parent.mkdir()
    path.write_text(unit.read_text() + "\n" + LAB.read_text())
    return path


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60)


def test_unit_verifies_cleanly(unit):
    res = _analyze("verify", str(unit))
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr


def _score(unit: pathlib.Path) -> float:
    res = _analyze("security", "--offline=yes", str(unit))
    text = res.stdout + res.stderr
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", text)
    assert match, text
    return float(match.group(1))


def test_exposure_score_below_3(unit):
    score = _score(unit)
    print(f"systemd-analyze security exposure: {score}")
    assert score < 3.0


def test_lab_drop_in_verifies_and_keeps_the_score(unit, lab_unit):
    res = _analyze("verify", str(lab_unit))
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr
    assert _score(lab_unit) <= _score(unit)
    s = _settings(LAB.read_text())
    assert "-/srv/models" in s["ReadOnlyPaths"]  # ProtectHome/PrivateTmp hide /home and /tmp: a model root
    assert s["LoadCredential"] == ["hf_token:/etc/nnd/hf_token"]
    assert "HF_TOKEN_PATH=%d/hf_token" in _settings(UNIT.read_text())["Environment"]


def test_exec_start_reads_the_shipped_config(unit, tmp_path):
    """The unit's own ExecStart, with /etc/nnd/nnd.toml replaced by the shipped file: it parses, and the
    values the unit counts on come from it."""
    exec_start = _settings(unit.read_text())["ExecStart"][0].replace(ETC_CONFIG, str(CONFIG))
    env = {"PATH": "/usr/bin:/bin", "STATE_DIRECTORY": str(tmp_path / "state"), "HOME": str(tmp_path)}
    res = subprocess.run([*exec_start.split(), "--print-config"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    lines = {line.split(" = ")[0]: line for line in res.stdout.splitlines() if " = " in line}
    assert lines["socket-group"].startswith('socket-group = "nnd"') and f"config {CONFIG}" in lines["socket-group"]
    assert lines["grace"].startswith("grace = 30") and f"config {CONFIG}" in lines["grace"]
    assert f'state-dir = "{tmp_path / "state"}"' in lines["state-dir"]  # systemd's StateDirectory=


def test_unit_settings():
    s = _settings(UNIT.read_text())
    exec_start = s["ExecStart"][0]
    assert exec_start == f"{BINARY} serve --config {ETC_CONFIG}"
    config = tomllib.loads(CONFIG.read_text())
    assert config["socket-group"] == "nnd"
    assert s["User"] == ["nnd"] and s["Group"] == ["nnd"]
    assert s["RuntimeDirectory"] == ["nnd"] and s["RuntimeDirectoryMode"] == ["0750"]
    assert s["StateDirectory"] == ["nnd"] and s["CacheDirectory"] == ["nnd"]
    assert "HF_HOME=%C/nnd" in s["Environment"]
    assert s["Restart"] == ["on-failure"]
    # SIGTERM to the daemon alone (it drains, then ends its workers), and time
    # for the drain plus the workers' exit before systemd SIGKILLs the rest.
    assert s["KillMode"] == ["mixed"]
    grace = float(config["grace"])
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
