"""``inference.GRPCInferenceService``: the V2 gRPC methods, each a thin call into the same
inference service, registry and model admin the HTTP routes use, observed by the same wrapper
(``producer.instrument``, ``protocol="grpc"``, the HTTP status of the answer).

Refusals are the gateway's own errors, in their gRPC form (``_abort``). A call's gRPC deadline
becomes the request's V2 ``timeout`` (the smaller, when both are given). A call the client
cancels cancels its handler, and the service abandons the request as for an HTTP client that
hangs up: it stops waiting, and a worker that has not started it drops it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf import json_format

import runtime
from producer.errors import BadRequest, GatewayError, GatewayTimeout, NotFound
from producer.grpc_codec import decode_infer_request, encode_infer_response, parameter_values
from producer.httpbody import caller_traceparent, no_cache
from producer.instrument import Instrument, Observation
from protocol.grpc import inferq_v2_pb2 as pb
from protocol.grpc.status import grpc_code
from runtime.tracing import REQUEST_TRACE

if TYPE_CHECKING:
    from producer.admin import ModelAdmin
    from producer.gateway import Gateway

T = TypeVar("T")

EXTENSIONS = [
    "schedule_policy",
    "model_repository",
    "model_configuration",
    "statistics",
    "streaming",
]
"""What ``ServerMetadata`` lists: the V2 priority/timeout parameters, the repository RPCs,
``ModelConfig``, ``ModelStatistics`` and ``ModelStreamInfer``. The HTTP-only binary tensor and
async jobs extensions are not offered here."""


class InferenceServicer:
    """The service's methods; ``protocol.grpc.service.generic_handler`` binds them by name."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.instrument = Instrument(gateway, gateway.tracer if gateway.tracer.enabled else None)

    # -- health and metadata ---------------------------------------------------------------

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        async def work() -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)

        return await self._unary(context, self._start("health_live"), work)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        async def work() -> pb.ServerReadyResponse:
            # The V2 message has no field for the reasons; /v2/health/ready lists them.
            ok, _ = await self.gateway.ready()
            return pb.ServerReadyResponse(ready=ok)

        return await self._unary(context, self._start("health_ready"), work)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        async def work() -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(
                name="inferq", version=runtime.__version__, extensions=EXTENSIONS
            )

        return await self._unary(context, self._start("server_metadata"), work)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        async def work() -> pb.ModelReadyResponse:
            # An unknown model is not ready, as tritonclient reads an HTTP 404 here: a client
            # polling for a model that is still starting must not get an error.
            try:
                entry, _ = await self.gateway.service.model(
                    request.name, request.version or None, route=False
                )
            except NotFound:
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=entry.ready)

        return await self._unary(
            context, self._start("model_ready", request.name, request.version), work
        )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        async def work() -> pb.ModelMetadataResponse:
            entry, _ = await self.gateway.service.model(
                request.name, request.version or None, route=False
            )
            meta = entry.metadata
            spec = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=meta.name,
                versions=list(meta.versions),
                platform=meta.platform,
                inputs=[spec(name=s.name, datatype=s.datatype, shape=s.shape) for s in meta.inputs],
                outputs=[
                    spec(name=s.name, datatype=s.datatype, shape=s.shape) for s in meta.outputs
                ],
            )

        return await self._unary(
            context, self._start("model_metadata", request.name, request.version), work
        )

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        async def work() -> pb.ModelConfigResponse:
            doc = await self.gateway.introspection.config(request.name, request.version or None)
            response = pb.ModelConfigResponse()
            json_format.ParseDict({"config": doc}, response)
            return response

        return await self._unary(context, self._start("other"), work)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        async def work() -> pb.ModelStatisticsResponse:
            doc = await self.gateway.introspection.statistics(
                request.name or None, request.version or None
            )
            response = pb.ModelStatisticsResponse()
            json_format.ParseDict(doc, response)
            return response

        return await self._unary(context, self._start("other"), work)

    # -- inference -------------------------------------------------------------------------

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        size = request.ByteSize()
        seen = self._start("infer", request.model_name, request.model_version, size)
        return await self._unary(context, seen, lambda: self._infer(request, size, context, seen))

    async def ModelStreamInfer(
        self,
        requests: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Each request on the stream runs concurrently; each answer, or its error, is written
        as soon as it is ready (so answers may come in another order: match them by ``id``)."""
        writing = asyncio.Lock()
        running: set[asyncio.Task[None]] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            size = request.ByteSize()
            seen = self._start("infer", request.model_name, request.model_version, size)
            try:
                answer = pb.ModelStreamInferResponse(
                    infer_response=await self._observed(
                        seen, lambda: self._infer(request, size, context, seen)
                    )
                )
            except GatewayError as e:
                answer = pb.ModelStreamInferResponse(
                    error_message=e.message,
                    infer_response=pb.ModelInferResponse(
                        model_name=request.model_name,
                        model_version=request.model_version,
                        id=request.id,
                    ),
                )
            async with writing:
                await context.write(answer)

        try:
            async for request in requests:
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _infer(
        self,
        request: pb.ModelInferRequest,
        size: int,
        context: grpc.aio.ServicerContext,
        seen: Observation,
    ) -> pb.ModelInferResponse:
        metadata = _metadata(context)
        parameters = _with_deadline(parameter_values(request.parameters), context)
        service = self.gateway.service
        if self.instrument.tracer is not None:
            seen.trace(
                "grpc ModelInfer",
                metadata.get("traceparent"),
                {"rpc.system": "grpc", "inferq.model": request.model_name},
            )
        # The message is in memory already (gRPC refused it past --max-body-bytes): hold its
        # bytes against --max-inflight-bytes, as HTTP holds a body's, until the answer.
        with service.hold_body() as hold:
            hold.grow_to(size)
            # A call the client cancels cancels this task: the service abandons the request
            # (stops waiting, marks it so a worker that has not started it drops it).
            outcome = await service.infer(
                request.model_name,
                request.model_version or None,
                lambda meta: decode_infer_request(request, meta, parameters),
                no_cache=no_cache(metadata),
                traceparent=caller_traceparent(metadata),
            )
        seen.routed = outcome.version
        result = outcome.result
        with REQUEST_TRACE.get().span("encode response"):
            return encode_infer_response(
                client_id=outcome.body.client_id,
                model_name=result.model,
                model_version=result.version,
                outputs=result.outputs,
                typed=not request.raw_input_contents,
            )

    # -- model repository (Triton's extension) ---------------------------------------------

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        async def work() -> pb.RepositoryIndexResponse:
            admin = self._admin(context)
            index = pb.RepositoryIndexResponse.ModelIndex
            return pb.RepositoryIndexResponse(
                models=[
                    index(
                        name=row["name"],
                        version=row.get("version", ""),
                        state=row["state"],
                        reason=row.get("reason", ""),
                    )
                    for row in await admin.index(ready_only=request.ready)
                ]
            )

        return await self._unary(context, self._start("other"), work)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        async def work() -> pb.RepositoryModelLoadResponse:
            admin = self._admin(context)
            await admin.load(request.model_name, _load_parameters(request.parameters))
            return pb.RepositoryModelLoadResponse()

        return await self._unary(context, self._start("other"), work)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        async def work() -> pb.RepositoryModelUnloadResponse:
            admin = self._admin(context)
            await admin.unload(request.model_name, parameter_values(request.parameters))
            return pb.RepositoryModelUnloadResponse()

        return await self._unary(context, self._start("other"), work)

    def _admin(self, context: grpc.aio.ServicerContext) -> ModelAdmin:
        admin = self.gateway.admin
        admin.authorize(_metadata(context).get("authorization"))
        return admin

    # -- one place for status codes and metrics --------------------------------------------

    def _start(
        self,
        endpoint: str,
        model: str | None = None,
        version: str | None = None,
        body_bytes: int | None = None,
    ) -> Observation:
        """A call's observation (gRPC sends "" for an absent model or version)."""
        return self.instrument.start(
            endpoint, model or None, version or None, protocol="grpc", body_bytes=body_bytes
        )

    async def _unary(
        self, context: grpc.aio.ServicerContext, seen: Observation, work: Callable[[], Awaitable[T]]
    ) -> T:
        try:
            return await self._observed(seen, work)
        except GatewayError as e:
            await _abort(context, e)

    async def _observed(self, seen: Observation, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` under ``seen``: its answer, or the GatewayError the caller is told
        (``Observation.failed``; a cancellation propagates)."""
        try:
            answer = await work()
        except asyncio.CancelledError as e:
            seen.failed(e)
            raise
        except Exception as e:
            error = seen.failed(e, method=seen.endpoint, protocol="grpc")
            if error is e:
                raise
            raise error from e
        seen.end(200)
        return answer


async def _abort(context: grpc.aio.ServicerContext, error: GatewayError) -> NoReturn:
    """The gRPC form of a refusal: the code of its HTTP status, its message, and its
    ``Retry-After`` as trailing metadata."""
    retry_after = error.retry_after()
    if retry_after is not None:
        context.set_trailing_metadata((("retry-after", retry_after),))
    await context.abort(grpc_code(error.status), error.message)
    raise AssertionError("context.abort returned")  # it raises; this tells type checkers


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's text metadata (gRPC lowercases keys; binary ``-bin`` values are skipped)."""
    return {
        key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)
    }


def _with_deadline(parameters: dict[str, Any], context: grpc.aio.ServicerContext) -> dict[str, Any]:
    """The request's parameters with the call's deadline as its V2 ``timeout`` (microseconds),
    or the smaller of the two when the request names one too."""
    remaining = context.time_remaining()
    if remaining is None:
        return parameters
    if remaining <= 0:
        raise GatewayTimeout("the call's gRPC deadline passed before the request was read")
    deadline_us = max(1, int(remaining * 1_000_000))
    given = parameters.get("timeout")
    if given is None or given == 0:
        parameters["timeout"] = deadline_us
    elif isinstance(given, int) and not isinstance(given, bool) and given > 0:
        parameters["timeout"] = min(given, deadline_us)
    # Anything else is invalid and left for the service to refuse with its usual message.
    return parameters


def _load_parameters(parameters: Any) -> dict[str, Any]:
    """Load parameters as ``ModelAdmin.load`` takes them from JSON: ``weights`` travels as a
    JSON object in a string parameter, since a gRPC parameter holds no maps."""
    values = parameter_values(parameters)
    weights = values.get("weights")
    if isinstance(weights, str):
        try:
            values["weights"] = json.loads(weights)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            raise BadRequest(
                "parameter 'weights' must be a JSON object in a string, e.g. "
                '\'{"1": 90, "2": 10}\''
            ) from None
    return values
