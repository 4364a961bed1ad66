"""What a worker advertises about itself and the models it serves.

Workers publish a ``WorkerInfo`` under ``Keys.worker(id)`` with a TTL and refresh it with every
heartbeat; the gateway reads the live ones to learn which models exist, their metadata, and how
many consumers serve each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.control import check_weights
from protocol.envelope import pack, unpack
from protocol.errors import ProtocolError
from protocol.keys import MAX_PARTITIONS
from protocol.tensor import DATATYPES


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A declared model input or output. ``-1`` marks a variable dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def wire(self) -> list[Any]:
        return [self.name, self.datatype, list(self.shape)]

    @classmethod
    def from_wire(cls, item: Any) -> TensorSpec:
        if not (isinstance(item, list) and len(item) == 3):
            raise ProtocolError("tensor spec is not a [name, datatype, shape] list")
        name, datatype, shape = item
        if not isinstance(name, str):
            raise ProtocolError("tensor spec has a name that is not a string")
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            raise ProtocolError(f"tensor spec {name!r} has an invalid datatype")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= -1 for d in shape):
            raise ProtocolError(
                f"tensor spec {name!r}: shape must be a list of integers, -1 for variable"
            )
        return cls(name, datatype, tuple(shape))


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """A model as the gateway needs to know it to validate, route and describe requests."""

    name: str
    versions: tuple[str, ...]
    """Versions loaded, oldest first."""
    default_version: str
    """The version a request without ``/versions/{v}`` goes to."""
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: int
    default_timeout_ms: int
    cache_enabled: bool
    cache_ttl_s: int
    weights: dict[str, float] = field(default_factory=dict)
    """The repository config's traffic weights per version (empty: all to the default)."""
    partitions: int = 1
    """Request streams per lane (``Keys.stream(model, lane, partition)``); gateways spread
    requests over them."""

    def wire(self) -> list[Any]:
        return [
            self.name,
            list(self.versions),
            self.default_version,
            self.platform,
            [s.wire() for s in self.inputs],
            [s.wire() for s in self.outputs],
            self.max_batch,
            self.default_timeout_ms,
            self.cache_enabled,
            self.cache_ttl_s,
            self.weights,
            self.partitions,
        ]

    @classmethod
    def from_wire(cls, item: Any) -> ModelMetadata:
        if not (isinstance(item, list) and len(item) == 12):
            raise ProtocolError("model metadata is not a 12-field list")
        name, versions, default, platform, inputs, outputs, mb, timeout, cache, ttl, weights = item[
            :11
        ]
        partitions = item[11]
        if not _is_int(partitions) or not 1 <= partitions <= MAX_PARTITIONS:
            raise ProtocolError(f"model {name!r}: partitions must be 1 to {MAX_PARTITIONS}")
        if not isinstance(weights, dict):
            raise ProtocolError(f"model {name!r}: weights must be a map")
        if not isinstance(name, str) or not isinstance(versions, list):
            raise ProtocolError("model metadata: invalid name or versions")
        if not all(isinstance(v, str) for v in versions) or not isinstance(default, str):
            raise ProtocolError(f"model {name}: versions must be strings")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ProtocolError(f"model {name}: inputs and outputs must be lists")
        if not isinstance(platform, str):
            raise ProtocolError(f"model {name}: platform must be a string")
        if not all(_is_int(x) for x in (mb, timeout, ttl)) or not isinstance(cache, bool):
            raise ProtocolError(f"model {name}: invalid batching, timeout or cache fields")
        return cls(
            name=name,
            versions=tuple(versions),
            default_version=default,
            platform=platform,
            inputs=tuple(TensorSpec.from_wire(s) for s in inputs),
            outputs=tuple(TensorSpec.from_wire(s) for s in outputs),
            max_batch=mb,
            default_timeout_ms=timeout,
            cache_enabled=cache,
            cache_ttl_s=ttl,
            weights=check_weights(weights, what=f"model {name} weights") if weights else {},
            partitions=partitions,
        )

    def encode(self) -> bytes:
        """Standalone form, for the ``Keys.models`` hash of last-known metadata."""
        return pack([self.wire()])

    @classmethod
    def decode(cls, raw: bytes) -> ModelMetadata:
        return cls.from_wire(unpack(raw, "model metadata", 1)[0])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    started_ms: int
    models: tuple[ModelMetadata, ...]

    def encode(self) -> bytes:
        return pack(
            [self.id, self.host, self.pid, self.started_ms, [m.wire() for m in self.models]]
        )

    @classmethod
    def decode(cls, raw: bytes) -> WorkerInfo:
        wid, host, pid, started, models = unpack(raw, "worker info", 5)
        if not isinstance(wid, str) or not isinstance(models, list):
            raise ProtocolError("worker info: invalid id or models")
        if not isinstance(host, str) or not _is_int(pid) or not _is_int(started):
            raise ProtocolError(f"worker info {wid}: invalid host, pid or started_ms")
        return cls(
            id=wid,
            host=host,
            pid=pid,
            started_ms=started,
            models=tuple(ModelMetadata.from_wire(m) for m in models),
        )
