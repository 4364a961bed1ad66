"""Request and result messages, each with exactly one encoder and one decoder.

A message is a msgpack array whose first element is the protocol version; fields follow in the
order of the dataclass. Positional arrays keep messages small and make the dataclass the only
place a field is named. Stream entries carry the encoded message in the single field ``m``.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from protocol.envelope import pack, unpack
from protocol.errors import ProtocolError
from protocol.tensor import Tensor

FIELD = b"m"
"""The one field of every request and reply stream entry inferq writes."""

JOB_EVENT_FIELD = b"job"
"""The field of a job events entry (``Keys.job_events``): the id of the job that changed."""

EVENT_STATUS_FIELD = b"status"
"""Beside the id in an events entry, where the writer knows it: the status the object moved to
(event streams and webhooks use it to replay each state in order; an entry without it means
"re-read the object")."""

KEEPALIVE_FIELD = b"keepalive"
"""The field of the entry a gateway writes to keep its own reply stream alive (no payload)."""


class Kind(StrEnum):
    INFER = "infer"
    """Submit-and-wait: the caller waits on its reply stream."""
    JOB = "job"
    """Fire-and-forget: the caller polls the job record."""


class Status(StrEnum):
    OK = "ok"
    EXPIRED = "expired"
    """The deadline passed before a worker ran the request; the model never saw it."""
    INVALID = "invalid"
    """The model rejected the input (a client error the gateway could not see)."""
    FAILED = "failed"
    """The model or the worker failed."""


def _typed(value: Any, types: type | tuple[type, ...], what: str, name: str) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ProtocolError(f"{what}: field '{name}' has the wrong type ({type(value).__name__})")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _tensors(value: Any, what: str, name: str) -> list[Tensor]:
    return [Tensor.from_wire(t) for t in _typed(value, list, what, name)]


def _names(value: Any, what: str, name: str) -> list[str] | None:
    if value is None:
        return None
    items = _typed(value, list, what, name)
    if not all(isinstance(n, str) for n in items):
        raise ProtocolError(f"{what}: field '{name}' must be a list of strings")
    return list(items)


@dataclass(frozen=True, slots=True)
class InferRequest:
    """One inference request as queued on a model's stream."""

    id: str
    """Unique request id chosen by the gateway: a random 64-bit prefix per gateway process and a
    counter (unique, not secret: it routes the reply and is never shown to clients). Job ids
    are 128 random bits (``producer.jobs``), since a job id is its own access token."""
    model: str
    version: str
    inputs: list[Tensor]
    outputs: list[str] | None
    """Requested output names; None means all of the model's outputs."""
    deadline_ms: int
    """Absolute deadline on the Redis server's clock (see ``protocol.deadline``)."""
    enqueued_ms: int
    """When the gateway queued it, on the Redis server's clock."""
    result_key: str
    """Where the worker writes the result (``SET NX``): a cache key, always written; or the
    per-request key ``Keys.result(id)``, which with a ``reply_to`` only backs up the reply and is
    written only when the reply stream is missing (the reply carries the same bytes)."""
    result_ttl_ms: int
    reply_to: str | None = None
    """The gateway's reply stream; None for async jobs, which are polled."""
    kind: Kind = Kind.INFER
    priority: int = 0
    client_id: str | None = None
    """The ``id`` the client sent, echoed in the response."""
    traceparent: str | None = None
    """W3C trace context, so logs on both sides join up."""

    def encode(self) -> bytes:
        return pack(
            [
                self.id,
                self.model,
                self.version,
                [t.wire() for t in self.inputs],
                self.outputs,
                self.deadline_ms,
                self.enqueued_ms,
                self.result_key,
                self.result_ttl_ms,
                self.reply_to,
                self.kind.value,
                self.priority,
                self.client_id,
                self.traceparent,
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> InferRequest:
        what = "inference request"
        f = unpack(raw, what, 14)
        try:
            kind = Kind(f[10])
        except ValueError as e:
            raise ProtocolError(f"{what}: unknown kind {reprlib.repr(f[10])}") from e
        return cls(
            id=_typed(f[0], str, what, "id"),
            model=_typed(f[1], str, what, "model"),
            version=_typed(f[2], str, what, "version"),
            inputs=_tensors(f[3], what, "inputs"),
            outputs=_names(f[4], what, "outputs"),
            deadline_ms=_typed(f[5], int, what, "deadline_ms"),
            enqueued_ms=_typed(f[6], int, what, "enqueued_ms"),
            result_key=_typed(f[7], str, what, "result_key"),
            result_ttl_ms=_typed(f[8], int, what, "result_ttl_ms"),
            reply_to=_typed(f[9], (str, type(None)), what, "reply_to"),
            kind=kind,
            priority=_typed(f[11], int, what, "priority"),
            client_id=_typed(f[12], (str, type(None)), what, "client_id"),
            traceparent=_typed(f[13], (str, type(None)), what, "traceparent"),
        )


@dataclass(frozen=True, slots=True)
class Timings:
    """Where a request's time went on the worker, in milliseconds."""

    queued_ms: float = 0.0
    """Enqueue (gateway) to dequeue (worker)."""
    batch_wait_ms: float = 0.0
    """Dequeue to the start of the model call."""
    infer_ms: float = 0.0
    """The model call for the whole batch."""
    batch_size: int = 0
    """Requests in the batch this one ran in."""


@dataclass(frozen=True, slots=True)
class InferResult:
    """The outcome of one request, written to its result key and its caller's reply stream."""

    id: str
    status: Status
    model: str
    version: str
    outputs: list[Tensor] = field(default_factory=list)
    error: str | None = None
    worker: str = ""
    timings: Timings = field(default_factory=Timings)

    def encode(self) -> bytes:
        t = self.timings
        return pack(
            [
                self.id,
                self.status.value,
                self.model,
                self.version,
                [o.wire() for o in self.outputs],
                self.error,
                self.worker,
                [t.queued_ms, t.batch_wait_ms, t.infer_ms, t.batch_size],
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> InferResult:
        what = "inference result"
        f = unpack(raw, what, 8)
        try:
            status = Status(f[1])
        except ValueError as e:
            raise ProtocolError(f"{what}: unknown status {reprlib.repr(f[1])}") from e
        timings = _typed(f[7], list, what, "timings")
        if (
            len(timings) != 4
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in timings)
            or type(timings[3]) is not int
        ):
            raise ProtocolError(f"{what}: timings must be three numbers and an integer")
        return cls(
            id=_typed(f[0], str, what, "id"),
            status=status,
            model=_typed(f[2], str, what, "model"),
            version=_typed(f[3], str, what, "version"),
            outputs=_tensors(f[4], what, "outputs"),
            error=_typed(f[5], (str, type(None)), what, "error"),
            worker=_typed(f[6], str, what, "worker"),
            timings=Timings(
                float(timings[0]), float(timings[1]), float(timings[2]), int(timings[3])
            ),
        )


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One entry of a model's dead-letter stream (``Keys.dlq``): the request as it was queued,
    where it came from, and why it was not run."""

    stream: str
    """The request stream it was read from (where ``inferq dlq retry`` puts it back)."""
    entry_id: str
    reason: str
    payload: bytes
    """The entry's original ``FIELD`` value, decodable or not."""

    def to_fields(self) -> dict[bytes, str | bytes]:
        return {
            b"stream": self.stream,
            b"id": self.entry_id,
            b"reason": self.reason,
            FIELD: self.payload,
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> DeadLetter:
        return cls(
            stream=fields.get(b"stream", b"").decode(errors="replace"),
            entry_id=fields.get(b"id", b"").decode(errors="replace"),
            reason=fields.get(b"reason", b"").decode(errors="replace"),
            payload=fields.get(FIELD, b""),
        )
