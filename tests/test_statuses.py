"""errors.ErrorInterceptor, the one place a daemon, worker or helper method's failure
becomes a gRPC status: an in-process server with methods that fail on purpose.
(The daemon's own statuses are checked end to end in test_protocol.py and test_security.py.)"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from nnd_daemon import errors
from nnd_daemon.bearer_tokens import TokenInterceptor

SERVICE = "test.Statuses"
TOKEN = "s3cret"


def _parse(data: bytes) -> Any:
    return errors.Malformed("Probe", ValueError("bad bytes")) if data == b"garbage" else data


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    if request == b"not-found":
        raise errors.NotFound("no such thing", exc_type="KeyError")
    if request == b"bug":
        raise ValueError("boom")
    if request == b"oom":
        raise MemoryError()
    return b"ok:" + request


def _streaming(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first"
    if request == b"bug":
        raise ZeroDivisionError("mid-stream")
    raise errors.ResourceExhausted("stopped after one message")


def _echo_all(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[bytes]:
    for message in requests:
        if isinstance(message, errors.Malformed):  # a stream's reader raises what it meets
            raise message.error
        yield message


def _server(*interceptors: grpc.ServerInterceptor) -> tuple[grpc.Server, str]:
    def translate(exc: BaseException) -> errors.NndError | None:
        return errors.ResourceExhausted("out of memory", exc_type="MemoryError") if isinstance(exc, MemoryError) else None

    mapped = errors.ErrorInterceptor(logging.getLogger("nnd.test"), internal="internal error here", translate=translate)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[*interceptors, mapped])
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, request_deserializer=_parse),
        "Streaming": grpc.unary_stream_rpc_method_handler(_streaming, request_deserializer=_parse),
        "Both": grpc.stream_stream_rpc_method_handler(_echo_all, request_deserializer=_parse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    address = "unix://" + os.path.join(tempfile.mkdtemp(prefix="nnd-st-"), "s.sock")
    server.add_insecure_port(address)
    server.start()
    return server, address


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    server, address = _server()
    with grpc.insecure_channel(address) as ch:
        yield ch
    server.stop(None)


def _trailer(err: grpc.RpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(errors.EXC_TYPE_KEY)


def test_an_nnd_error_becomes_its_status_with_its_exception_type(channel):
    assert channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=10) == b"ok:x"
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/{SERVICE}/Unary")(b"not-found", timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no such thing" and _trailer(info.value) == "KeyError"


def test_any_other_failure_is_internal_and_logged(channel, caplog):
    with caplog.at_level(logging.ERROR, logger="nnd.test"), pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/{SERVICE}/Unary")(b"bug", timeout=10)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error here: ValueError: boom"
    assert any(r.exc_info and "/test.Statuses/Unary failed" in r.getMessage() for r in caplog.records)


def test_translate_turns_a_failure_into_an_nnd_error(channel):
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/{SERVICE}/Unary")(b"oom", timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _trailer(info.value) == "MemoryError"


@pytest.mark.parametrize(
    ("request_bytes", "code", "details"),
    [
        (b"x", grpc.StatusCode.RESOURCE_EXHAUSTED, "stopped after one message"),
        (b"bug", grpc.StatusCode.INTERNAL, "internal error here: ZeroDivisionError: mid-stream"),
    ],
)
def test_errors_raised_mid_stream_map_after_what_was_sent(channel, request_bytes, code, details):
    call = channel.unary_stream(f"/{SERVICE}/Streaming")(request_bytes, timeout=10)
    assert next(call) == b"first"
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == code and info.value.details() == details


def test_unparsed_bytes_are_refused_as_invalid_argument(channel):
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/{SERVICE}/Unary")(b"garbage", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "the request is not a valid nnd.v1.Probe message (bad bytes); nothing ran"
    call = channel.stream_stream(f"/{SERVICE}/Both")(iter([b"a", b"garbage", b"c"]), timeout=10)
    assert next(call) == b"a"
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_refused_token_stays_unauthenticated_behind_the_token_check():
    server, address = _server(TokenInterceptor(TOKEN))
    try:
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = ch.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")])
            assert ok == b"ok:x"
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary(f"/{SERVICE}/Unary")(
                    b"not-found", timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")]
                )
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(None)


def test_a_methods_wrapper_is_built_once_and_names_its_own_method():
    class Details(grpc.HandlerCallDetails):
        def __init__(self, method: str) -> None:
            self.method = method
            self.invocation_metadata = ()

    seen: list[str] = []
    mapped = errors.ErrorInterceptor(logging.getLogger("nnd.test"), on_error=lambda method, err: seen.append(method))
    handler = grpc.unary_unary_rpc_method_handler(_unary)
    first = mapped.intercept_service(lambda d: handler, Details("/x/A"))
    assert mapped.intercept_service(lambda d: handler, Details("/x/A")) is first  # no wrapper per call
    other = mapped.intercept_service(lambda d: handler, Details("/x/B"))
    assert other is not first

    class Context:
        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(code)

        def set_trailing_metadata(self, metadata: Any) -> None:
            pass

    for wrapped, name in ((first, "/x/A"), (other, "/x/B")):
        with pytest.raises(RuntimeError):
            wrapped.unary_unary(b"not-found", Context())
        assert seen[-1] == name
