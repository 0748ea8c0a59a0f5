"""Which hook certainly fires after which, known from the module tree alone.

The check must never reject a valid graph, so it only answers "after" when
the tree says so: a later call, a module's own pre/forward hooks, a parent
around its children, and the numbered children of a ModuleList/Sequential
(layers run in index order). Siblings of an ordinary module may run in any
order (Llama's MLP registers act_fn after down_proj but calls it before), so
those are left to the executor's run-time check.
"""

from __future__ import annotations

PRE, POST, RESULT = "pre", "post", "result"
HookKey = tuple[str, str, int]  # (module path, PRE | POST | RESULT, call)


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def after(a: HookKey, b: HookKey, containers: set[str]) -> bool:
    """True only when hook `a` certainly fires after hook `b` in a forward (or a generation)."""
    (pa, ka, ca), (pb, kb, cb) = a, b
    if ka == RESULT or kb == RESULT:
        return ka == RESULT and kb != RESULT
    if ca != cb:  # call k of every module belongs to step k
        return ca > cb
    if pa == pb:
        return ka == POST and kb == PRE
    if _contains(pa, pb):  # a is around b
        return ka == POST
    if _contains(pb, pa):  # b is around a
        return kb == PRE
    parts_a, parts_b = pa.split("."), pb.split(".")
    depth = 0
    while parts_a[depth] == parts_b[depth]:
        depth += 1
    parent = ".".join(parts_a[:depth])
    child_a, child_b = parts_a[depth], parts_b[depth]
    if parent in containers and child_a.isdigit() and child_b.isdigit():
        return int(child_a) > int(child_b)
    return False
