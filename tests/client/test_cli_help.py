"""`nnd --version`, and every option's --help names its default (a user should not have to read the source)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import nnd
from nnd import cli


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_version_prints_the_package_version():
    res = subprocess.run([sys.executable, "-m", "nnd.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"nnd {nnd.__version__}"


def test_every_option_with_a_default_shows_it_in_help():
    missing = []
    for name, p in _subparsers(cli.build_parser()).items():
        text = " ".join(p.format_help().split())
        for action in p._actions:
            d = action.default
            if not action.option_strings or d is None or d is False or d is argparse.SUPPRESS or isinstance(d, list):
                continue
            if f"(default: {d})" not in text:
                missing.append(f"nnd {name} {action.option_strings[-1]} (default {d!r})")
    assert not missing, "options whose --help hides their default:\n" + "\n".join(missing)
