"""The gRPC service ``inference.GRPCInferenceService`` on the wire: its name, its methods (read
from the proto's own service declaration, so they are spelled once), a server-side handler for
any object that implements some of them, and a client stub.

Hand-bound rather than generated (``grpc_tools`` would also write a ``_pb2_grpc`` module) because
the generated binding takes the service's name from the Python classes' package, which is
renamed (see ``protocol.grpc``); everything else a generated binding does is the few lines below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from protocol.grpc import inferq_v2_pb2 as pb

SERVICE = "inference.GRPCInferenceService"
"""The service's full name on the wire, as KServe and Triton clients call it."""


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    request: type[Message]
    response: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


def _methods() -> dict[str, Method]:
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    classes: dict[str, type[Message]] = {
        name: getattr(pb, name) for name in pb.DESCRIPTOR.message_types_by_name
    }
    return {
        m.name: Method(
            m.name,
            classes[m.input_type.name],
            classes[m.output_type.name],
            m.client_streaming,
            m.server_streaming,
        )
        for m in service.methods
    }


METHODS: dict[str, Method] = _methods()
"""Every method of the service, by name."""


def _serializer(message: Message) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def generic_handler(servicer: object) -> grpc.GenericRpcHandler:
    """The server-side binding of every method ``servicer`` defines (an async method named as
    the RPC, taking ``(request, context)``, or ``(request_iterator, context)`` for a stream);
    methods it lacks answer UNIMPLEMENTED, as gRPC does for any unknown method."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in METHODS.values():
        behaviour = getattr(servicer, method.name, None)
        if behaviour is None:
            continue
        if method.client_streaming and method.server_streaming:
            make: Callable[..., grpc.RpcMethodHandler] = grpc.stream_stream_rpc_method_handler
        elif method.client_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            behaviour,
            request_deserializer=method.request.FromString,
            response_serializer=_serializer,
        )
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


class Stub:
    """A client of the service on a channel (``grpc.Channel`` or ``grpc.aio.Channel``): one
    callable attribute per method, as a generated stub has, e.g. ``stub.ModelInfer(request,
    timeout=1.0, metadata=...)``."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        for method in METHODS.values():
            if method.client_streaming and method.server_streaming:
                factory: Any = channel.stream_stream
            elif method.client_streaming:
                factory = channel.stream_unary
            elif method.server_streaming:
                factory = channel.unary_stream
            else:
                factory = channel.unary_unary
            setattr(
                self,
                method.name,
                factory(
                    method.path,
                    request_serializer=_serializer,
                    response_deserializer=method.response.FromString,
                ),
            )

    def __getattr__(self, name: str) -> Any:  # for type checkers: attributes are set above
        raise AttributeError(f"{SERVICE} has no method {name!r}")
