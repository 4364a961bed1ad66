"""``inferq loadgen --protocol grpc``: the V2 ``ModelInfer`` RPC as a unit of work.

A :class:`GrpcConnection` is one HTTP/2 connection (a ``grpc.aio`` channel with its own
subchannel pool, so connections are not shared behind the loop's back) and stands where an
:class:`loadgen.http.HTTPConnection` stands in the load loops: ``connect``, ``connected``,
``aclose``. Requests are serialized once, up front; answers are not parsed, only their status
counted (the HTTP status a gRPC code stands for, ``protocol.grpc.status``), so the client spends
as little CPU as the HTTP one does per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from loadgen.http import ConnectError
from loadgen.inputs import Tensor, generate_tensors, input_specs, tensors_from_body
from protocol.grpc import inferq_v2_pb2 as pb
from protocol.grpc.service import METHODS, Stub
from protocol.grpc.status import http_status

__all__ = [
    "GrpcConnection",
    "GrpcTargetError",
    "grpc_metadata",
    "grpc_operation",
    "grpc_requests",
    "infer_request",
]

_CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]
_INFER = METHODS["ModelInfer"].path


class GrpcConnection:
    """One channel to ``target`` (``host:port``); ``metadata`` goes with every call."""

    def __init__(
        self,
        target: str,
        *,
        connect_timeout: float = 5.0,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.target = target
        self.connect_timeout = connect_timeout
        self.metadata = tuple(metadata)
        self._channel: grpc.aio.Channel | None = None
        self._infer: Callable[..., Any] | None = None

    @property
    def connected(self) -> bool:
        return self._infer is not None

    async def connect(self) -> None:
        if self.connected:
            return
        channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        try:
            await asyncio.wait_for(channel.channel_ready(), self.connect_timeout)
        except TimeoutError:
            await channel.close()
            raise ConnectError(f"cannot connect to {self.target} (gRPC)") from None
        self._channel = channel
        # No (de)serializers: the requests are bytes already, and answers are only counted.
        self._infer = channel.unary_unary(_INFER)

    async def infer(self, request: bytes, budget_s: float | None) -> int:
        """Send one serialized ``ModelInferRequest``; the HTTP status its answer stands for."""
        if self._infer is None:
            await self.connect()
            assert self._infer is not None
        try:
            await self._infer(request, timeout=budget_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            return http_status(e.code())
        return 200

    async def aclose(self) -> None:
        channel, self._channel, self._infer = self._channel, None, None
        if channel is not None:
            await channel.close()


def grpc_operation(requests: Sequence[bytes]) -> Callable[..., Any]:
    """An operation factory for the load loops: unit of work ``k`` sends request ``k mod n`` on
    the worker's :class:`GrpcConnection` (the loops' HTTP request encoding is not used)."""
    reqs = list(requests)
    if not reqs:
        raise ValueError("requests is empty")
    n = len(reqs)

    def factory(target: object, encoded: object) -> Callable[..., Any]:
        async def op(conn: GrpcConnection, k: int, budget_s: float | None) -> int:
            return await conn.infer(reqs[k % n], budget_s)

        return op

    return factory


def _parameter(value: Any) -> pb.InferParameter:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=str(value))


def infer_request(
    model: str,
    version: str | None,
    tensors: Sequence[Tensor],
    parameters: Mapping[str, Any] | None = None,
) -> bytes:
    """A serialized ``ModelInferRequest`` with the tensors as raw contents (how
    ``tritonclient.grpc`` sends them)."""
    request = pb.ModelInferRequest(model_name=model, model_version=version or "")
    for t in tensors:
        request.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        request.raw_input_contents.append(t.raw())
    for key, value in (parameters or {}).items():
        request.parameters[key].CopyFrom(_parameter(value))
    data: bytes = request.SerializeToString()
    return data


async def grpc_metadata(target: str, model: str, version: str | None, timeout_s: float) -> Any:
    """``ModelMetadata`` as the JSON document ``GET /v2/models/{m}`` would give (the parts
    :func:`loadgen.inputs.input_specs` reads)."""
    async with grpc.aio.insecure_channel(target) as channel:
        meta = await Stub(channel).ModelMetadata(
            pb.ModelMetadataRequest(name=model, version=version or ""), timeout=timeout_s
        )

    def spec(t: Any) -> dict[str, Any]:
        return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}

    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": [spec(t) for t in meta.inputs],
        "outputs": [spec(t) for t in meta.outputs],
    }


async def grpc_requests(
    target: str,
    model: str,
    version: str | None,
    *,
    document: Any,
    parameters: Mapping[str, Any],
    rows: int,
    distinct: int,
    seed: int,
    shapes: Mapping[str, Sequence[int]],
    timeout_s: float,
) -> list[bytes]:
    """The serialized requests of a run: those of an ``--input-file`` document (one V2 JSON
    request or a list of them), else ``distinct`` sets of seeded random inputs shaped by the
    model's metadata, read over gRPC."""
    if document is not None:
        items = document if isinstance(document, list) else [document]
        if not items or not all(isinstance(i, dict) for i in items):
            raise ValueError(
                "the input file must hold a V2 inference request object or a list of them"
            )
        return [
            infer_request(
                model,
                version,
                tensors_from_body(item),
                {**(item.get("parameters") or {}), **parameters},
            )
            for item in items
        ]
    try:
        metadata = await grpc_metadata(target, model, version, timeout_s)
    except grpc.aio.AioRpcError as e:
        raise GrpcTargetError(
            f"cannot fetch model metadata from {target} (gRPC): {e.code().name} {e.details()}"
        ) from None
    specs = input_specs(metadata)
    rng = np.random.default_rng(seed)
    return [
        infer_request(
            model,
            version,
            generate_tensors(specs, rows=rows, rng=rng, overrides=shapes),
            parameters,
        )
        for _ in range(distinct)
    ]


class GrpcTargetError(Exception):
    """The gRPC server could not be asked for the model's metadata."""
