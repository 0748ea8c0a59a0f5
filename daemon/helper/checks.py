"""Checks of client-shaped content that run in the helper process: whether an
uploaded folder can be loaded, before the daemon stores it."""

from __future__ import annotations

import json
import os

from nnd_daemon import errors
from nnd_daemon.helper.meta import check_config_file


def check_upload(kind: str, folder: str) -> None:
    """Refuse content that cannot be loaded, before it is stored."""
    if kind == "exported":
        from nnd_daemon.worker import exported

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
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    f.keys()
            except (SafetensorError, OSError, ValueError) as exc:
                raise errors.InvalidArgument(f"{name} is not a safetensors file ({exc})") from None
