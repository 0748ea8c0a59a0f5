"""What docs/protocol.md §8a and nnd.proto say an Interact stream's messages mean, as the engine reads
them: an empty `want` ends the run whatever `finish` says, and the pause timeout's error names the
field a client sets (`pause_timeout_s`)."""

from __future__ import annotations

import pytest

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.engine import interact


def test_an_empty_want_in_the_first_message_runs_to_the_end_even_without_finish():
    run = interact.Interaction(nnd_pb2.InteractStart(finish=False), receive=lambda _timeout: None)
    assert run.finished and run.want == []


def test_an_empty_want_in_a_later_message_runs_to_the_end_even_without_finish():
    later = nnd_pb2.InteractContinue(finish=False)
    run = interact.Interaction(nnd_pb2.InteractStart(want=[1]), receive=lambda _timeout: later)
    assert not run.finished
    run.wait()
    assert run.finished and run.want == []


def test_the_pause_timeout_error_names_the_field_a_client_sets():
    start = nnd_pb2.InteractStart(want=[1], pause_timeout_s=0.01)
    run = interact.Interaction(start, receive=lambda _timeout: None)
    with pytest.raises(errors.DeadlineExceeded, match=r"`pause_timeout_s`"):
        run.wait()
