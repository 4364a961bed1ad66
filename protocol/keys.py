"""Every Redis key and stream name inferq uses, under one namespace.

Layout (namespace ``inferq`` by default)::

    {ns}:stream:{model}:{lane}    request stream per model and priority lane (consumer group GROUP)
    {ns}:replies:{gateway}        reply stream of one gateway process (read by its one listener)
    {ns}:result:{request}         result of one request (SET NX with a TTL)
    {ns}:cache:{model}:{version}:{digest}   shared result cache, content-addressed
    {ns}:workers                  zset: worker id -> heartbeat expiry (Redis-clock ms)
    {ns}:worker:{worker}          one worker's advertisement (models it serves), with a TTL
    {ns}:models                   hash: model name -> last published metadata
    {ns}:job:{id}                 async job record (hash, see protocol.jobs), with a TTL
    {ns}:idempotency:{model}:{key}   Idempotency-Key of a job submission -> job id and request
                                  digest (``protocol.jobs``), with a TTL
    {ns}:cancelled:{model}        zset: ids of requests whose callers have gone -> their deadline
                                  (``protocol.cancellation``); workers drop them unrun
    {ns}:jobevents                stream of finished job ids, read by every gateway
    {ns}:dlq:{model}              dead-letter stream per model (undecodable and poison entries)
    {ns}:control                  control stream: model load/commit/abort commands to workers
    {ns}:control:reply:{id}       list: workers' answers to one load command, with a TTL
    {ns}:policies                 hash: model name -> committed version policy (versions, weights)
    {ns}:policy:generation        counter: the last policy generation handed out
    {ns}:modelstatus:{model}      hash: worker id -> what it loaded (or failed to) for the model
    {ns}:lock:model:{model}       held while an admin load or unload of the model is in flight

Model names and versions are validated by the gateway and the model repository before they are
ever used in a key (see ``is_valid_name``), so a name cannot smuggle in a ``:`` or a path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

GROUP = "workers"
"""The one consumer group every worker joins on every request stream."""

JOB_EVENTS_MAXLEN = 100_000
"""Cap of the job events stream: gateways read events as they come, so it only needs to cover a
reconnect (trimmed approximately, ``MAXLEN ~``)."""

DLQ_MAXLEN = 100_000
"""Cap of each dead-letter stream (trimmed approximately)."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def is_valid_name(name: str) -> bool:
    """Model names and versions: letters, digits, ``_``, ``-``, ``.``; no path tricks."""
    return bool(_NAME.fullmatch(name)) and ".." not in name  # fullmatch: "$" allows a "\n"


class Lane(StrEnum):
    """Priority lanes. Workers drain them high first."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @classmethod
    def for_priority(cls, priority: int) -> Lane:
        """Map a V2 ``priority`` (1 highest; 0 or absent is the default) onto a lane.

        1 is high, 0 is normal, 2 and above are low (where async jobs go by default).
        """
        if priority == 1:
            return cls.HIGH
        if priority >= 2:
            return cls.LOW
        return cls.NORMAL


LANES_BY_PRIORITY: tuple[Lane, ...] = (Lane.HIGH, Lane.NORMAL, Lane.LOW)


@dataclass(frozen=True)
class Keys:
    """Builds every key name; one instance per process, from its settings' namespace."""

    namespace: str = "inferq"

    def stream(self, model: str, lane: Lane) -> str:
        return f"{self.namespace}:stream:{model}:{lane.value}"

    def streams(self, model: str) -> list[str]:
        """A model's request streams, highest priority first."""
        return [self.stream(model, lane) for lane in LANES_BY_PRIORITY]

    def parse_stream(self, key: str) -> tuple[str, Lane] | None:
        """The (model, lane) of a request stream key, or None if it is not one."""
        prefix = f"{self.namespace}:stream:"
        if not key.startswith(prefix):
            return None
        model, _, lane = key[len(prefix) :].rpartition(":")
        if not model:
            return None
        try:
            return model, Lane(lane)
        except ValueError:
            return None

    def replies(self, gateway_id: str) -> str:
        return f"{self.namespace}:replies:{gateway_id}"

    def result(self, request_id: str) -> str:
        return f"{self.namespace}:result:{request_id}"

    def cache(self, model: str, version: str, digest: str) -> str:
        return f"{self.namespace}:cache:{model}:{version}:{digest}"

    @property
    def workers(self) -> str:
        return f"{self.namespace}:workers"

    def worker(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    @property
    def models(self) -> str:
        return f"{self.namespace}:models"

    def job(self, job_id: str) -> str:
        return f"{self.namespace}:job:{job_id}"

    def idempotency(self, model: str, key: str) -> str:
        return f"{self.namespace}:idempotency:{model}:{key}"

    def cancelled(self, model: str) -> str:
        return f"{self.namespace}:cancelled:{model}"

    @property
    def job_events(self) -> str:
        return f"{self.namespace}:jobevents"

    def dlq(self, model: str) -> str:
        return f"{self.namespace}:dlq:{model}"

    @property
    def control(self) -> str:
        return f"{self.namespace}:control"

    def control_reply(self, command_id: str) -> str:
        return f"{self.namespace}:control:reply:{command_id}"

    @property
    def policies(self) -> str:
        return f"{self.namespace}:policies"

    @property
    def policy_generation(self) -> str:
        return f"{self.namespace}:policy:generation"

    def model_status(self, model: str) -> str:
        return f"{self.namespace}:modelstatus:{model}"

    def model_lock(self, model: str) -> str:
        return f"{self.namespace}:lock:model:{model}"


def text(value: bytes | str) -> str:
    """A key, field or stream id as Redis returned it (bytes, or str with decoding on)."""
    return value.decode() if isinstance(value, bytes) else value


def next_id(entry_id: str) -> str:
    """The smallest stream id after ``entry_id`` (for XTRIM MINID and exclusive ranges)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def id_before(entry_id: str, other: str) -> bool:
    """Whether stream id ``entry_id`` sorts before ``other``."""
    return _id_tuple(entry_id) < _id_tuple(other)


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
