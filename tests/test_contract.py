"""The wire contract's hand-written part (nnd/v1/contract.py) is the one definition daemon, workers,
helper and client use: the same message-size limit on both sides, metadata keys spelled once, and
step selectors meaning Python's indexing of the steps."""

from __future__ import annotations

import pathlib
import re

import pytest

from nnd.v1 import contract, graph_pb2
from nnd.wire import connection
from nnd_daemon.control import server, supervisor

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _limit(options, key: str) -> int:
    return dict(options)[key]


@pytest.mark.parametrize("key", ["grpc.max_receive_message_length", "grpc.max_send_message_length"])
def test_the_client_and_the_daemon_allow_the_same_message_size(key):
    # A request the daemon accepts must be one the client can send, and a message a worker may send
    # one the client can receive.
    client = _limit(connection.CHANNEL_OPTIONS, key)
    assert client == _limit(server.OPTIONS, key) == _limit(supervisor.OPTIONS, key) == contract.MAX_MESSAGE


def test_metadata_keys_are_spelled_only_in_the_contract():
    keys = [v for k, v in vars(contract).items() if k.endswith("_KEY") and isinstance(v, str)]
    assert len(keys) >= 9
    spelled = re.compile("|".join(re.escape(f'"{k}"') for k in keys))
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("daemon", "pyclient")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "contract.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if spelled.search(line)
    ]
    assert found == []


def _range(start=None, stop=None, step=None) -> graph_pb2.StepSelector:
    sel = graph_pb2.StepSelector()
    sel.range.SetInParent()
    for name, value in (("start", start), ("stop", stop), ("step", step)):
        if value is not None:
            setattr(sel.range, name, value)
    return sel


def _steps(*steps: int) -> graph_pb2.StepSelector:
    sel = graph_pb2.StepSelector()
    sel.steps.steps.extend(steps)
    return sel


def _all() -> graph_pb2.StepSelector:
    sel = graph_pb2.StepSelector()
    sel.all.SetInParent()
    return sel


CASES = [
    (_all(), lambda r: list(r)),
    (_range(), lambda r: list(r[:])),
    (_range(1), lambda r: list(r[1:])),
    (_range(None, 3), lambda r: list(r[:3])),
    (_range(-2), lambda r: list(r[-2:])),
    (_range(0, None, 2), lambda r: list(r[::2])),
    (_range(5, 1, -1), lambda r: list(r[5:1:-1])),
    (_steps(0, -1, 2), lambda r: [r[i] for i in (0, -1, 2) if -len(r) <= i < len(r)]),
    (_steps(7, -9), lambda r: [r[i] for i in (7, -9) if -len(r) <= i < len(r)]),
]


@pytest.mark.parametrize("total", [0, 1, 3, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_step_selector_picks_what_python_indexing_picks(case, total):
    sel, expected = CASES[case]
    assert list(contract.steps_of(sel, total)) == expected(range(total))
    # The daemon's executor asks step by step; a step past a total not yet known extends the run.
    for step in range(total + 2):
        span = range(max(total, step + 1))
        assert contract.selects(sel, total, step) == (step in expected(span))


def test_trailers_read_the_last_value_and_empty_when_absent():
    assert (
        contract.trailer(
            [("a", "1"), (contract.EXC_TYPE_KEY, "X"), (contract.EXC_TYPE_KEY, "Y")], contract.EXC_TYPE_KEY
        )
        == "Y"
    )
    assert contract.trailer(None, contract.EXC_TYPE_KEY) == ""
    assert contract.started_from(None) is True
    assert contract.started_from([(contract.QUEUED_KEY, "1")]) is False
    assert contract.started_from([(contract.QUEUED_KEY, "1"), (contract.STARTED_KEY, "1")]) is True


def test_nnd_serves_flag_defaults_are_the_limits_defaults():
    # The defaults are written in settings.Limits; the client's `nnd serve` flags (which cannot import
    # the daemon) must show the same values, or a daemon started without flags would differ from one
    # built from Limits() (the in-process engine's, the tests').
    from nnd.cli import build_parser
    from nnd_daemon.control.cli_serve import settings_from_args
    from nnd_daemon.control.settings import Limits

    ns = build_parser().parse_args(["serve", "--address", "unix:///tmp/nnd-test-unused.sock", "--state-dir", "/tmp"])
    assert settings_from_args(ns).limits == Limits()


def test_limits_travel_to_a_worker_as_the_proto_and_back():
    from nnd_daemon import intake
    from nnd_daemon.control.settings import Limits

    sent = Limits(max_invokes=3, default_deadline_s=1.5).to_proto()
    assert intake.limits_of_arg(intake.limits_arg(sent)) == sent
    assert intake.limits_of_arg("") == type(sent)()
