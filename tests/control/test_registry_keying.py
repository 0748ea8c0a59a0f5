"""Loaded models keyed by checkpoint and load choices (daemon/control/registry.py), in-process on
the fakes of registry_fakes.py: which loads share an entry, the names of the others, and two loads
of one model at once sharing it (the interleaving forced, no sleeping)."""

from __future__ import annotations

import threading

import pytest
from registry_fakes import FakeClock, FakeGpus, FakeHelper, FakeLauncher

from nnd.v1 import nnd_pb2
from nnd_daemon.control.registry import Registry
from nnd_daemon.control.settings import Settings

M = "org/model"


class GatedHelper(FakeHelper):
    """A helper whose describe() waits for `go` (so a test can hold a load in the middle)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.calls = 0
        self.changed = threading.Condition()

    def describe(self, ref):  # type: ignore[no-untyped-def]
        with self.changed:
            self.calls += 1
            self.changed.notify_all()
        self.entered.set()
        assert self.go.wait(30)
        out = super().describe(ref)
        out.default_dtype = "float32"
        return out


def _registry(tmp_path, helper) -> Registry:
    settings = Settings(address=f"unix://{tmp_path}/nnd.sock", state_dir=str(tmp_path))
    return Registry(settings, start_worker=FakeLauncher(), gpu_query=FakeGpus([]), clock=FakeClock(), helper=helper,
                    reap_every_s=0)


def _load(reg: Registry, **placement: str) -> str:
    return reg.load(nnd_pb2.LoadModelRequest(model=M, placement=nnd_pb2.Placement(**placement))).name


@pytest.fixture
def reg(tmp_path):
    helper = GatedHelper()
    helper.go.set()
    r = _registry(tmp_path, helper)
    yield r
    r.shutdown()


def test_loads_that_agree_share_and_others_are_named_after_their_choices(reg):
    assert _load(reg) == M
    assert _load(reg, dtype="float32") == M  # the checkpoint's own dtype: the same model
    assert _load(reg, device="cpu") == M  # an open device of a META model takes the choice
    assert _load(reg, dtype="bfloat16") == f"{M}@dtype=bfloat16"
    assert _load(reg, dtype="bfloat16") == f"{M}@dtype=bfloat16"
    eager = reg.load(nnd_pb2.LoadModelRequest(model=M, options=nnd_pb2.LoadOptions(attn_implementation="eager")))
    assert eager.name == f"{M}@attn_implementation=eager"
    # The first entry chose cpu already: another device is another model.
    assert _load(reg, device="cuda:1", dtype="float32") == f"{M}@device=cuda:1,dtype=float32"
    assert sorted(e.name for e in reg.entries()) == sorted(
        [M, f"{M}@dtype=bfloat16", f"{M}@attn_implementation=eager", f"{M}@device=cuda:1,dtype=float32"]
    )
    assert reg.get(M).meta.source == reg.get(f"{M}@dtype=bfloat16").meta.source == M


def test_two_loads_of_one_model_at_once_share_it(tmp_path):
    helper = GatedHelper()
    reg = _registry(tmp_path, helper)
    try:
        names: list[str] = []
        first = threading.Thread(target=lambda: names.append(_load(reg)))
        first.start()
        assert helper.entered.wait(30)  # the first load is building the META model now

        waiting = threading.Event()
        pending = reg._loading[M]

        class Watched(type(pending)):  # type: ignore[misc]
            def wait(self, timeout=None):  # type: ignore[no-untyped-def]
                with helper.changed:  # wakes the test's wait_for below (a set Event alone would not)
                    waiting.set()
                    helper.changed.notify_all()
                return super().wait(timeout)

        watched = Watched()
        reg._loading[M] = watched  # the first load's finally sets what it finds there
        second = threading.Thread(target=lambda: names.append(_load(reg)))
        second.start()
        with helper.changed:  # the second load either waits for the first or starts a load of its own
            assert helper.changed.wait_for(lambda: waiting.is_set() or helper.calls > 1, 30)
        helper.go.set()
        first.join(30)
        second.join(30)
        assert helper.calls == 1 and names == [M, M]
    finally:
        helper.go.set()
        reg.shutdown()
