"""Stored edits: graphs the daemon applies before every request that names them.

Each model keeps its own store (on its MetaModel). An edit holds its whole
stack of graphs (its bases' first), so deleting a base later leaves the edits
built on it unchanged. Requests name edits in `TraceRequest.edits`; the
daemon hands the worker exactly the stacks a request names. Edits live in the
daemon's memory: a restarted daemon has none.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2
from nnd_daemon import errors

MAX_EDITS = 1024  # per model: anonymous edits a client never deletes must not grow without bound
# Graphs in one edit's stack (its bases' and its own): every request naming it carries them all.
MAX_STACK = 64


@dataclass(frozen=True)
class Edit:
    id: str
    graphs: tuple[graph_pb2.Graph, ...]
    named: bool
    # Who created it (identity.py's user name; "" when not known).
    created_by: str = ""

    def stack(self) -> worker_pb2.EditStack:
        """The edit's graphs as a worker (and the helper) receives them."""
        return worker_pb2.EditStack(graphs=self.graphs)

    def info(self, model: str) -> nnd_pb2.EditInfo:
        return nnd_pb2.EditInfo(
            id=self.id,
            model=model,
            graphs=len(self.graphs),
            nodes=sum(len(g.nodes) for g in self.graphs),
            named=self.named,
            created_by=self.created_by,
        )


class EditStore:
    """One model's edits, by id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._edits: dict[str, Edit] = {}
        self._serial = itertools.count(1)

    def get(self, edit_id: str) -> Edit:
        with self._lock:
            edit = self._edits.get(edit_id)
        if edit is None:
            raise errors.NotFound(f"no stored edit {edit_id!r} for this model; ListEdits shows the ones there are")
        return edit

    def create(
        self,
        graph: graph_pb2.Graph,
        *,
        name: str = "",
        base: Iterable[str] = (),
        replace: bool = False,
        max_bytes: int = 0,
        user: str = "",
    ) -> Edit:
        base = list(base)
        if len(set(base)) != len(base):
            raise errors.InvalidArgument("an edit's bases must each be named once")
        graphs = [g for b in base for g in self.get(b).graphs]
        graphs.append(graph)
        if len(graphs) > MAX_STACK:
            raise errors.ResourceExhausted(
                f"the edit would stack {len(graphs)} graphs (its bases' and its own), over the limit of {MAX_STACK}"
            )
        size = sum(g.ByteSize() for g in graphs)
        if max_bytes and size > max_bytes:
            raise errors.ResourceExhausted(
                f"the edit with its bases is {size} bytes, over the limit max_request_bytes={max_bytes} "
                "(every request naming it carries them all)"
            )
        with self._lock:
            if len(self._edits) >= MAX_EDITS and (not name or name not in self._edits):
                raise errors.ResourceExhausted(
                    f"this model holds {MAX_EDITS} edits, the most it keeps; delete some (clear_edits) first"
                )
            if name:
                if name in self._edits and not replace:
                    raise errors.AlreadyExists(f"an edit named {name!r} exists; pass replace to overwrite it")
                edit_id = name
            else:
                edit_id = f"edit-{next(self._serial)}"
                while edit_id in self._edits:
                    edit_id = f"edit-{next(self._serial)}"
            edit = Edit(edit_id, tuple(graphs), bool(name), user)
            self._edits[edit_id] = edit
        return edit

    def delete(self, edit_id: str) -> None:
        with self._lock:
            if self._edits.pop(edit_id, None) is None:
                raise errors.NotFound(f"no stored edit {edit_id!r} for this model")

    def all(self) -> list[Edit]:
        with self._lock:
            return list(self._edits.values())

    def stacks(self, ids: Iterable[str], max_bytes: int = 0) -> dict[str, worker_pb2.EditStack]:
        """The graphs of the named edits, as the worker receives them (at most `max_bytes` of them)."""
        edits = {i: self.get(i) for i in dict.fromkeys(ids)}
        size = sum(g.ByteSize() for e in edits.values() for g in e.graphs)
        if max_bytes and size > max_bytes:
            raise errors.ResourceExhausted(
                f"the edits the request names are {size} bytes together, over the limit max_request_bytes={max_bytes}"
            )
        return {i: e.stack() for i, e in edits.items()}
