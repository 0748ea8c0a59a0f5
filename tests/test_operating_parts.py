"""Pieces of issue #29 that need no daemon: a worker's activity counts (queue share, statuses,
histograms), log rotation that a writing worker survives, and JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from nnd.v1 import worker_pb2
from nnd_daemon import errors, logfmt
from nnd_daemon.control import statedir
from nnd_daemon.worker.activity import Activity


def test_queue_share_caps_one_user_and_not_the_others():
    act = Activity()
    for _ in range(2):
        act.begin("", 4, "m", user="alice", share=0.5)
    with pytest.raises(errors.ResourceExhausted, match=r"alice has 2 requests.*max_queue_share=0.5"):
        act.begin("", 4, "m", user="alice", share=0.5)
    act.begin("", 4, "m", user="bob", share=0.5)
    act.end("alice")
    act.begin("", 4, "m", user="alice", share=0.5)  # room again


def test_finished_requests_are_counted_by_kind_and_status_with_their_times():
    act = Activity()
    with act.track("trace", "c", user="alice") as req:
        req.running = True
    with pytest.raises(errors.DeadlineExceeded), act.track("generate", "c", steps=5, rows=3) as req:
        req.running = True
        req.step = 2
        raise errors.DeadlineExceeded("too slow")
    act.refused("trace", errors.ResourceExhausted("5 invokes exceed the daemon's limit max_invokes=4"))
    status = worker_pb2.WorkerStatus()
    act.fill(status)
    counts = {(r.kind, r.status): r.count for r in status.stats.requests}
    assert counts == {("trace", "ok"): 1, ("generate", "deadline_exceeded"): 1, ("trace", "resource_exhausted"): 1}
    assert status.stats.tokens_generated == 6  # 2 steps x 3 rows
    assert dict(status.stats.refusals) == {"max_invokes": 1}
    lat = {k.kind: k for k in status.stats.latency}
    assert lat["trace"].run.count == 1 and lat["trace"].queue_wait.count == 1
    assert lat["trace"].run.counts[-1] == 1  # cumulative: the last bucket holds it


def test_rotation_keeps_three_old_files_and_the_writer_carries_on(tmp_path):
    path = str(tmp_path / "w.log")
    fd = statedir.open_log(path)  # as the worker's stdout: O_APPEND
    try:
        for i in range(5):
            os.write(fd, f"line {i} ".encode() * 20)
            assert statedir.rotate_log(path, 50)
        os.write(fd, b"after")
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == b"after"  # the writer's next line starts the emptied file
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["w.log", "w.log.1", "w.log.2", "w.log.3"]
    assert (tmp_path / "w.log.1").read_bytes().startswith(b"line 4")
    assert not statedir.rotate_log(path, 50)  # under the size: left alone


def test_json_log_lines_carry_the_event_fields():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logfmt.JsonFormatter())
    logger = logging.getLogger("nnd.test-json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("released %s", "m", extra={"nnd": {"event": "release", "model": "m", "user": "alice"}})
    finally:
        logger.removeHandler(handler)
    line = json.loads(stream.getvalue())
    assert line["message"] == "released m" and line["level"] == "WARNING"
    assert (line["event"], line["model"], line["user"]) == ("release", "m", "alice")
    assert line["time"].endswith("Z")


class _Context:
    def __init__(self, peer: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._peer, self._metadata = peer, metadata

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_the_who_socket_names_the_peers_uid_and_only_genuine_tickets_count(tmp_path):
    import getpass

    from nnd.wire import _identity
    from nnd_daemon import identity

    tickets = identity.Tickets()
    server = identity.WhoServer(str(tmp_path / "nnd.sock") + identity.SUFFIX, tickets)
    server.start()
    try:
        ticket = _identity.fetch_ticket(f"unix://{tmp_path / 'nnd.sock'}")
    finally:
        server.close()
    assert ticket and tickets.verify(ticket) == getpass.getuser()  # the kernel's word for this process's uid
    unix = "unix:"
    assert identity.who(_Context(unix, ((identity.USER_KEY, ticket),)), tickets) == getpass.getuser()
    forged = ticket.replace(getpass.getuser(), "alice", 1)
    assert identity.who(_Context(unix, ((identity.USER_KEY, forged),)), tickets) == ""  # unknown, owns nothing
    other_key = identity.Tickets()  # another daemon's ticket
    assert other_key.verify(ticket) is None
    stale = tickets.mint("bob", ttl_s=-1)
    assert tickets.verify(stale) is None
    assert tickets.verify(tickets.mint("bob", ttl_s=60)) == "bob"
    assert identity.who(_Context("ipv4:10.0.0.7:51234"), tickets, token=True) == "token@10.0.0.7"
    assert identity.who(_Context("ipv6:[::1]:51234"), tickets) == "[::1]"
    assert not os.path.exists(server.path)  # closed: the socket is gone


def test_a_verified_ticket_stops_counting_once_it_expires_and_a_forged_one_is_never_kept(monkeypatch):
    """Tickets.verify keeps tickets it has checked (every call is verified twice): the memo must not
    outlive a ticket's expiry, nor let a forged ticket in after the genuine one was seen."""
    import time

    from nnd_daemon import identity

    tickets = identity.Tickets()
    ticket = tickets.mint("carol", ttl_s=60)
    assert tickets.verify(ticket) == tickets.verify(ticket) == "carol"
    user, expiry, mac = ticket.split("|")
    for forged in (f"mallory|{expiry}|{mac}", f"{user}|{int(expiry) + 10**6}|{mac}", f"{user}|{expiry}|{'0' * len(mac)}"):
        assert tickets.verify(forged) is None
        assert tickets.verify(forged) is None  # still not, the second time
    now = time.time()
    monkeypatch.setattr(identity.time, "time", lambda: now + 61)
    assert tickets.verify(ticket) is None  # kept, but expired
