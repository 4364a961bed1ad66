"""The gateway's gRPC listener: a ``grpc.aio`` server on ``--grpc-port``, in the gateway's own
event loop, serving ``inference.GRPCInferenceService``.

The app's lifespan owns it: ``start`` after the gateway's runtime has started, ``stop`` before the
runtime stops, so a call never finds the Redis clients closed. In the same loop as the HTTP
routes, a gRPC call and an HTTP request share the service's futures, reply listener and
auto-pipeline with no thread hop; grpc.aio runs its network I/O in gRPC's C core and hands
finished reads to the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import structlog

from producer.grpc_service import InferenceServicer
from protocol.grpc.service import generic_handler

if TYPE_CHECKING:
    from producer.gateway import Gateway

log = structlog.get_logger("inferq.gateway")

STOP_GRACE_S = 5.0
"""On shutdown, how long calls in flight may finish before they are cancelled. The gRPC server
stops after uvicorn has drained HTTP (up to 10 s, while gRPC keeps serving), so its calls get
that long too; 10 + 5 s fits the 20 s termination grace of ops/k8s/base/gateway.yaml."""


class GrpcPortError(RuntimeError):
    """The gRPC port cannot be bound (in use by another program, or not allowed)."""


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcServer:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.port = gateway.settings.grpc_port
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        s = self.gateway.settings
        server = grpc.aio.server(
            options=[
                # --max-body-bytes bounds a gRPC message as it bounds an HTTP body: a larger
                # one is refused by gRPC itself with RESOURCE_EXHAUSTED before it is parsed.
                ("grpc.max_receive_message_length", s.max_body_bytes),
                # Several gateway processes on one host share the port (`inferq up
                # --gateways N`); the kernel spreads connections over them.
                ("grpc.so_reuseport", 1),
            ]
        )
        server.add_generic_rpc_handlers((generic_handler(InferenceServicer(self.gateway)),))
        address = listen_address(s.host, s.grpc_port)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as e:
            raise GrpcPortError(f"cannot listen for gRPC on {address}: {e}") from None
        if bound == 0:
            raise GrpcPortError(f"cannot listen for gRPC on {address}")
        await server.start()
        self._server, self.port = server, bound
        log.info("gRPC listening", address=listen_address(s.host, bound))

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Refuse new calls, let those in flight finish up to ``grace_s``, cancel the rest."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
