"""The META state of a model, as the daemon keeps it: a description (module
tree, sizes, config summary) and data (aliases, stored edits), no module. The
module, config and tokenizer live in the helper process (helper/meta.py builds
them; control/helper_supervisor.py runs it): building them is work whose cost a client
shapes. Building reads no weight byte."""

from __future__ import annotations

import json
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from nnd.v1 import helper_pb2, nnd_pb2
from nnd_daemon import aliases
from nnd_daemon.control.edits import EditStore


@dataclass
class MetaModel:
    """Everything the daemon keeps of a model that costs (almost) no memory."""

    ref: helper_pb2.HelperModel  # how the helper (re)builds it
    description: helper_pb2.MetaDescription
    # Module aliases (the standard set, then `rename=` entries): a daemon/aliases.py AliasTable.
    aliases: Any = None
    # Graphs stored by CreateEdit, applied to the requests that name them.
    edits: EditStore = field(default_factory=EditStore)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def source(self) -> str:
        return self.ref.source

    @property
    def revision(self) -> str:
        return self.ref.revision

    @property
    def task(self) -> str:
        return self.description.task

    @property
    def has_tokenizer(self) -> bool:
        return self.description.has_tokenizer

    @property
    def config(self) -> Any:
        """The config fields control/tplaunch.check reads, as attributes."""
        return types.SimpleNamespace(**json.loads(self.description.tp_config_json or "{}"))

    def renamed(self, renames: Any) -> Any:
        """The model's aliases plus `LoadModelRequest.rename` entries (all or none), for the one
        handle that asked: the model's own table is left as it was, so handles never collide."""
        import copy


        rules = aliases.rules(renames)
        with self.lock:
            table = copy.deepcopy(self.aliases)
        table.add_rules(rules)
        return table

    @property
    def architecture(self) -> str:
        return self.description.architecture

    def num_parameters(self) -> int:
        return self.description.num_parameters

    def estimate_bytes(self, dtype: str) -> int:
        """Weight bytes needed for `dtype` (the model's default dtype when empty/auto)."""
        name = dtype if dtype and dtype != "auto" else ""
        sizes = self.description.estimated_bytes
        return sizes[name] if name in sizes else sizes.get("float32", 0)

    def summary(self) -> dict[str, str]:
        return dict(self.description.summary)

    def modules(self, devices: dict[str, str] | None = None) -> list[nnd_pb2.ModuleInfo]:
        devices = devices or {}
        names = self.aliases.aliases_of() if self.aliases is not None else {}
        out = []
        for described in self.description.modules:
            info = nnd_pb2.ModuleInfo()
            info.CopyFrom(described)
            for p in info.parameters:
                p.device = devices.get(f"{info.path}.{p.name}" if info.path else p.name, "meta")
            info.aliases.extend(sorted(names.get(info.path, ())))
            out.append(info)
        return out


def describe(helper: Any, ref: helper_pb2.HelperModel) -> MetaModel:
    """The META model `ref` names, built (in the helper) and described."""
    description = helper.describe(ref)
    tree = [(m.path, m.type) for m in description.modules]
    return MetaModel(ref=ref, description=description, aliases=aliases.AliasTable.of_tree(tree))
