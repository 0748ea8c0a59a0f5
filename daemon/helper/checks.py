"""Checks of client-shaped content that run in the helper process: whether an
uploaded folder can be loaded, before the daemon stores it."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from nnd_daemon import errors
from nnd_daemon.helper.meta import check_config_file

# A file an upload may name: a plain name, no path (control/uploads.py takes the same).
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_upload(kind: str, folder: str) -> None:
    """Refuse content that cannot be loaded, before it is stored."""
    if kind == "exported":
        from nnd_daemon.export import exported

        exported.load_program(os.path.join(folder, exported.PROGRAM), on_meta=True)
        return
    check_config_file(folder)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except OSError:
        raise errors.InvalidArgument("the upload has no config.json: it is not a transformers checkpoint") from None
    except ValueError as exc:
        raise errors.InvalidArgument(f"config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise errors.InvalidArgument("config.json has no model_type: it is not a transformers config")
    check_references(folder)
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    f.keys()
            except (SafetensorError, OSError, ValueError) as exc:
                raise errors.InvalidArgument(f"{name} is not a safetensors file ({exc})") from None


def check_references(folder: str) -> None:
    """Refuse JSON that names files outside the upload: a shard index's weight_map
    and `*_file` entries must be plain names of the upload's own files, or
    transformers would read whatever path they give (another user's weights)."""
    names = set(os.listdir(folder))
    for name in sorted(names):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
        except ValueError as exc:
            raise errors.InvalidArgument(f"{name} is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            continue
        refs: list[Any] = []
        if name.endswith(".index.json"):
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict):
                raise errors.InvalidArgument(f"{name} has no weight_map")
            refs += weight_map.values()
        refs += [v for k, v in data.items() if isinstance(k, str) and k.endswith(("_file", "_files"))]
        for ref in refs:
            for target in ref if isinstance(ref, list) else [ref]:
                if target is None:
                    continue
                if not isinstance(target, str) or not _FILE.fullmatch(target) or target not in names:
                    raise errors.InvalidArgument(
                        f"{name} names {str(target)[:120]!r}: only the upload's own files, by plain name, may be named"
                    )
