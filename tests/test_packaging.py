"""`pip install .` (not editable) ships every package of the tree: a new process kind or subpackage
that pyproject.toml does not list would be missing from a real install while the editable one works."""

from __future__ import annotations

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {name: ROOT / folder for name, folder in config["package-dir"].items()}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            found.add(".".join([name, *rel.parts]))
    assert found <= listed, f"not listed in pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"


def test_the_distribution_is_named_and_versioned_in_one_place():
    """`pip install nnd` would fetch an unrelated PyPI project: ours is `nnd-daemon`, versioned by `nnd.__version__`."""
    from importlib import metadata

    import nnd

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "nnd-daemon" and "version" in project["dynamic"]
    assert metadata.version("nnd-daemon") == nnd.__version__
    assert any(f"## {nnd.__version__} " in line for line in (ROOT / "CHANGELOG.md").read_text().splitlines())
    assert "Apache License" in (ROOT / "LICENSE").read_text() and project["license"] == "Apache-2.0"
