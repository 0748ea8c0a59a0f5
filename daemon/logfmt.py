"""The daemon's log lines: text for a terminal, or one JSON object a line (`--log-format json`) for
journald/Loki. Fields a line carries (`extra={"nnd": {...}}`: model, user, duration...) become JSON keys."""

from __future__ import annotations

import json
import logging
import time

TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "nnd", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str, fmt: str = "text", text: str = TEXT, **fields: str) -> None:
    """Log to stderr at `level`; `fields` go into every JSON line (a worker's model)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
        if fields:
            handler.addFilter(_Fields(fields))
    else:
        handler.setFormatter(logging.Formatter(text))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _Fields(logging.Filter):
    def __init__(self, fields: dict[str, str]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        record.nnd = {**self.fields, **(getattr(record, "nnd", None) or {})}
        return True
