"""Plans of graph shapes the engine has seen, reused.

A sweep sends the same block once per prompt: the same graph (nodes, module
paths, constants, source lines), only the invokes differ. Planning it again
(the model's module table, every node checked, causality) is work whose result
is already known, so a plan is kept per (model, graph bytes, edit graphs'
bytes, number of invokes) and handed out again.

A plan is reused only when running it cannot change it: not when it holds
values of earlier traces (a session's), and not when a constant is a tensor
(an in-place op on it would change the next run's constant). Those are planned
afresh. A cached plan is `shared`: a run that pauses, whose sync points add
nodes, goes on with a fork of it (`Plan.extended`: its own tables, the planned
nodes shared), and the same additions are planned once per cached plan too.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from nnd.v1 import graph_pb2

from . import plan

_SIZE = 128
_MAX_GRAPH_BYTES = 1 << 20  # a graph with big constants is not kept (128 of them would be a lot of memory)

_lock = threading.Lock()
_plans: OrderedDict[tuple[Any, ...], tuple[weakref.ref[torch.nn.Module], plan.Plan]] = OrderedDict()
hits = [0, 0]
"""[reused, planned]: how often a plan came from here (for tests and the bench)."""


def build(
    graph: graph_pb2.Graph,
    model: torch.nn.Module,
    n_invokes: int,
    max_constant_bytes: int = 0,
    *,
    edits: Sequence[graph_pb2.Graph] = (),
) -> plan.Plan:
    """`plan.build`, reusing the plan of an identical earlier request (see the module's docstring)."""
    graph_bytes = graph.SerializeToString(deterministic=True)
    if len(graph_bytes) > _MAX_GRAPH_BYTES:
        return plan.build(graph, model, n_invokes, max_constant_bytes, edits=edits)
    key = (id(model), n_invokes, graph_bytes, tuple(g.SerializeToString(deterministic=True) for g in edits))
    with _lock:
        found = _plans.get(key)
        if found is not None and found[0]() is model:
            _plans.move_to_end(key)
            hits[0] += 1
            return found[1]
    the_plan = plan.build(graph, model, n_invokes, max_constant_bytes, edits=edits)
    with _lock:
        hits[1] += 1
        if plan.reusable(the_plan.nodes.values()):
            the_plan.shared = True
            _plans[key] = (weakref.ref(model), the_plan)
            while len(_plans) > _SIZE:
                _plans.popitem(last=False)
    return the_plan


def clear() -> None:
    with _lock:
        _plans.clear()
