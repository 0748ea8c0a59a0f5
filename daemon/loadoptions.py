"""LoadModelRequest.options (nnsight's `attn_implementation=` and `config=`): checked in the
daemon, applied to the checkpoint's config where a model is built (the helper's META model, the
worker's weights), so scans and traces see the same module tree."""

from __future__ import annotations

import json
from typing import Any

from nnd.v1 import nnd_pb2
from nnd_daemon import errors

# A config is a few KiB (a large label map: a few MiB), as config.json files are.
MAX_CONFIG_JSON_BYTES = 16 * 2**20


def check(options: nnd_pb2.LoadOptions) -> None:
    """Refuse options no config could be built from, before the helper sees them."""
    if len(options.config_json) > MAX_CONFIG_JSON_BYTES:
        raise errors.ResourceExhausted(
            f"options.config_json is {len(options.config_json)} bytes, over the limit of "
            f"{MAX_CONFIG_JSON_BYTES} bytes a config may have"
        )
    if options.config_json:
        _config_dict(options.config_json)
    name = options.attn_implementation
    # No "/": transformers reads "org/repo" as a Hub kernel to download and load, i.e. code.
    if name and not all(c.isalnum() or c in "_-|" for c in name):
        raise errors.InvalidArgument(
            f"attn_implementation {name!r} is not the name of an attention implementation transformers ships "
            "(kernels from the Hub, 'org/repo', are not loaded)"
        )


def _config_dict(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidArgument(f"options.config_json is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise errors.InvalidArgument("options.config_json must be a JSON object (a config's to_dict())")
    return data


def apply(config: Any, options: nnd_pb2.LoadOptions) -> Any:
    """The config a model is built from: the caller's config (`config_json`) if any, else the
    checkpoint's, with the caller's attention implementation."""
    if options.config_json:
        data = _config_dict(options.config_json)
        kind = data.get("model_type", "")
        if kind != getattr(config, "model_type", ""):
            raise errors.InvalidArgument(
                f"config= is a {kind or 'config without model_type'!r} config; the checkpoint's is "
                f"{config.model_type!r}: its weights would not fit"
            )
        try:
            config = type(config).from_dict(data)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"config= cannot be built: {type(exc).__name__}: {exc}") from None
    if options.attn_implementation:
        config._attn_implementation = options.attn_implementation
    return config


def describe(options: nnd_pb2.LoadOptions) -> str:
    """The options as an error message names them."""
    parts = []
    if options.attn_implementation:
        parts.append(f"attn_implementation={options.attn_implementation!r}")
    if options.config_json:
        parts.append("a config= of its own")
    return ", ".join(parts) or "no load options"
