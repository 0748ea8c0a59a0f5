"""The registry file: which models are loaded and dispatched, with their
placement, so a restarted daemon comes back with the same models."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from nnd.v1 import nnd_pb2

log = logging.getLogger("nnd.state")
VERSION = 1


@dataclass
class Record:
    name: str
    revision: str
    task: str
    trust_remote_code: bool
    keep_alive: str
    placement: dict[str, Any]
    dispatched: bool
    # The content hash of an uploaded model (its files are in <state_dir>/uploads/<hash>/).
    upload: str = ""
    # LoadModelRequest.options, as JSON (absent in files written before they existed).
    options: dict[str, Any] = field(default_factory=dict)
    # The checkpoint of an entry named after its load choices ("gpt2@dtype=bfloat16"); "" when the name is it.
    source: str = ""
    # Loaded under this short name (`nnd load PATH --name NAME`); absent in older files.
    short: bool = False

    def load_request(self) -> nnd_pb2.LoadModelRequest:
        req = nnd_pb2.LoadModelRequest(
            model=self.source or self.name,
            name=self.name if self.short else "",
            revision=self.revision,
            task=self.task,
            trust_remote_code=self.trust_remote_code,
            keep_alive=self.keep_alive,
            upload=self.upload,
        )
        json_format.ParseDict(self.placement, req.placement)
        json_format.ParseDict(self.options, req.options)
        return req


def write(path: str, entries: Iterable[Any]) -> None:
    records = []
    for e in entries:
        placement = e.dispatched_placement if e.dispatched_placement is not None else e.placement
        records.append(
            {
                "name": e.name,
                "revision": e.meta.revision,
                "task": e.meta.task,
                "trust_remote_code": e.trust_remote_code,
                "keep_alive": e.keep_alive,
                "placement": json_format.MessageToDict(placement),
                "dispatched": e.state in (nnd_pb2.DISPATCHED, nnd_pb2.DISPATCHING),
                "upload": e.upload,
                "options": json_format.MessageToDict(e.meta.ref.options),
                "source": e.meta.ref.source if e.meta.ref.source not in ("", e.name) and not e.upload else "",
                "short": getattr(e, "short", False),
            }
        )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Write-then-rename: a crash mid-write never leaves a torn file.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".registry-")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": VERSION, "models": records}, f, indent=2)
    os.replace(tmp, path)


def read(path: str) -> list[Record]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.error("ignoring unreadable state file %s: %s", path, exc)
        return []
    out = []
    for rec in data.get("models", []):
        try:
            out.append(Record(**rec))
        except TypeError as exc:
            log.error("ignoring bad record in %s: %s", path, exc)
    return out
