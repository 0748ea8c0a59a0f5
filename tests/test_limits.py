"""Each configured limit refuses what exceeds it, naming the limit and its value."""

from __future__ import annotations

import pytest
import torch
from daemonproc import start_daemon

import nnd


@pytest.fixture(scope="module")
def strict(tmp_path_factory, tiny_models):
    d = start_daemon(
        tmp_path_factory.mktemp("strict"),
        "--max-saved-bytes", "4KiB",
        "--max-invokes", "2",
        "--max-sequence-length", "12",
        "--max-request-bytes", "64KiB",
        "--max-new-tokens", "4",
        in_process=True,
    )  # fmt: skip
    model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
    yield model
    d.stop()


def _refused(fn, *words):
    with pytest.raises(nnd.NndError) as info:
        fn()
    text = str(info.value)
    for word in words:
        assert word in text, text
    return info.value


def test_saved_bytes(strict):
    def big():
        with strict.trace("Hello world"):
            strict.lm_head.output.save()  # 1 x n x 320 float32 > 4 KiB

    err = _refused(big, "max_saved_bytes", "4096")
    assert isinstance(err, nnd.errors.LimitExceeded)
    with strict.trace("Hello world"):
        small = strict.lm_head.output[0, -1, :8].save()
    assert small.shape == (8,)


def test_invokes(strict):
    def three():
        with strict.trace() as tracer:
            for text in ("a", "b", "c"):
                with tracer.invoke(text):
                    pass

    _refused(three, "max_invokes", "2")


def test_sequence_length(strict):
    def long():
        with strict.trace("Hello world " * 20):
            strict.lm_head.output[0, -1, :4].save()

    _refused(long, "max_sequence_length", "12")


def test_request_bytes(strict):
    def huge():
        with strict.trace("Hello"):
            h = strict.transformer.h[0].output
            torch.cat([h[0, -1], torch.zeros(100_000)])[:4].save()  # a 400 KB constant

    _refused(huge, "max_request_bytes")


def test_new_tokens(strict):
    def many():
        with strict.generate("Hello", max_new_tokens=5):
            pass

    _refused(many, "max_new_tokens", "4")
