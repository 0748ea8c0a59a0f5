"""Counting every module call of a pausable run (hooks.py count_all, callcount.py): exact counts at a
pause, calls running at the pause told from calls that ended, the counts kept apart when a run lends
the model to another, and no Python frame per module call."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
import wire_results
from graphs import Graph
from reference import capture, forward
from torch.testing import assert_close

from nnd.v1 import graph_pb2, nnd_pb2
from nnd_daemon import errors
from nnd_daemon.engine import callcount, hooks, interact

PROMPT = "The Eiffel Tower is in the city of"


def _paused_run(gpt2, pause_path: str, later_path: str) -> dict:
    """`pause_path`'s output summed at a sync point, then `later_path`'s output saved as the client's next
    nodes."""
    g = Graph()
    total = g.op("sum", g.module(pause_path))
    later = Graph()
    later.next = 100
    saved = later.save(later.module(later_path))
    start = nnd_pb2.InteractStart(request=g.request(PROMPT), want=[total.id])

    def receive(_timeout: float, more: graph_pb2.Graph = later.g) -> nnd_pb2.InteractContinue:
        return nnd_pb2.InteractContinue(graph=more, finish=True)

    out = gpt2.stream(g.request(PROMPT), interaction=interact.Interaction(start, receive))
    values = wire_results.collect(out)
    return {"total": values[total.id], "saved": values[saved.id]}


def _plain_run(gpt2) -> torch.Tensor:
    g = Graph()
    saved = g.save(g.module("transformer.h.0"))
    return gpt2.run(g.request(PROMPT))[saved.id]


@pytest.mark.parametrize("own_hook", [False, True], ids=["no-hooks", "a-hook-of-its-own"])
def test_counts_tell_a_running_module_from_one_that_ran(gpt2, own_hook):
    """A module running at the pause binds its call now running, and one that already ran is refused.
    A module with no hooks when its call began runs torch's fast path, which never runs a post hook
    added meanwhile (the run's tracker on it ends that call); one with a hook of its own (as libraries
    add) runs the new post hook itself: bound once either way."""
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h0"),
            transformer__h__0__mlp=capture(store, "mlp0"), transformer__h__1=capture(store, "h1"))
    handle = gpt2.model.transformer.h[0].register_forward_hook(lambda *_: None) if own_hook else None
    try:
        # Paused inside block 0 (its MLP's output): block 0 runs still, block 1 is to come.
        got = _paused_run(gpt2, "transformer.h.0.mlp", "transformer.h.0")
        assert_close(got["total"], store["mlp0"].sum())
        assert_close(got["saved"], store["h0"])
        assert_close(_paused_run(gpt2, "transformer.h.0.mlp", "transformer.h.1")["saved"], store["h1"])
        # Block 0's attention ended before its MLP ran.
        with pytest.raises(errors.InvalidArgument, match="already ran past"):
            _paused_run(gpt2, "transformer.h.0.mlp", "transformer.h.0.attn")
    finally:
        if handle is not None:
            handle.remove()


def test_a_module_named_while_it_runs_can_have_its_output_replaced(gpt2):
    """Set after a pause inside the module: the wrapper that ends the call returns the new value, so the
    rest of the forward runs on it (checked against a plain hook that returns the same)."""
    store: dict = {}

    def halved(module, args, output):
        return output * 0.5

    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=halved, transformer__h__1=capture(store, "h1"))
    g = Graph()
    total = g.op("sum", g.module("transformer.h.0.mlp"))
    later = Graph()
    later.next = 100
    later.set("transformer.h.0", later.op("mul", later.module("transformer.h.0"), 0.5))
    saved = later.save(later.module("transformer.h.1"))
    start = nnd_pb2.InteractStart(request=g.request(PROMPT), want=[total.id])

    def receive(_timeout: float) -> nnd_pb2.InteractContinue:
        return nnd_pb2.InteractContinue(graph=later.g, finish=True)

    values = wire_results.collect(gpt2.stream(g.request(PROMPT), interaction=interact.Interaction(start, receive)))
    assert_close(values[saved.id], store["h1"])


def _hookset(model: torch.nn.Module, paths: set[str], on_post=None) -> hooks.HookSet:
    return hooks.HookSet(
        model,
        paths,
        set(),
        lambda *_: None,
        on_post or (lambda *_: None),
        lambda _path: (False, None),
        count_all=True,
    )


def test_a_run_that_lends_the_model_keeps_its_counts_apart_from_the_runs_it_lends_it_to(gpt2):
    """A generation lends the model between its steps (suppressed): a pausable run meanwhile counts from
    0 on the same counters, and the lender's counts go on from where they were, not from the lent run's."""
    model, tokenizer = gpt2.model, gpt2.tokenizer
    inputs = tokenizer([PROMPT], return_tensors="pt")

    def forward_once() -> None:
        with torch.no_grad():
            model(**inputs)

    lender = _hookset(model, set())
    with lender.installed():
        forward_once()
        assert lender.calls_of("transformer.h.1") == 1
        assert lender.calls_of("transformer") == 1  # tracked (it contains the model's modules): its own count
        with lender.suppressed():
            lent = _hookset(model, {"transformer.h.0"})
            with lent.installed():
                forward_once()
                forward_once()
                assert lent.calls_of("transformer.h.1") == 2
                assert lent.calls_of("transformer.h.0") == 2  # hooked: counted by its hooks
            forward_once()  # neither run's
        assert lender.calls_of("transformer.h.1") == 1
        assert lender.calls_of("transformer") == 1
        forward_once()
        assert lender.calls_of("transformer.h.1") == 2
        assert lender.calls_of("transformer.h.1.mlp.act") == 2
    # The trackers come off; the counters stay (C, mounted once per model).
    for module in model.modules():
        assert not hasattr(module.__dict__.get("_compiled_call_impl"), "_nnd_inner")


def test_counting_costs_no_python_call_per_module_call(gpt2):
    """Only the modules that contain a hooked one run Python of nnd's per call (their trackers): the
    others are counted in C. Profiled over a paused run's forward (a hook of the test's own on the model
    starts the profile and ends it): the old counting ran a Python wrapper on every module call."""
    model = gpt2.model
    seen: collections.Counter = collections.Counter()
    module_calls = [0]
    ours = {hooks.__file__, callcount.__file__}
    call_impl = torch.nn.Module._call_impl.__code__

    def profile(frame, event, _arg):
        if event != "call":
            return
        if frame.f_code is call_impl:
            module_calls[0] += 1
        elif frame.f_code.co_filename in ours:
            seen[frame.f_code.co_name] += 1

    def begin(*_):
        sys.setprofile(profile)

    def end(*_):
        sys.setprofile(None)

    handles = [model.register_forward_pre_hook(begin), model.register_forward_hook(end)]
    try:
        got = _paused_run(gpt2, "transformer.h.0.mlp", "transformer.h.1")
    finally:
        for handle in handles:
            handle.remove()
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__1=capture(store, "h1"))
    assert_close(got["saved"], store["h1"])
    assert module_calls[0] > 20
    # transformer and block 0 contain the MLP the run paused in (the model itself is the profile's start)
    assert seen["tracker"] == 2
    assert max(seen.values()) < module_calls[0] / 4, seen  # the hooks of the hooked modules, the pause


class _Helper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Inner(torch.nn.Module):
    """Calls a module it does not register: its calls do not nest the way the modules contain each other."""

    def __init__(self, helper: _Helper) -> None:
        super().__init__()
        self.__dict__["helper_ref"] = helper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.helper_ref(x) * 2


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.helper = _Helper()
        self.inner = _Inner(self.helper)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1


@pytest.mark.parametrize("own_hook", [False, True], ids=["no-hooks", "a-hook-of-its-own"])
def test_a_module_running_from_outside_its_containers_is_refused_when_named_not_given_a_wrong_value(own_hook):
    """Paused inside `helper.lin`, which `inner` calls though `helper` is registered on the model: `inner`
    runs untracked. Named then, its call's end would never be seen: refused, unless torch runs its
    hooks anyway (it had one of its own), when it gets exactly `inner`'s output."""
    torch.manual_seed(0)
    model = _Outer().eval()
    x = torch.randn(2, 4)
    expected = model.helper(x) * 2
    got: dict = {}
    refused: list[Exception] = []

    def on_post(path: str, call: int, output: torch.Tensor) -> None:
        if path == "helper.lin":
            try:
                hs.watch("inner")
            except errors.Unimplemented as e:
                refused.append(e)
        elif path == "inner":
            got[call] = output.detach().clone()

    hs = _hookset(model, {"helper.lin"}, on_post)
    own = model.inner.register_forward_hook(lambda *_: None) if own_hook else None
    try:
        with hs.installed(), torch.no_grad():
            model(x)
    finally:
        if own is not None:
            own.remove()
    if own_hook:
        assert not refused
        assert_close(got[0], expected)
    else:
        assert len(refused) == 1 and "'inner'" in str(refused[0])
        assert not got


def test_a_copy_of_a_counted_model_runs_its_own_forward():
    """The counters hold each module's bound `_call_impl`, and stay mounted: a copy (or a pickle) must
    not carry them over, or it would run the original's forward. torch's `Module.__getstate__` drops
    `_compiled_call_impl`; this holds nnd to it."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).eval()
    counters = callcount.of(model)
    counters.take("run")
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = model(x)
    assert counters.release("run", bank=True) == [1, 1, 1]

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
        assert not any("_compiled_call_impl" in m.__dict__ for m in twin.modules())
        assert_close(twin[1](twin[0](x)), twin(x))
        assert not torch.allclose(twin(x), want)
        assert_close(model(x), want)
