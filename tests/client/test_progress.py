"""How a dispatch's progress is shown (_progress.py): lines on stderr in a script, a tqdm bar in a
notebook, nothing when asked (keyword, nnd.set_progress, NND_PROGRESS=0) or when nothing loaded."""

from __future__ import annotations

import pytest

import nnd
from nnd.v1 import nnd_pb2
from nnd.wire import _progress


def _stream(total: int = 4) -> list[nnd_pb2.DispatchProgress]:
    msgs = [nnd_pb2.DispatchProgress(stage="starting", message="starting worker process")]
    msgs += [nnd_pb2.DispatchProgress(stage="loading", done=i, total=total, unit="tensors") for i in range(1, total + 1)]
    msgs.append(nnd_pb2.DispatchProgress(stage="ready", message="dispatched", model=nnd_pb2.ModelInfo(name="m")))
    return msgs


@pytest.fixture(autouse=True)
def _default_setting(monkeypatch):
    monkeypatch.setattr(_progress, "_on", None)
    monkeypatch.delenv("NND_PROGRESS", raising=False)


def test_a_script_gets_lines_on_stderr(capsys):
    finals = []
    _progress.show(iter(_stream()), "m", None, on_final=finals.append)
    err = capsys.readouterr().err
    assert "starting" in err and "loading   [" in err and "4/4 tensors" in err
    assert "m: weights loaded in" in err
    assert [f.name for f in finals] == ["m"]


def test_an_already_dispatched_model_shows_nothing(capsys):
    _progress.show(iter(_stream()[-1:]), "m", None)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["keyword", "env", "set_progress"])
def test_quiet_when_asked(capsys, monkeypatch, how):
    keyword = None
    if how == "keyword":
        keyword = False
    elif how == "env":
        monkeypatch.setenv("NND_PROGRESS", "0")
    else:
        nnd.set_progress(False)
    _progress.show(iter(_stream()), "m", keyword)
    assert capsys.readouterr().err == ""


def test_the_keyword_wins_over_the_setting(capsys, monkeypatch):
    monkeypatch.setenv("NND_PROGRESS", "0")
    _progress.show(iter(_stream()), "m", True)
    assert "weights loaded" in capsys.readouterr().err
    nnd.set_progress(True)  # and the call wins over the environment
    _progress.show(iter(_stream()), "m", None)
    assert "weights loaded" in capsys.readouterr().err


def test_a_notebook_gets_a_tqdm_bar(monkeypatch, capsys):
    made = []

    class FakeTqdm:
        def __init__(self, total, unit, desc):
            self.total, self.n, self.closed = total, 0, False
            made.append(self)

        def update(self, k):
            self.n += k

        def set_description(self, text):
            pass

        def close(self):
            self.closed = True

    import tqdm.auto

    monkeypatch.setattr(_progress, "in_notebook", lambda: True)
    monkeypatch.setattr(tqdm.auto, "tqdm", FakeTqdm)
    _progress.show(iter(_stream(7)), "m", None)
    assert len(made) == 1 and made[0].total == 7 and made[0].n == 7 and made[0].closed
    assert "loading   [" not in capsys.readouterr().err  # the bar, not the lines


def test_set_progress_takes_a_bool():
    with pytest.raises(TypeError):
        nnd.set_progress("no")
