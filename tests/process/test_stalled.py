"""Stalled calls cost the route's worker no thread it needs (issue #26): calls opened on a worker's
route socket that never send their request are refused by gRPC beyond the socket's call limit, so
they cannot take every thread, and a bystander's trace is served (through the daemon if the route's
socket is full), against a real daemon."""

from __future__ import annotations

import threading

import grpc
import torch

import nnd
from nnd.v1 import nnd_pb2, nnd_pb2_grpc

PROMPT = "Hello world"
STALLED = 330  # more than the worker's 320 threads


def test_hundreds_of_stalled_calls_on_a_route_leave_bystanders_served(fresh_daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=fresh_daemon.address, device="cpu", dispatch=True)
    with model.trace(PROMPT):
        want = model.lm_head.output.save()
    with grpc.insecure_channel(fresh_daemon.address) as channel:
        route = nnd_pb2_grpc.NndStub(channel).GetRoute(nnd_pb2.RouteRequest(model=model.name), timeout=60)
    release = threading.Event()

    def never():  # the request never comes (until the test ends)
        release.wait()
        return
        yield

    attacker = grpc.insecure_channel(route.address)
    stalled = [
        attacker.stream_stream(
            "/nnd.v1.Nnd/Trace", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )(never())
        for _ in range(STALLED)
    ]
    try:
        refused = 0
        for call in stalled[-40:]:  # the last ones found the socket full: refused at once, no thread taken
            try:
                call.result() if hasattr(call, "result") else next(call)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused += 1
        assert refused > 0
        with model.trace(PROMPT, timeout=120):
            got = model.lm_head.output.save()
        assert torch.equal(got, want)
        assert model._conn.router.fallbacks >= 1  # the route's socket was full: it went through the daemon
    finally:
        release.set()
        for call in stalled:
            call.cancel()
        attacker.close()
