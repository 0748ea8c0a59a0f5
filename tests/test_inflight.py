"""The daemon-wide budget of request and result bytes in flight (daemon/inflight.py)."""

from __future__ import annotations

import pytest

from nnd_daemon import errors
from nnd_daemon.inflight import InflightBudget


def test_bytes_beyond_the_budget_are_refused_naming_the_limit_and_freed_ones_fit_again():
    budget = InflightBudget(100)
    with budget.hold(60, "a request"):
        with pytest.raises(errors.ResourceExhausted, match=r"max_inflight_bytes=100") as info:
            budget.acquire(41, "another request")
        assert "60 bytes of other requests" in str(info.value)
        budget.acquire(40, "a third")  # exactly at the limit
        budget.release(40)
    assert budget.held == 0
    with budget.hold(100, "now it fits"):
        assert budget.held == 100


def test_one_request_alone_always_passes():
    budget = InflightBudget(100)
    with budget.hold(500, "a big request"):  # its own limits (max_request_bytes, max_saved_bytes) bound it
        with pytest.raises(errors.ResourceExhausted):
            budget.acquire(1, "anything else")


def test_results_are_counted_while_they_pass_and_freed_when_the_stream_is_dropped():
    budget = InflightBudget(100)
    stream = budget.passing(iter([b"x" * 30, b"y" * 50]), "a result")
    assert next(stream) == b"x" * 30 and budget.held == 30
    assert next(stream) == b"y" * 50 and budget.held == 50
    stream.close()  # the client went away mid-stream
    assert budget.held == 0
