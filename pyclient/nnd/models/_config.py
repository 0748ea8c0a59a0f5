"""`model.config` and module attributes as transformers users read them.

The daemon sends the config as data (ModelInfo.config_json); the client makes
it the transformers config class of its model_type when transformers is
importable (`model.config.n_head`, `.num_hidden_layers`, `.to_dict()`), else a
`Config` with the same typed values and the class's aliases."""

from __future__ import annotations

import importlib.util
import json
from typing import Any


class Config:
    """A model's config without transformers: attributes with their JSON
    types, transformers' aliases (`num_attention_heads` for GPT-2's `n_head`),
    `to_dict()` and `get(name, default)`."""

    def __init__(self, values: dict[str, Any], aliases: dict[str, str]) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_aliases", dict(aliases))

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        key = self.__dict__["_aliases"].get(name, name)
        if key in values:
            return values[key]
        raise AttributeError(f"the model's config has no {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[self._aliases.get(name, name)] = value  # a local change, as on a transformers config

    def __contains__(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._values

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __dir__(self) -> list[str]:
        return sorted({*self._values, *self._aliases, "to_dict", "get"})

    def __repr__(self) -> str:
        return f"Config {json.dumps(self._values, indent=2, sort_keys=True, default=str)}"


def build(text: str, summary: dict[str, str]) -> Any:
    """The config object of `ModelInfo.config_json` (a daemon that sends none: its string summary)."""
    if not text:
        return Config(dict(summary), {})
    data = json.loads(text)
    values, aliases = data.get("config", {}), data.get("aliases", {})
    if importlib.util.find_spec("transformers") is not None:
        made = _transformers_config(values)
        if made is not None:
            return made
    return Config(values, aliases)


def _transformers_config(values: dict[str, Any]) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    values = dict(values)
    values.pop("transformers_version", None)
    model_type = values.pop("model_type", None)
    try:
        if model_type:
            return AutoConfig.for_model(model_type, **values)
        return PretrainedConfig(**values)
    except Exception:  # noqa: BLE001 - a model_type this transformers lacks: the plain object instead
        return None
