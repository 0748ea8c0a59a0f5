"""The standard gRPC health service (with List) and server reflection (v1 and v1alpha).

Both come from optional packages (grpcio-health-checking, grpcio-reflection);
without them the daemon serves neither. grpcio-health-checking's servicer
answers Check and Watch but not List, which its own proto (and so reflection)
advertises: `Health` below adds it. grpcio-reflection serves only
`grpc.reflection.v1alpha`; `grpc.reflection.v1` (what grpcurl and newer tools
try first) has the same messages under another package name, so the same
servicer answers it, and its file descriptor (v1alpha's, renamed) is added to
the pool so that the v1 service can be described too.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

_V1 = "grpc.reflection.v1"
_V1_SERVICE = f"{_V1}.ServerReflection"


def add(server: grpc.Server, service_names: tuple[str, ...]) -> Any:
    """Serve health and reflection on `server`; returns the health servicer, or None without the extras."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
        from grpc_reflection.v1alpha import reflection_pb2 as alpha
    except ImportError:  # optional extras
        return None

    class Health(health.HealthServicer):
        """HealthServicer with List: every service whose status is known (unloaded models are not)."""

        def __init__(self) -> None:
            super().__init__()
            self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
            self._statuses_lock = threading.Lock()
            self._frozen = False  # after enter_graceful_shutdown, as the base class ignores `set`

        def set(self, service: str, status: int) -> None:
            super().set(service, status)
            with self._statuses_lock:
                if self._frozen:
                    return
                if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
                    self._statuses.pop(service, None)
                else:
                    self._statuses[service] = status

        def enter_graceful_shutdown(self) -> None:
            super().enter_graceful_shutdown()
            with self._statuses_lock:
                self._frozen = True

        def List(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - the RPC's name
            with self._statuses_lock:
                statuses = dict(self._statuses)
            response = health_pb2.HealthListResponse()
            for name, status in statuses.items():
                response.statuses[name].status = status
            return response

    servicer = Health()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME, _V1_SERVICE)
    reflection.enable_server_reflection(names, server)
    _add_v1_descriptor(alpha)
    reflector = reflection.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        reflector.ServerReflectionInfo,
        request_deserializer=alpha.ServerReflectionRequest.FromString,
        response_serializer=alpha.ServerReflectionResponse.SerializeToString,
    )
    v1 = grpc.method_handlers_generic_handler(_V1_SERVICE, {"ServerReflectionInfo": handler})
    server.add_generic_rpc_handlers((v1,))
    return servicer


def _add_v1_descriptor(alpha: Any) -> None:
    """Put grpc/reflection/v1/reflection.proto (v1alpha's messages, renamed) in the default pool, once."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName("grpc/reflection/v1/reflection.proto")
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = _V1
    proto.ClearField("options")  # v1alpha's say deprecated, and name v1alpha's packages
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = f".{_V1}." + f.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{_V1}." + method.input_type[len(old) :]
            method.output_type = f".{_V1}." + method.output_type[len(old) :]
    pool.Add(proto)
