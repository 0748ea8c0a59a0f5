"""`nnd serve`'s configuration file: /etc/nnd/nnd.toml or --config FILE.

The file holds any `nnd serve` option under its flag's name (`max-queue-depth = 32`
or `max_queue_depth = 32`); what the command line gives wins. `resolve` fills the
namespace argparse made and says where each value came from, for --print-config.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from nnd.cli import serve_args as cli_serve_args

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT, FLAG = "default", "command line"


class ConfigError(ValueError):
    """A config file `nnd serve` refuses to start with (one line, naming the file and key)."""


def resolve(ns: argparse.Namespace) -> dict[str, str]:
    """Apply the config file to `ns` (options not given as flags); returns option -> source."""
    parser: argparse.ArgumentParser = ns._serve_parser
    given = getattr(ns, cli_serve_args.GIVEN, set())
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in cli_serve_args.NOT_IN_CONFIG}
    path = ns.config or (cli_serve_args.DEFAULT_CONFIG if os.path.exists(cli_serve_args.DEFAULT_CONFIG) else None)
    sources = {dest: FLAG if dest in given else DEFAULT for dest in actions}
    if not path:
        return sources
    table = _read(path)
    for key, value in table.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"{path}: unknown option {key!r} (the keys are `nnd serve`'s flags without '--')")
        if dest in given:
            continue  # the command line wins
        setattr(ns, dest, _convert(path, key, action, value))
        sources[dest] = f"config {path}"
    return sources


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    # A [serve] table is accepted too, for files that later hold other sections.
    serve = data.pop("serve", {})
    if not isinstance(serve, dict):
        raise ConfigError(f"{path}: 'serve' must be a table")
    return {**data, **serve}


def _convert(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"{path}: {key}"
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} takes true or false, not {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{where} takes a list of strings")
        return list(items)
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        raise ConfigError(f"{where} takes one value, not {value!r}")
    kind = action.type or str
    try:
        out = kind(value) if kind is not str else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a {getattr(kind, '__name__', kind)}") from None
    if action.choices and out not in action.choices:
        raise ConfigError(f"{where}: {out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def render(ns: argparse.Namespace, sources: dict[str, str]) -> str:
    """The effective configuration as TOML a config file could hold, each value's source beside it."""
    lines = []
    for dest in sorted(sources):
        value = getattr(ns, dest, None)
        key = dest.replace("_", "-")
        text = _toml(value) if value is not None else None
        left = f"{key} = {text}" if text is not None else f"# {key} (unset)"
        lines.append(f"{left:<48} # {sources[dest]}")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
