"""Runs a plan's nodes at the hooks of one forward (or of every step of a generation).

Dataflow time: a module value is bound at its module's hook; every node runs
as soon as all its inputs exist, in id order, until nothing more can run.
Top-level nodes live in the root frame; a loop scope gets one frame per
selected step.

Gradients (grads.py) run inside this same loop: a Backward node is an op whose
execution drives autograd, and autograd's tensor hooks bind Grad nodes and
apply SetGrad nodes as gradients arrive. Caches record module values at the
end of each hook, after the graph's writes there.

Sync points (interact.py): with an Interaction, every module's calls are
counted and modules get hooks when a node first names them; once
the values the client asked for exist, the executor sends them and waits for
the client's next nodes at the hook where it stands. Nodes for that hook are
handled there; nodes for hooks already passed are an out-of-order error.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from nnd.v1 import contract, graph_pb2

from .. import errors
from . import caches, grads, modules, rows, sharding, weights
from .failures import where, wrap
from .hooks import HookSet
from .interact import Interaction
from .plan import POST, PRE, RESULT, RUNNABLE, Const, Plan, PlanNode, Ref, Seq

HookKey = tuple[str, str, int]


class StopForward(BaseException):
    """Raised at a hook once every node has run and the graph has a Stop; caught by the engine.

    A BaseException so that model code catching Exception cannot swallow it."""


class Frame:
    def __init__(self, scope: int, step: int, nodes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> None:
        self.scope = scope
        self.step = step
        self.values: dict[int, Any] = {}
        self.bound: dict[int, HookKey] = {}  # module node -> the hook that bound it
        pending, runnable = nodes  # Plan.frame_nodes
        self.pending: set[int] = set(pending)
        # In id order; a dict, so a node run by a nested run_ready (inside a backward pass) leaves at once.
        self.runnable: dict[int, None] = dict.fromkeys(runnable)
        self.live = False  # in the executor's `_live` (Executor._revive)

    def done(self) -> bool:
        return not self.pending


def _order(frame: Frame) -> tuple[int, int]:
    return (frame.scope, frame.step)


class Executor:
    def __init__(
        self,
        plan: Plan,
        model: torch.nn.Module,
        batch_rows: list[tuple[int, int]],
        batch_size: int,
        *,
        total_steps: int,
        cancelled: Callable[[], bool],
        scan: bool = False,
        constant: Callable[[Any], Any] = lambda v: v,
        interaction: Interaction | None = None,
        send: Callable[[dict[int, Any]], None] | None = None,
        max_constant_bytes: int = 0,
    ) -> None:
        self.plan = plan
        self.modules = modules.table(model)
        self._weight_storages: dict[int, Any] | None = None  # weights.storages, read at the first write
        self.rows = batch_rows
        self.batch_size = batch_size
        self.total_steps = total_steps
        self.step = 0  # the generation step running now (begin_step)
        self.cancelled = cancelled
        self.scan = scan
        self.constant = constant  # makes decoded constants fake in a Scan
        self.root = Frame(0, 0, plan.frame_nodes(0))
        self.loops: dict[tuple[int, int], Frame] = {}
        # Every frame, root first, then loops by (scope, step): run_ready's order; and the loop frames by step
        # and by scope. `_live`: those that may have nodes to run, in the same order (a generation makes a
        # frame per step, and run_ready runs at every hook: walking the spent ones made each step's cost
        # grow with the steps before it).
        self._frames: list[Frame] = [self.root]
        self._live: list[Frame] = []
        self._at_step: dict[int, list[Frame]] = {}
        self._of_scope: dict[int, list[Frame]] = {0: [self.root]}
        self._revived = 0  # frames made live so far: a pass of run_ready that saw fewer goes round again
        if self.root.runnable:
            self._revive(self.root)
        self._picked: dict[tuple[int, int], range | frozenset[int]] = {}  # selected()'s memo
        self._selecting: tuple[tuple[int, int], dict[int, list[int]]] | None = None  # _scopes_at's index
        self.events: dict[HookKey, list[int]] = {}
        # A loop node's hook, by its call within the step and its scope: (path, hook) -> {call: {scope: ids}}.
        self.loop_events: dict[tuple[str, str], dict[int, dict[int, list[int]]]] = {}
        for node in plan.nodes.values():
            if node.target is None:
                continue
            if node.scope == 0:
                self.events.setdefault((node.target.path, node.hook, node.target.call), []).append(node.id)
            else:
                self._index_loop_node(node)
        self.completed: set[HookKey] = set()
        self.current: HookKey | None = None
        self.skips: dict[str, Any] = {}
        self.writes: list[PlanNode] = []  # writes applied, for errors raised later by the model
        skip_paths = {n.target.path for n in plan.nodes.values() if n.kind == "skip" and n.hook == PRE and n.target}
        self.interaction = interaction
        self.send = send
        self.max_constant_bytes = max_constant_bytes
        self.forward_done = False
        self.step = -1  # the generation step running (its root call)
        # Interactive: nodes added later may name any module, so every module's calls are counted.
        self.hooks = HookSet(
            model,
            plan.paths,
            skip_paths,
            self.at_pre,
            self.at_post,
            self.take_skip,
            plan.ops,
            count_all=interaction is not None,
        )
        # Tensor parallel: values the graph touches are gathered whole at the hook and split back after.
        self.shard = sharding.of(model)
        if plan.ops and self.shard is not sharding.NONE:
            raise errors.InvalidArgument(
                "operations inside a forward (`.source`) are not available on a tensor-parallel model: each rank "
                "sees only its shard of them",
                exc_type="NotImplementedError",
            )
        for node in plan.nodes.values():  # values of earlier traces of a session
            if node.kind == "external":
                self.root.values[node.id] = node.value
        self.grad_sources = set() if scan else plan.grad_sources
        # Param node -> its leaf in this request (grads.py): backward passes accumulate into its .grad.
        self.params: dict[int, torch.Tensor] = {}
        self.caches = caches.Caches(plan, list(self.modules), batch_rows, batch_size)

    # ------------------------------------------------------------ frames and steps

    def frames(self) -> list[Frame]:
        """The root frame, then the loops' by (scope, step). Not to be changed by the caller."""
        return self._frames

    def _add_loop(self, scope: int, step: int, nodes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> Frame:
        frame = self.loops[(scope, step)] = Frame(scope, step, nodes)
        bisect.insort(self._frames, frame, lo=1, key=_order)
        bisect.insort(self._at_step.setdefault(step, []), frame, key=lambda f: f.scope)
        bisect.insort(self._of_scope.setdefault(scope, []), frame, key=lambda f: f.step)
        if frame.runnable:
            self._revive(frame)
        return frame

    def _revive(self, frame: Frame) -> None:
        """`frame` has nodes to run (again): run_ready looks at it until they have run."""
        if not frame.live:
            frame.live = True
            self._revived += 1
            bisect.insort(self._live, frame, key=_order)

    def _index_loop_node(self, node: PlanNode) -> None:
        assert node.target is not None
        by_call = self.loop_events.setdefault((node.target.path, node.hook), {})
        by_call.setdefault(node.target.call, {}).setdefault(node.scope, []).append(node.id)

    def _scopes_at(self, step: int) -> list[int]:
        """The loop scopes that select `step`, from an index built once per run length and number of
        scopes (every step of a generation asks; a sync point's new graph only adds scopes)."""
        n = len(self.plan.scopes)
        if step >= self.total_steps:  # past the planned length (not indexed: the index would grow per step)
            return [s for s in range(1, n + 1) if self.selected(s, step)]
        key = (n, self.total_steps)
        if self._selecting is None or self._selecting[0] != key:
            index: dict[int, list[int]] = {}
            for scope in range(1, n + 1):
                for s in self._steps(scope, self.total_steps):
                    index.setdefault(s, []).append(scope)
            self._selecting = (key, index)
        return self._selecting[1].get(step, [])

    def selected(self, scope: int, step: int) -> bool:
        """contract.selects for loop `scope` at `step`. Every hook of every step asks this of every
        scope, so the steps a scope picks are worked out once per (scope, run length) and kept (a
        scope's selector never changes once planned: a sync point's new graph only adds scopes)."""
        return step in self._steps(scope, max(self.total_steps, step + 1))

    def _steps(self, scope: int, total: int) -> range | frozenset[int]:
        """The steps loop `scope` picks in a run of `total` steps (selected()'s memo)."""
        picked = self._picked.get((scope, total))
        if picked is None:
            steps = contract.steps_of(self.plan.scopes[scope - 1], total)
            picked = self._picked[(scope, total)] = steps if isinstance(steps, range) else frozenset(steps)
        return picked

    def begin_step(self, step: int) -> None:
        self.step = step
        added = [
            self._add_loop(scope, step, self.plan.frame_nodes(scope))
            for scope in self._scopes_at(step)
            if (scope, step) not in self.loops
        ]
        if added:  # a loop's nodes that need only top-level values run now (no other frame can use them)
            self.run_ready(added)

    # ------------------------------------------------------------ hooks

    def poll(self) -> None:
        if self.cancelled():
            raise errors.Cancelled("the request was cancelled")

    def collect(self, path: str, hook: str, call: int) -> list[tuple[Frame, PlanNode]]:
        nodes = self.plan.nodes
        found = [(self.root, nodes[i]) for i in self.events.get((path, hook, call), ())]
        by_call = self.loop_events.get((path, hook))
        if by_call:  # the frames of the step each loop node's call falls in, and their scope's nodes there
            for within, by_scope in by_call.items():
                for frame in self._at_step.get(call - within, ()):
                    found.extend((frame, nodes[i]) for i in by_scope.get(frame.scope, ()))
        if len(found) > 1:
            found.sort(key=lambda fn: fn[1].id)
        return found

    def at_pre(self, path: str, call: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.poll()
        if path == "":
            self.step = call
            self.begin_step(call)
        events = self.collect(path, PRE, call)
        if not events and not self.caches.wants(path):
            return None
        key = (path, PRE, call)
        self.current = key
        state: list[Any] = self.shard.enter(path, PRE, [list(args), dict(kwargs)])
        changed = self.shard.sharded(path, PRE)
        parts: list[tuple[int, Any]] = []
        while events:
            for frame, node in events:
                if node.kind == "module":
                    if node.id in self.grad_sources and node.target is not None:
                        changed = grads.require_grad_pre(node.target.point, state) or changed
                    self.bind(frame, node, key, self.read_pre(node, state))
                elif node.kind == "set":
                    self.write_pre(node, state, self.write_value(frame, node, self.pre_like(node, state)))
                    changed = True
                elif node.kind == "skip":
                    like = rows.first_tensor(state)
                    value = self.write_value(frame, node, like)
                    if node.invoke is None:
                        self.skips[path] = self.shard.leave(path, POST, value)
                    else:  # every invoke skips (plan.py): the forward is skipped, their rows stacked
                        parts.append((self.rows[node.invoke][0], value, node))
            events = self.settle(key)
        if parts:
            parts.sort(key=lambda p: p[0])
            stacked = self.guard(parts[-1][2], lambda: rows.concat_rows([v for _, v, _ in parts]))
            self.skips[path] = self.shard.leave(path, POST, stacked)
        self.finish_hook(key, record=lambda: self.caches.record(path, PRE, call, state))
        if changed:
            state = self.shard.leave(path, PRE, state)
            return tuple(state[0]), state[1]
        return None

    def at_post(self, path: str, call: int, output: Any) -> Any:
        self.poll()
        events = self.collect(path, POST, call)
        if not events and not self.caches.wants(path):
            return None
        key = (path, POST, call)
        self.current = key
        state = [self.shard.enter(path, POST, output)]
        changed = self.shard.sharded(path, POST)
        while events:
            for frame, node in events:
                if node.kind == "module":
                    if node.id in self.grad_sources:
                        changed = grads.require_grad(state) or changed
                    self.bind(frame, node, key, self.view(state[0], node))
                else:  # set, or skip of one invoke's rows
                    value = self.write_value(frame, node, rows.first_tensor(state[0]))
                    if node.invoke is None or self.replaces(node, state[0], value):
                        state[0] = value
                        changed = True
                    else:
                        self.refuse_weight_write(node, sharding.leaves(state[0]))
                        start, stop = self.rows[node.invoke]
                        self.guard(
                            node,
                            lambda v=value, a=start, b=stop: rows.write_rows(state[0], v, a, b, self.batch_size),
                        )
            events = self.settle(key)
        self.finish_hook(key, record=lambda: self.caches.record(path, POST, call, state[0]))
        return self.shard.leave(path, POST, state[0]) if changed else None

    def at_result(self, result: Any) -> None:
        events = self.collect("", RESULT, 0)
        key = ("", RESULT, 0)
        self.current = key
        state = [result]
        while events:
            for frame, node in events:
                if node.id in self.grad_sources:
                    grads.require_grad(state)
                self.bind(frame, node, key, self.view(state[0], node))
            events = self.settle(key)
        self.finish_hook(key, stop=False)
        self.forward_done = True

    def replaces(self, node: PlanNode, current: Any, value: Any) -> bool:
        """A write of another shape by an invoke that owns the whole batch replaces the value (as
        nnsight's `.output = smaller` does) rather than broadcasting into its rows."""
        start, stop = self.rows[node.invoke] if node.invoke is not None else (0, self.batch_size)
        return (
            (start, stop) == (0, self.batch_size)
            and isinstance(current, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and (value.shape != current.shape or self.weight_named(current) is not None)  # a weight: swapped, never written
        )

    def take_skip(self, path: str) -> tuple[bool, Any]:
        if path in self.skips:
            return True, self.skips.pop(path)
        return False, None

    def finish_hook(self, key: HookKey, *, stop: bool = True, record: Callable[[], None] | None = None) -> None:
        self.run_ready()
        if record is not None:
            record()
        self.completed.add(key)
        self.current = None
        finished = self.interaction is None or self.interaction.finished
        if stop and finished and self.plan.has_stop and all(f.done() for f in self.frames()):
            raise StopForward

    def done_before_the_forward(self) -> bool:
        """A Stop, and every other node already ran before any hook (a weight saved, constants):
        the forward has nothing left to give, so it does not run at all (a model whose inputs a
        placeholder invoke cannot feed is never called)."""
        if not self.plan.has_stop or self.plan.scopes or (self.interaction is not None):
            return False
        if any(n.kind == "cache" for n in self.plan.nodes.values()):
            return False
        return all(f.done() for f in self.frames())

    # ------------------------------------------------------------ sync points

    def settle(self, key: HookKey | None) -> list[tuple[Frame, PlanNode]]:
        """Run what can run; at a sync point pause, until the client adds nodes for hook `key`
        (the one the forward stands at, returned to be handled there) or asks for a value not there yet."""
        self.run_ready()
        inter = self.interaction
        while inter is not None and inter.due(self.has_value):
            late = self.pause(key)
            if late:
                return late
            self.run_ready()
        return []

    def pause(self, key: HookKey | None) -> list[tuple[Frame, PlanNode]]:
        inter = self.interaction
        assert inter is not None and self.send is not None
        self.send({i: inter.sent_as(i, self.value_of(i)) for i in inter.want})
        inter.paused_at = self.plan.nodes[inter.want[-1]].proto
        msg = inter.wait()
        self.plan, added = self.plan.extended(msg.graph, self.max_constant_bytes)
        for path in list(self.plan.paths):
            self.hooks.watch(path)
        late = self.attach(added, key)
        self.check_wants()
        if inter.finished:
            self.hooks.stop_counting()
        return late

    def check_wants(self) -> None:
        inter = self.interaction
        assert inter is not None
        for i in inter.want:
            node = self.plan.nodes.get(i)
            if node is None or node.kind in ("stop", "cache", "set", "skip", "set_grad"):
                raise errors.InvalidArgument(f"a sync point asks for node {i}, which is not a value of the request")

    def frames_of(self, scope: int) -> list[Frame]:
        return self._of_scope.get(scope, [])

    def has_value(self, node_id: int) -> bool:
        node = self.plan.nodes.get(node_id)
        return node is not None and any(node_id in f.values for f in self.frames_of(node.scope))

    def value_of(self, node_id: int) -> Any:
        return next(f.values[node_id] for f in self.frames_of(self.plan.nodes[node_id].scope) if node_id in f.values)

    def attach(self, added: list[PlanNode], key: HookKey | None) -> list[tuple[Frame, PlanNode]]:
        """Make nodes added while paused part of the run; return those that belong at hook `key`."""
        late: list[tuple[Frame, PlanNode]] = []
        for node in added:
            site = self.plan.ops.get(node.target.path) if node.target is not None else None
            if site is not None and node.target is not None and node.target.path not in self.hooks.ops:
                self.hooks.add_op(node.target.path, site)  # an operation first named after a sync point
            if node.kind == "cache":
                raise errors.InvalidArgument(f"{where(node.proto)}\nopen a cache before the first sync point")
            if node.kind in ("backward", "grad", "set_grad"):
                raise errors.InvalidArgument(
                    f"{where(node.proto)}\ngradients cannot be added after a sync point",
                    exc_type="NotImplementedError",
                )
            if (
                node.kind == "skip"
                and node.hook == PRE
                and node.target
                and node.target.path not in self.hooks.skip_paths
            ):
                raise errors.InvalidArgument(
                    f"{where(node.proto)}\na whole-batch skip must be recorded before the first sync point"
                )
            if node.scope == 0:
                late += self.attach_to(self.root, node, key)
                continue
            if node.target is not None:
                self._index_loop_node(node)
            # Steps that have begun already run it from now on; later steps pick it up in begin_step.
            for step in range(self.step + 1):
                if self.selected(node.scope, step):
                    frame = self.loops.get((node.scope, step))
                    if frame is None:
                        frame = self._add_loop(node.scope, step)
                    late += self.attach_to(frame, node, key)
        return late

    def attach_to(self, frame: Frame, node: PlanNode, key: HookKey | None) -> list[tuple[Frame, PlanNode]]:
        if node.kind not in ("stop", "external"):
            frame.pending.add(node.id)
        if node.kind in RUNNABLE:
            frame.runnable[node.id] = None
            self._revive(frame)
        if node.target is None:
            return []
        hook = (node.target.path, node.hook, node.target.call + (frame.step if frame.scope else 0))
        if hook == key:
            return [(frame, node)]
        if self.passed(hook):
            raise self.out_of_order(node)
        if frame.scope == 0:
            self.events.setdefault(hook, []).append(node.id)
        return []

    def passed(self, hook: HookKey) -> bool:
        path, kind, call = hook
        if kind == RESULT or self.forward_done:
            return self.forward_done
        where = self.plan.ops.get(path)
        # An operation's call k runs inside its module's call k: gone once that call has ended, or
        # when that call began before the module's forward was instrumented.
        if where is not None and (call < self.hooks.since.get(path, 0) or self.passed((where[0], POST, call))):
            return True
        made = self.hooks.calls_of(path)
        if kind == PRE:
            return made > call
        return made > call and call not in self.hooks.active.get(path, ())

    def out_of_order(self, node: PlanNode) -> errors.NndError:
        assert node.target is not None and self.interaction is not None
        point = {graph_pb2.OUTPUT: "output", graph_pb2.INPUT: "input", graph_pb2.INPUTS: "inputs"}.get(
            node.target.point, "result"
        )
        name = repr(node.target.path) if node.target.path else "the model"
        paused = self.interaction.paused_at
        at = where(paused) if paused is not None else "a sync point"
        return errors.InvalidArgument(
            f"{where(node.proto)}\nasks for the {point} of {name} (call {node.target.call}), which the model "
            f"already ran past: the run was paused for a value at {at}, so lines after it can only use modules "
            "that run later in the forward",
            exc_type="OutOfOrderError",
        )

    def drain(self) -> None:
        """After the forward: answer the client until it finishes (values of nodes that need no module)."""
        self.forward_done = True
        inter = self.interaction
        if inter is None:
            return
        while True:
            self.settle(None)
            if inter.finished:
                return
            missing = next(i for i in inter.want if not self.has_value(i))
            node = self.plan.nodes[missing]
            frame = next(iter(self.frames_of(node.scope)), self.root)
            late = self.missing_input(frame, node) if node.kind != "module" else node
            raise errors.InvalidArgument(
                f"{where(node.proto)}\na sync point needs this value, which never ran: {self.never_ran(late, frame)}"
            )

    # ------------------------------------------------------------ reading and writing module values

    def bind(self, frame: Frame, node: PlanNode, key: HookKey, value: Any) -> None:
        frame.values[node.id] = value
        frame.bound[node.id] = key
        frame.pending.discard(node.id)

    def view(self, value: Any, node: PlanNode) -> Any:
        if node.invoke is None:
            return value
        start, stop = self.rows[node.invoke]
        if start == 0 and stop == self.batch_size:  # the invoke owns the whole batch: its view is the value
            return value
        return rows.rows(value, start, stop, self.batch_size)

    def read_pre(self, node: PlanNode, state: list[Any]) -> Any:
        args, kwargs = state
        assert node.target is not None
        if node.target.point == graph_pb2.INPUTS:
            return self.view((tuple(args), dict(kwargs)), node)
        if args:
            return self.view(args[0], node)
        if kwargs:
            return self.view(next(iter(kwargs.values())), node)
        return None

    def pre_like(self, node: PlanNode, state: list[Any]) -> torch.Tensor | None:
        return rows.first_tensor(state)

    def write_pre(self, node: PlanNode, state: list[Any], value: Any) -> None:
        args, kwargs = state
        assert node.target is not None
        # An invoke that owns the whole batch swaps the arguments, as nnsight does: writing into them in
        # place would also change the earlier module's output they alias (a saved `h[0].output`).
        whole = node.invoke is None or self.rows[node.invoke] == (0, self.batch_size)
        if node.target.point == graph_pb2.INPUTS:
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise errors.InvalidArgument(f"{where(node.proto)}\n.inputs must be set to an (args, kwargs) pair")
            if whole:
                new_args = value[0]
                # `(h,) + block.inputs[1:]` gives the tensor itself as the args: it is the first argument.
                state[0] = [new_args] if isinstance(new_args, torch.Tensor) else list(new_args)
                state[1] = dict(value[1])
                return
            start, stop = self.rows[node.invoke]
            self.refuse_weight_write(node, sharding.leaves((args, kwargs)))
            self.guard(node, lambda: rows.write_rows((args, kwargs), value, start, stop, self.batch_size))
            return
        if not whole:
            start, stop = self.rows[node.invoke]
            current = args[0] if args else next(iter(kwargs.values()), None)
            self.refuse_weight_write(node, sharding.leaves(current))
            self.guard(node, lambda: rows.write_rows(current, value, start, stop, self.batch_size))
        elif args:
            args[0] = value
        elif kwargs:
            kwargs[next(iter(kwargs))] = value
        else:
            args.append(value)

    def write_value(self, frame: Frame, node: PlanNode, like: torch.Tensor | None) -> Any:
        """The value a set/skip writes, which must exist now (else it is a causality error)."""
        self.run_ready()
        if not self.ready(frame, node):
            late = self.missing_input(frame, node)
            raise errors.InvalidArgument(
                f"causality error: {where(node.proto)}\nwrites a value that is only computed later in the forward: "
                f"it needs {where(late.proto)}, which is not available when this module runs.",
                exc_type="RuntimeError",
            )
        spec = node.args[0]
        value = self.own_copy(spec, self.resolve(frame, spec))
        if self.is_const(spec):
            value = rows.map_tensors(value, rows.placer(like))
        self.writes.append(node)
        frame.pending.discard(node.id)
        return value

    def guard(self, node: PlanNode, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except errors.NndError as e:
            err = wrap(e, node.proto)
        except Exception as e:
            err = wrap(e, node.proto, scan=self.scan)
        raise self.at_step(err) from None

    def at_step(self, err: errors.NndError) -> errors.NndError:
        """During a generation, say which step failed (the client's line alone does not tell)."""
        if self.total_steps <= 1 or "generation step" in err.message:
            return err
        return type(err)(f"{err.message}\n(at generation step {self.step} of {self.total_steps})", exc_type=err.exc_type)

    # ------------------------------------------------------------ running nodes

    def has(self, frame: Frame, ref: int) -> bool:
        owner = self.root if self.plan.nodes[ref].scope == 0 else frame
        return ref in owner.values

    def get(self, frame: Frame, ref: int) -> Any:
        owner = self.root if self.plan.nodes[ref].scope == 0 else frame
        return owner.values[ref]

    def ready(self, frame: Frame, node: PlanNode) -> bool:
        return all(self.has(frame, r) for r in node.refs)

    def missing_input(self, frame: Frame, node: PlanNode) -> PlanNode:
        """A module value (or other root cause) `node` still waits for."""
        current = node
        while True:
            waiting = [self.plan.nodes[r] for r in current.refs if not self.has(frame, r)]
            if not waiting:
                return current
            current = waiting[0]

    def run_ready(self, frames: list[Frame] | None = None) -> None:
        """Run every node whose inputs exist, until none is left (in `frames` only, when given)."""
        progress = True
        while progress:
            progress = False
            revived = self._revived
            for frame in tuple(self._live) if frames is None else frames:
                if not frame.runnable:
                    continue
                for nid in list(frame.runnable):
                    if nid not in frame.runnable:  # run meanwhile, by a run_ready nested in a backward pass
                        continue
                    node = self.plan.nodes[nid]
                    if not self.ready(frame, node):
                        continue
                    del frame.runnable[nid]
                    frame.values[nid] = self.execute(frame, node)
                    frame.pending.discard(nid)
                    progress = True
            if frames is None and self._revived != revived:  # a frame got nodes meanwhile (a pause in a backward)
                progress = True
        if frames is None and any(not f.runnable for f in self._live):
            for frame in self._live:
                frame.live = bool(frame.runnable)
            self._live = [f for f in self._live if f.live]

    def execute(self, frame: Frame, node: PlanNode) -> Any:
        if node.kind == "tensor":
            return self.guard(node, lambda: self.constant(weights.read(self.modules, node.proto.tensor, self.shard)))
        if node.kind == "constant":
            return self.constant(node.value)
        if node.kind == "param":
            return grads.param_leaf(self, node)
        if node.kind == "save":
            return self.resolve(frame, node.args[0])
        if node.kind == "backward":
            grads.Backward(self, frame, node).run()
            return None
        assert node.op is not None
        self.check_mutation(frame, node)
        args = [self.resolve(frame, a) for a in node.args]
        kwargs = {k: self.resolve(frame, a) for k, a in node.kwargs.items()}
        if node.op.context:  # a model's module may write into its input (inplace activations): not into a weight
            args = [self.own_copy(a, v) for a, v in zip(node.args, args, strict=True)]
        if node.op.mutates or "out" in kwargs:
            written = [args[0]] if node.op.mutates and args else []
            self.refuse_weight_write(node, written + sharding.leaves(kwargs.get("out")))
        target = None
        if node.places:  # else no argument holds a constant tensor to move
            target = self.activation(frame, [*node.args, *node.kwargs.values()], [*args, *kwargs.values()])
        if target is not None:
            place = rows.placer(target)
            args = [self.place(a, v, place) for a, v in zip(node.args, args, strict=True)]
            kwargs = {k: self.place(node.kwargs[k], v, place) for k, v in kwargs.items()}
        name = node.proto.op.name
        try:
            if node.op.context:
                return node.op.fn(self, *args, **kwargs)
            return node.op.fn(*args, **kwargs)
        except StopForward:
            raise
        except errors.NndError as e:  # an op's own refusal: it names the client's line too
            raise wrap(e, node.proto) from None
        except Exception as e:
            raise wrap(e, node.proto, name, scan=self.scan) from None

    def refuse_weight_write(self, node: PlanNode, written: list[Any]) -> None:
        """Run-time half of plan.py's check_weight_write: a value the model computed may be a weight
        itself (`self.A_log.float()` of a float32 weight is the parameter; a view of a weight shares its
        memory). Written in place, it would change the model every client shares, for good."""
        for tensor in written:
            if isinstance(tensor, torch.Tensor):
                name = self.weight_named(tensor)
                if name is not None:
                    raise wrap(
                        errors.InvalidArgument(
                            f"writes in place into the model's weight {name}: this value is that weight's memory "
                            "(an operation that returned its input unchanged, like `.float()` of a float32 weight, "
                            "or a view of it). The model's weights are shared by every client of the daemon and "
                            "never change. Write into a copy (`x = x.clone()`) instead.",
                            exc_type="RuntimeError",
                        ),
                        node.proto,
                    )

    def weight_named(self, tensor: torch.Tensor) -> str | None:
        """The model weight whose memory `tensor` is (weights.shared), read only in a run that writes."""
        if self.scan:  # meta tensors: no memory, and nothing a Scan writes outlives it
            return None
        if self._weight_storages is None:
            self._weight_storages = weights.storages(self.modules)
        return weights.shared(tensor, self._weight_storages)

    def check_mutation(self, frame: Frame, node: PlanNode) -> None:
        """Run-time half of the causality check: no in-place write into a module value whose hook is over."""
        if not (node.op and node.op.mutates and node.alias_root is not None):
            return
        root = self.plan.nodes[node.alias_root]
        owner = self.root if root.scope == 0 else frame
        key = owner.bound.get(root.id)
        if key is None or not key[0] or key == self.current or key not in self.completed:
            return
        # Name the input that arrived late: one bound at the current hook, else any other source.
        others = [self.plan.nodes[i] for i in sorted(node.sources) if i != root.id]
        late = next((n for n in others if self.bound_at(frame, n) == self.current), others[0] if others else root)
        what = (
            f"the gradient {where(root.proto)} after autograd has passed it on"
            if root.kind == "grad"
            else f"the output of {key[0]!r} ({where(root.proto)}) after that module has already run"
        )
        raise errors.InvalidArgument(
            f"causality error: {where(node.proto)}\nwrites in place into {what}; the write waited for "
            f"{where(late.proto)}.",
            exc_type="RuntimeError",
        )

    def bound_at(self, frame: Frame, node: PlanNode) -> HookKey | None:
        owner = self.root if node.scope == 0 else frame
        return owner.bound.get(node.id)

    # ------------------------------------------------------------ arguments

    def resolve(self, frame: Frame, spec: Any) -> Any:
        if isinstance(spec, Ref):
            return self.get(frame, spec.id)
        if isinstance(spec, Const):
            return self.constant(spec.value)
        assert isinstance(spec, Seq)
        items = [self.resolve(frame, s) for s in spec.items]
        return items if spec.is_list else tuple(items)

    def own_copy(self, spec: Any, value: Any) -> Any:
        """`value`, copied when it shares memory with a model's weight: what the model or later
        nodes write into (a module output replaced by it, a module's argument) must not be the
        weight every client shares."""
        if isinstance(spec, Ref) and self.plan.nodes[spec.id].weight is not None:
            return rows.map_tensors(value, torch.clone)
        return value

    def is_const(self, spec: Any) -> bool:
        if isinstance(spec, Ref):
            return self.plan.nodes[spec.id].const
        if isinstance(spec, Seq):
            return all(self.is_const(s) for s in spec.items)
        return True

    def activation(self, frame: Frame, specs: list[Any], resolved: list[Any]) -> torch.Tensor | None:
        """The first tensor that derives from the model (not from constants) among an op's arguments."""
        for spec, value in zip(specs, resolved, strict=True):
            if isinstance(spec, Seq):
                found = self.activation(frame, list(spec.items), list(value))
                if found is not None:
                    return found
            elif isinstance(spec, Ref) and not self.plan.nodes[spec.id].const:
                found = rows.first_tensor(value)
                if found is not None:
                    return found
        return None

    def place(self, spec: Any, value: Any, place: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        if isinstance(spec, Seq):
            items = [self.place(s, v, place) for s, v in zip(spec.items, value, strict=True)]
            return items if spec.is_list else tuple(items)
        if self.is_const(spec):
            return rows.map_tensors(value, place)
        return value

    # ------------------------------------------------------------ call_module (OpContext)

    def call_module(self, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self.modules.get(path)
        if module is None:
            raise errors.NotFound(f"the model has no module {path!r}")
        param = next(module.parameters(), None)
        if param is not None:
            args = tuple(a.to(param.device) if isinstance(a, torch.Tensor) else a for a in args)
        with self.hooks.suppressed():
            return self.shard.call(path, module, args, kwargs)

    # ------------------------------------------------------------ end of run

    def check_complete(self) -> None:
        for frame in self.frames():
            if frame.pending:
                node = self.plan.nodes[min(frame.pending)]
                late = self.missing_input(frame, node) if node.kind != "module" else node
                raise errors.InvalidArgument(f"{where(node.proto)}\nnever ran: {self.never_ran(late, frame)}")

    def never_ran(self, node: PlanNode, frame: Frame) -> str:
        if node.kind in ("grad", "set_grad"):
            return "its gradient was never computed: the backward pass it belongs to did not run"
        if node.target is None:
            return "its inputs were never computed"
        path, call = node.target.path, node.target.call + (frame.step if frame.scope else 0)
        if node.hook == RESULT:
            return "the request ended before its result"
        made = self.hooks.calls_of(path)
        name = repr(path) if path else "the model"
        return f"it needs call {call} of {name}, but {name} was called {made} time(s) ({where(node.proto)})"

    def saved(self) -> dict[int, Any]:
        out: dict[int, Any] = grads.param_grads(self)
        for node in self.plan.nodes.values():
            if node.kind == "cache":
                out[node.id] = self.caches.result(node.id)
                continue
            if node.kind != "save":
                continue
            if node.scope == 0:
                out[node.id] = self.root.values[node.id]
            else:
                steps = sorted(s for (scope, s) in self.loops if scope == node.scope)
                out[node.id] = [self.loops[(node.scope, s)].values[node.id] for s in steps]
        return out
