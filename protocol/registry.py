"""What a worker advertises about itself: the models it serves, and those it could load.

Workers publish a ``WorkerInfo`` under ``Keys.worker(id)`` with a TTL and refresh it with every
heartbeat; the gateway reads the live ones to learn which models exist, their metadata, how many
consumers serve each, and what each worker's repository holds (``RepositoryModel``: the models a
load call may name, with the versions their folders hold, or why one cannot be loaded). Loaded
and loadable models are advertised the same way, each with its ``ModelMetadata``.
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
    backend: str = ""
    """The config's backend (onnx, pytorch, python, simulated): Triton's ``backend``."""
    flush_ms: float = 0.0
    """The batch window in effect (Triton's ``max_queue_delay_microseconds``)."""

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
            self.backend,
            self.flush_ms,
        ]

    @classmethod
    def from_wire(cls, item: Any) -> ModelMetadata:
        if not (isinstance(item, list) and len(item) == 14):
            raise ProtocolError("model metadata is not a 14-field list")
        name, versions, default, platform, inputs, outputs, mb, timeout, cache, ttl, weights = item[
            :11
        ]
        partitions, backend, flush_ms = item[11:]
        if not isinstance(backend, str) or isinstance(flush_ms, bool):
            raise ProtocolError(f"model {name!r}: invalid backend or flush_ms")
        if not isinstance(flush_ms, int | float) or not 0 <= flush_ms < float("inf"):
            raise ProtocolError(f"model {name!r}: flush_ms must be a number >= 0")
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
            backend=backend,
            flush_ms=float(flush_ms),
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
class RepositoryModel:
    """A model of a worker's repository that a load call may name on that worker: every folder
    of the repository when the worker serves the whole repository, else the models its
    ``--models`` names. Loaded or not; the gateway's repository index lists these."""

    name: str
    versions: tuple[str, ...]
    """Version folders present, oldest first."""
    metadata: ModelMetadata | None = None
    """The model as its config would serve it; None when it cannot be loaded (see ``error``)."""
    error: str = ""
    """Why its config cannot be loaded ("" when it can)."""

    def wire(self) -> list[Any]:
        meta = None if self.metadata is None else self.metadata.wire()
        return [self.name, list(self.versions), meta, self.error]

    @classmethod
    def from_wire(cls, item: Any) -> RepositoryModel:
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError("repository model is not a 4-field list")
        name, versions, meta, error = item
        if not isinstance(name, str) or not isinstance(error, str):
            raise ProtocolError("repository model: invalid name or error")
        if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
            raise ProtocolError(f"repository model {name!r}: versions must be strings")
        metadata = None if meta is None else ModelMetadata.from_wire(meta)
        return cls(name, tuple(versions), metadata, error)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    started_ms: int
    models: tuple[ModelMetadata, ...]
    """The models it serves (a model unloaded by an administrator: no versions)."""
    repository: tuple[RepositoryModel, ...] = ()
    """The models a load call may name on this worker (served ones included)."""
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Model -> generation of the committed policy it could not serve at start (a version it
    names has no folder, or does not load): it serves the repository config's instead."""
    on_demand: bool = False
    """It loads the models of ``repository`` (those with metadata) when requests for them wait
    (``--load on-demand``): a request for one of them waits instead of being refused."""
    resident_bytes: int = 0
    """Its resident memory (RSS) when it described itself, at its last heartbeat (0: unknown,
    as from a worker of a release that did not say)."""
    restarts: int = 0
    """How many times ``inferq up`` restarted its slot before this process (0 for the first,
    and for a worker no supervisor started)."""

    def loads_on_demand(self, model: str) -> bool:
        """Whether it would load the model for a request (it may serve it already)."""
        return self.on_demand and any(
            r.name == model and r.metadata is not None for r in self.repository
        )

    def holds(self, model: str) -> bool:
        """Whether it serves the model or its repository holds it (a change of the model
        concerns this worker)."""
        return any(m.name == model for m in self.models) or any(
            r.name == model for r in self.repository
        )

    def encode(self) -> bytes:
        return pack(
            [
                self.id,
                self.host,
                self.pid,
                self.started_ms,
                [m.wire() for m in self.models],
                [r.wire() for r in self.repository],
                self.fallbacks,
                self.on_demand,
                self.resident_bytes,
                self.restarts,
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> WorkerInfo:
        """The advertisement; one of an older worker, without the last two fields, decodes with
        them 0 (during a rolling upgrade, gateways read both)."""
        fields = unpack(raw, "worker info", 10, defaults=(0, 0))
        wid, host, pid, started, models, repository, fallbacks, on_demand, rss, restarts = fields
        if not isinstance(wid, str) or not isinstance(models, list):
            raise ProtocolError("worker info: invalid id or models")
        if not isinstance(host, str) or not _is_int(pid) or not _is_int(started):
            raise ProtocolError(f"worker info {wid}: invalid host, pid or started_ms")
        if not isinstance(repository, list):
            raise ProtocolError(f"worker info {wid}: repository must be a list")
        if not isinstance(fallbacks, dict) or not all(_is_int(g) for g in fallbacks.values()):
            raise ProtocolError(f"worker info {wid}: fallbacks must map models to generations")
        if not isinstance(on_demand, bool):
            raise ProtocolError(f"worker info {wid}: on_demand must be a boolean")
        if not all(_is_int(n) and n >= 0 for n in (rss, restarts)):
            raise ProtocolError(f"worker info {wid}: resident_bytes and restarts must be counts")
        return cls(
            id=wid,
            host=host,
            pid=pid,
            started_ms=started,
            models=tuple(ModelMetadata.from_wire(m) for m in models),
            repository=tuple(RepositoryModel.from_wire(r) for r in repository),
            fallbacks=dict(fallbacks),
            on_demand=on_demand,
            resident_bytes=rss,
            restarts=restarts,
        )
