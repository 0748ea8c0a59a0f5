"""Fairness goes by the caller's verified identity (issue #26): admission shares and the helper's
turns key on the user a `.who` ticket names (or the token/host over TCP), and the `nnd-client`
name a client chooses only orders its own calls within that identity, so a client sending fifty
names gets one share and one turn per round, not fifty."""

from __future__ import annotations

import threading

import pytest

from nnd_daemon import errors, identity
from nnd_daemon.control import admission
from nnd_daemon.control.admission import Admission
from nnd_daemon.control.fairgate import FairGate


class FakeContext:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), peer: str = "unix:") -> None:
        self._metadata = metadata
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer


def test_fifty_client_names_of_one_identity_are_one_admission_share():
    gate = Admission(slow_slots=40, uploads_total=3, uploads_per_client=2, upload_idle_s=0)
    admitted = 0
    for i in range(50):
        try:
            gate._enter("Scan", "unix:", ("alice", f"alice@box:{i}"))
            admitted += 1
        except errors.ResourceExhausted as exc:
            assert "this client (alice)" in str(exc)
    assert admitted == gate.per_client == 10
    gate._enter("Scan", "unix:", ("bob", "bob@box:1"))  # another identity still finds a slot
    gate._leave("Scan", "unix:", ("alice", "alice@box:3"))
    gate._enter("Scan", "unix:", ("alice", "alice@box:99"))  # one of alice's calls ended: one more fits


def test_a_ticket_names_the_identity_and_a_forged_or_missing_one_counts_as_unverified():
    tickets = identity.Tickets()
    good = tickets.mint("alice")
    assert identity.caller_of(((identity.USER_KEY, good), ("nnd-client", "x@h:1")), "unix:", tickets) == (
        "alice",
        "x@h:1",
    )
    forged = "root|99999999999|" + "0" * 32
    for metadata in (((identity.USER_KEY, forged),), (("nnd-client", "root@h:1"),), ()):
        assert identity.caller_of(metadata, "unix:", tickets)[0] == identity.UNVERIFIED
    assert identity.caller_of((), "ipv4:10.0.0.7:5123", tickets, token=True)[0] == "token@10.0.0.7"
    # The servers work it out once per call (asyncserve.Context.caller); admission takes that.
    ctx = FakeContext((("nnd-client", "a"),))
    assert admission.caller_of(ctx) == (identity.UNVERIFIED, "a")
    ctx.caller = ("alice", "a")  # type: ignore[attr-defined]
    assert admission.caller_of(ctx) == ("alice", "a")


def _queue(gate: FairGate, callers: list[tuple[str, str]], order: list[tuple[str, str]]) -> list[threading.Thread]:
    threads = []
    for caller in callers:
        t = threading.Thread(target=lambda c=caller: (gate.acquire(c), order.append(c), gate.release()))
        t.start()
        threads.append(t)
        while gate.waiting() != len(threads):  # forced order: each waiter queued before the next starts
            threading.Event().wait(0.001)
    return threads


def test_helper_turns_go_round_identities_not_client_names():
    gate = FairGate()
    gate.acquire("holder")
    order: list[tuple[str, str]] = []
    # The flooder's five calls under five client names queue before the bystander's one.
    flood = [("mallory", f"name{i}") for i in range(5)]
    threads = _queue(gate, [*flood, ("bob", "bob@box:1")], order)
    assert gate.waiting("mallory") == 5 and gate.waiting(("mallory", "name0")) == 1
    gate.release()
    for t in threads:
        t.join(10)
    assert order[:2] == [("mallory", "name0"), ("bob", "bob@box:1")]  # second, not sixth
    assert order[2:] == flood[1:]


def test_within_one_identity_its_clients_take_turns():
    gate = FairGate()
    gate.acquire("holder")
    order: list[tuple[str, str]] = []
    callers = [("alice", "nb1")] * 3 + [("alice", "nb2")]
    threads = _queue(gate, callers, order)
    gate.release()
    for t in threads:
        t.join(10)
    assert order == [("alice", "nb1"), ("alice", "nb2"), ("alice", "nb1"), ("alice", "nb1")]


@pytest.mark.parametrize("who", ["daemon", "holder"])
def test_a_plain_string_is_an_identity_with_one_client(who):
    gate = FairGate()
    with gate.held(who):
        assert gate.waiting() == 0
    assert gate.waiting(who) == 0
