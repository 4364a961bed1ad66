"""The gRPC service ``inference.GRPCInferenceService`` on the wire: its name, its methods (read
from the proto's own service declaration, so they are spelled once), a server-side handler for
any object that implements some of them, and a client stub.

Hand-bound rather than generated (``grpc_tools`` would also write a ``_pb2_grpc`` module) because
the generated binding takes the service's name from the Python classes' package, which is
renamed (see ``protocol.grpc``); everything else a generated binding does is the few lines below.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

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
    """The ``grpc.aio`` server-side binding of every method ``servicer`` defines: an async
    method named as the RPC, taking ``(request, context)``, or ``(requests, context)`` (an async
    iterator) for a client stream. Methods it lacks answer UNIMPLEMENTED, as gRPC does for any
    unknown method. A message that does not decode is INVALID_ARGUMENT (gRPC's own deserializer
    would answer UNKNOWN)."""
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
        handlers[method.name] = make(_decoding(method, behaviour), response_serializer=_serializer)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _decoding(method: Method, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    if method.client_streaming:

        async def stream(raw_requests: AsyncIterator[bytes], context: Any) -> Any:
            async def requests() -> AsyncIterator[Message]:
                async for raw in raw_requests:
                    yield await _decode(method, raw, context)

            return await behaviour(requests(), context)

        return stream

    async def unary(raw: bytes, context: Any) -> Any:
        return await behaviour(await _decode(method, raw, context), context)

    return unary


async def _decode(method: Method, raw: bytes, context: Any) -> Message:
    try:
        return method.request.FromString(raw)
    except DecodeError:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid inference.{method.request.DESCRIPTOR.name} message "
            "(protobuf cannot decode it)",
        )
        raise  # abort raises; this is for type checkers


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
