"""Per-model inference statistics in Triton's terms, counted by each worker and summed by the
gateway (``GET /v2/models/{m}/stats``, gRPC ``ModelStatistics``).

Nothing is written to Redis per request: a worker keeps these counters in memory
(``consumer.stats.InferenceStats``) and publishes them, whole, with its heartbeat under
``Keys.worker_stats(id)`` (the same TTL as its advertisement); a gateway asked for statistics
reads the live workers' values (one MGET) and adds them up. So a figure is as old as the last
heartbeat (``--heartbeat-s``), and counts from a worker that has gone leave the sum with it.

The fields are Triton's (``ModelStatistics`` in its ``grpc_service.proto``), per model version:

- ``inference_count``: rows of successful requests (a request of n rows counts n);
  ``execution_count``: model calls (batches) that served them.
- ``success`` / ``fail``: requests and their time on the worker, from the gateway's enqueue
  (on the Redis clock) to the end of their batch; a request that expired unrun counts as a
  failure.
- ``queue``: successful requests' time before their batch started (stream queue and batch
  formation); ``compute_input``, ``compute_infer``, ``compute_output``: their batch's time to
  gather the inputs, run the model, and split the outputs, counted once per request.
- ``batch_stats``: per batch size (rows of one model call), the calls of that size and their
  compute durations.

``WorkerStatistics`` is the value's one codec; ``VersionStats.add`` is the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.envelope import pack, unpack
from protocol.errors import ProtocolError


@dataclass(slots=True)
class Duration:
    """A count and the nanoseconds it took in all (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def record(self, seconds: float, count: int = 1) -> None:
        """``count`` events that took ``seconds`` in all."""
        self.count += count
        self.ns += max(0, round(seconds * 1e9))

    def record_each(self, seconds: float, count: int) -> None:
        """``count`` events that took ``seconds`` each: the same sums as ``count`` calls of
        ``record(seconds)`` (each rounded to nanoseconds first), in one step."""
        self.count += count
        self.ns += count * max(0, round(seconds * 1e9))

    def add(self, other: Duration) -> None:
        self.count += other.count
        self.ns += other.ns

    def wire(self) -> list[int]:
        return [self.count, self.ns]

    @classmethod
    def from_wire(cls, item: Any) -> Duration:
        if not (isinstance(item, list) and len(item) == 2 and all(_is_count(v) for v in item)):
            raise ProtocolError("statistics: a duration is not a [count, ns] pair")
        return cls(item[0], item[1])

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    """Model calls of one batch size (Triton's ``InferBatchStatistics``)."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)

    def add(self, other: BatchStats) -> None:
        self.compute_input.add(other.compute_input)
        self.compute_infer.add(other.compute_infer)
        self.compute_output.add(other.compute_output)

    def wire(self) -> list[Any]:
        return [self.compute_input.wire(), self.compute_infer.wire(), self.compute_output.wire()]

    @classmethod
    def from_wire(cls, item: Any) -> BatchStats:
        if not (isinstance(item, list) and len(item) == 3):
            raise ProtocolError("statistics: batch statistics are not three durations")
        return cls(*(Duration.from_wire(d) for d in item))


STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
"""The durations of ``VersionStats`` in Triton's ``InferStatistics``, in wire order."""


@dataclass(slots=True)
class VersionStats:
    """One model version's counters (Triton's ``ModelStatistics`` less name and version)."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    """When the last successful batch ended (Unix ms, Redis clock); 0: none yet."""
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=dict)
    """Batch size (rows of one model call) -> the calls of that size."""

    def durations(self) -> tuple[Duration, ...]:
        return tuple(getattr(self, stage) for stage in STAGES)

    def add(self, other: VersionStats) -> None:
        """Add another worker's counters of the same version."""
        self.inference_count += other.inference_count
        self.execution_count += other.execution_count
        self.last_inference_ms = max(self.last_inference_ms, other.last_inference_ms)
        for mine, theirs in zip(self.durations(), other.durations(), strict=True):
            mine.add(theirs)
        for size, batch in other.batches.items():
            self.batches.setdefault(size, BatchStats()).add(batch)

    def wire(self) -> list[Any]:
        return [
            self.inference_count,
            self.execution_count,
            self.last_inference_ms,
            [d.wire() for d in self.durations()],
            [[size, batch.wire()] for size, batch in sorted(self.batches.items())],
        ]

    @classmethod
    def from_wire(cls, item: Any) -> VersionStats:
        if not (isinstance(item, list) and len(item) == 5):
            raise ProtocolError("statistics: version statistics are not a 5-field list")
        inferences, executions, last_ms, durations, batches = item
        if not all(_is_count(v) for v in (inferences, executions, last_ms)):
            raise ProtocolError("statistics: counts must be integers >= 0")
        if not (isinstance(durations, list) and len(durations) == len(STAGES)):
            raise ProtocolError(f"statistics: expected {len(STAGES)} durations")
        if not isinstance(batches, list):
            raise ProtocolError("statistics: batch statistics must be a list")
        by_size: dict[int, BatchStats] = {}
        for entry in batches:
            if not (isinstance(entry, list) and len(entry) == 2 and _is_count(entry[0])):
                raise ProtocolError("statistics: a batch entry is not [size, durations]")
            by_size[entry[0]] = BatchStats.from_wire(entry[1])
        stats = cls(inferences, executions, last_ms, batches=by_size)
        for stage, duration in zip(STAGES, durations, strict=True):
            setattr(stats, stage, Duration.from_wire(duration))
        return stats

    def json(self, name: str, version: str) -> dict[str, Any]:
        """Triton's JSON form (``GET v2/models/{m}/stats``, and the gRPC message's fields)."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                **{stage: getattr(self, stage).json() for stage in STAGES},
                # Answered from the gateway's result cache, a request never reaches a worker:
                # these stay zero (the gateway's own metrics count cache hits).
                "cache_hit": Duration().json(),
                "cache_miss": Duration().json(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.json(),
                    "compute_infer": b.compute_infer.json(),
                    "compute_output": b.compute_output.json(),
                }
                for size, b in sorted(self.batches.items())
            ],
        }


@dataclass(slots=True)
class WorkerStatistics:
    """Everything one worker counted since it started: model -> version -> counters."""

    models: dict[str, dict[str, VersionStats]] = field(default_factory=dict)

    def version(self, model: str, version: str) -> VersionStats:
        """The counters of one version, created empty on first use."""
        versions = self.models.setdefault(model, {})
        stats = versions.get(version)
        if stats is None:
            stats = versions[version] = VersionStats()
        return stats

    def add(self, other: WorkerStatistics) -> None:
        for model, versions in other.models.items():
            for version, stats in versions.items():
                self.version(model, version).add(stats)

    def encode(self) -> bytes:
        return pack(
            [
                {
                    model: {version: stats.wire() for version, stats in versions.items()}
                    for model, versions in self.models.items()
                }
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> WorkerStatistics:
        (models,) = unpack(raw, "worker statistics", 1)
        if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
            raise ProtocolError("worker statistics: not a map of models to versions")
        return cls(
            {
                model: {version: VersionStats.from_wire(s) for version, s in versions.items()}
                for model, versions in models.items()
            }
        )


def summed(raws: list[bytes | None]) -> WorkerStatistics:
    """The sum of the workers' published statistics; a value that does not decode (a worker of
    another release) or is missing (gone since it was listed) adds nothing."""
    total = WorkerStatistics()
    for raw in raws:
        if raw is None:
            continue
        try:
            total.add(WorkerStatistics.decode(raw))
        except ProtocolError:
            continue
    return total


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
