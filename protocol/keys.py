"""Every Redis key and stream name inferq uses, under one namespace, with its hash tag.

Layout (namespace ``inferq`` by default; ``{...}`` is a Redis Cluster hash tag: keys with the
same tag live in the same slot, so on one master)::

    Data plane: spread over the cluster, one tag per model partition, job or gateway
    {ns}:stream:{<model>}:{lane}      request stream per model and priority lane (group GROUP);
    {ns}:stream:{<model>:<p>}:{lane}  ... of partition p >= 1 of a model with ``partitions = N``
    {ns}:dlq:{<model>}                dead-letter stream per model (undecodable and poison
                                      entries; the slot of partition 0)
    {ns}:replies:{<gateway>}          reply stream of one gateway process (read by its listener)
    {ns}:result:{request}             result of one request (SET NX with a TTL)
    {ns}:cache:{model}:{version}:{digest}   shared result cache, content-addressed
    {ns}:job:{<t>}<id>                async job record (hash, see protocol.jobs), with a TTL;
                                      the tag is part of the job id's random bits (JOB_TAG)
    {ns}:idempotency:{<t>}<model>:<key>   Idempotency-Key -> job id and request digest
                                      (``protocol.jobs``), with a TTL; the same tag as the job
                                      it names (see ``idempotency_tag``)
    {ns}:cancelled:{<model>}          zset: ids of requests whose callers have gone -> their
                                      deadline (``protocol.cancellation``); dropped unrun
    {ns}:jobevents                    events stream: the ids of jobs (and batches) that changed,
                                      read by every gateway, and by the group WEBHOOK_GROUP
    {ns}:webhooks:sent:<kind>:<id>    hash: status -> the events entry that claimed its webhook
                                      delivery (``protocol.webhooks``), with a TTL
    {ns}:webhooks:dlq                 dead-letter stream of webhook deliveries that never got a
                                      2xx (``inferq dlq --webhooks``)
    {ns}:batch:{<id>}                 batch record (hash, ``protocol.batches``), with a TTL; and,
    {ns}:batch:{<id>}:lines|jobs|output|errors|lease   under the same tag, its valid lines
                                      (list), line -> job id, line -> output or error line
                                      (hashes: one answer per line), and who drives it
    {ns}:batches                      zset (score 0, by id): every batch, for listing
    {ns}:batches:active               set: batches not yet final, driven by some gateway

    Control plane: one slot per namespace (a few commands a second; read and written together)
    {ns}:{<ns>}:workers               zset: worker id -> heartbeat expiry (Redis-clock ms)
    {ns}:{<ns>}:worker:{worker}       one worker's advertisement (models it serves and could
                                      load), with a TTL
    {ns}:{<ns>}:workerstats:{worker}  its inference statistics (``protocol.modelstats``), same TTL
    {ns}:{<ns>}:models                hash: model name -> last published metadata
    {ns}:{<ns>}:control               control stream: model load/commit/abort commands to workers
    {ns}:{<ns>}:control:reply:{id}    list: workers' answers to one load command, with a TTL
    {ns}:{<ns>}:policies              hash: model name -> committed version policy
    {ns}:{<ns>}:policy:generation     counter: the last policy generation handed out
    {ns}:{<ns>}:modelstatus:{model}   hash: worker id -> what it loaded (or failed to) for it
    {ns}:{<ns>}:lock:model:{model}    held while an admin load or unload of the model is in flight
    {ns}:{<ns>}:stats                 the elected refresher's snapshot of every stream's backlog
    {ns}:{<ns>}:stats:lease           who refreshes it (SET NX PX)

Why these tags. Redis Cluster runs a multi-key command (XREADGROUP over several streams, MGET,
MULTI, a Lua script with several keys) only when all its keys share a slot, and a tag also puts
all of its keys' load on one master. So a tag groups exactly what one command needs together:
- a model partition's three lanes, so one ``XREADGROUP`` reads all of them, high lane first;
  different models (and partitions) get different tags, so their traffic spreads over the
  masters, and ``partitions = N`` lets one hot model use N of them;
- the dead-letter stream with partition 0, so ``inferq dlq retry`` moves an entry back into a
  request stream in one MULTI;
- a job record with its idempotency key, so a script can create both at once (the request
  stream is elsewhere: on a cluster the enqueue is a second step, see ``producer.jobs``);
- the control plane (registry MGET, the admin commit's MULTI of policy and control stream).
Results and cache entries are read and written one key at a time and carry no tag. A plain
Redis ignores tags: one layout serves both.

Model names and versions are validated by the gateway and the model repository before they are
ever used in a key (see ``is_valid_name``), so a name cannot smuggle in a ``:``, a brace or a
path; a namespace may not contain braces (it would become the hash tag of every key).
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum

GROUP = "workers"
"""The one consumer group every worker joins on every request stream."""

WEBHOOK_GROUP = "webhooks"
"""The consumer group of the events stream whose consumers (gateways) deliver webhooks: each
event is handled by one gateway, and one that dies leaves its pending entries to another."""

JOB_TAG = slice(8, 12)
"""Where a job id (``protocol.jobs.new_job_id``) holds its key's hash tag: characters 8 to 11,
the first three of its random bytes (24 bits: enough tags to spread jobs over every slot). The
characters before them encode the time of issue, which would put a day's jobs in a few slots."""
JOB_TAG_CHARS = JOB_TAG.stop - JOB_TAG.start

MAX_PARTITIONS = 64
"""Most partitions (streams per lane, each on its own slot) one model may have."""

JOB_EVENTS_MAXLEN = 100_000
"""Cap of the job events stream: gateways read events as they come, so it only needs to cover a
reconnect (trimmed approximately, ``MAXLEN ~``)."""

DLQ_MAXLEN = 100_000
"""Cap of each dead-letter stream (trimmed approximately)."""

JOB_INDEX_MAXLEN = 10_000
"""Cap of the job index (``Keys.job_index``, the console's job list): the newest jobs only,
trimmed exactly with each submission (``producer.jobindex``)."""

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


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the text inside the first ``{...}`` when it is
    not empty, else the whole key. Keys with the same hash tag always share a slot."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def idempotency_tag_bytes(model: str, key: str) -> bytes:
    """Three bytes derived from a model and an ``Idempotency-Key``: a job submitted with the key
    starts its random bytes with them, so its id carries ``idempotency_tag`` at ``JOB_TAG``."""
    return hashlib.blake2b(f"{model}\0{key}".encode(), digest_size=3).digest()


def idempotency_tag(model: str, key: str) -> str:
    """The hash tag shared by an ``Idempotency-Key`` and the job it names (JOB_TAG_CHARS URL-safe
    characters)."""
    return base64.urlsafe_b64encode(idempotency_tag_bytes(model, key)).decode()


def job_tag(job_id: str) -> str:
    """The hash tag of a job's record: ``JOB_TAG`` of its id (the whole id if it is shorter)."""
    return job_id[JOB_TAG] if len(job_id) >= JOB_TAG.stop else job_id


@dataclass(frozen=True, slots=True)
class StreamKey:
    """What a request stream's name says: its model, lane and partition."""

    model: str
    lane: Lane
    partition: int = 0


@dataclass(frozen=True)
class Keys:
    """Builds every key name; one instance per process, from its settings' namespace."""

    namespace: str = "inferq"

    def __post_init__(self) -> None:
        if "{" in self.namespace or "}" in self.namespace:
            raise ValueError(
                f"namespace {self.namespace!r} may not contain braces: they would become the "
                "Redis Cluster hash tag of every key"
            )

    # -- data plane ------------------------------------------------------------------------

    @staticmethod
    def partition_tag(model: str, partition: int = 0) -> str:
        """The hash tag of a model partition's streams: the model name, then ``:p`` past 0."""
        return model if partition == 0 else f"{model}:{partition}"

    def stream(self, model: str, lane: Lane, partition: int = 0) -> str:
        return f"{self.namespace}:stream:{{{self.partition_tag(model, partition)}}}:{lane.value}"

    def streams(self, model: str, partition: int = 0) -> list[str]:
        """One partition's request streams, highest priority first (they share a slot)."""
        return [self.stream(model, lane, partition) for lane in LANES_BY_PRIORITY]

    def all_streams(self, model: str, partitions: int = 1) -> list[str]:
        """Every request stream of a model: partition by partition, each highest lane first."""
        return [s for p in range(partitions) for s in self.streams(model, p)]

    def parse_stream_key(self, key: str) -> StreamKey | None:
        """The model, lane and partition of a request stream key, or None if it is not one."""
        prefix = f"{self.namespace}:stream:{{"
        if not key.startswith(prefix):
            return None
        tag, close, lane = key[len(prefix) :].partition("}:")
        if not close or not tag:
            return None
        model, colon, number = tag.partition(":")
        partition = 0
        if colon:
            if not number.isdigit() or number != str(int(number)) or int(number) == 0:
                return None
            partition = int(number)
        if not is_valid_name(model):
            return None
        try:
            return StreamKey(model, Lane(lane), partition)
        except ValueError:
            return None

    def parse_stream(self, key: str) -> tuple[str, Lane] | None:
        """The (model, lane) of a request stream key, or None if it is not one."""
        parsed = self.parse_stream_key(key)
        return None if parsed is None else (parsed.model, parsed.lane)

    def replies(self, gateway_id: str) -> str:
        return f"{self.namespace}:replies:{{{gateway_id}}}"

    @property
    def replies_pattern(self) -> str:
        """A SCAN pattern matching every gateway's reply stream."""
        return _glob_escape(f"{self.namespace}:replies:{{") + "*"

    def result(self, request_id: str) -> str:
        return f"{self.namespace}:result:{request_id}"

    def cache(self, model: str, version: str, digest: str) -> str:
        return f"{self.namespace}:cache:{model}:{version}:{digest}"

    def job(self, job_id: str) -> str:
        return f"{self.namespace}:job:{{{job_tag(job_id)}}}{job_id}"

    def idempotency(self, model: str, key: str) -> str:
        return f"{self.namespace}:idempotency:{{{idempotency_tag(model, key)}}}{model}:{key}"

    def cancelled(self, model: str) -> str:
        return f"{self.namespace}:cancelled:{{{model}}}"

    @property
    def job_events(self) -> str:
        return f"{self.namespace}:jobevents"

    @property
    def job_index(self) -> str:
        """The newest jobs' ids scored by creation time (``producer.jobindex``)."""
        return f"{self.namespace}:jobindex"

    def dlq(self, model: str) -> str:
        return f"{self.namespace}:dlq:{{{model}}}"

    def webhook_sent(self, kind: str, object_id: str) -> str:
        """Which webhook deliveries of one job or batch (``kind``) are claimed, and by whom."""
        return f"{self.namespace}:webhooks:sent:{kind}:{object_id}"

    @property
    def webhook_dlq(self) -> str:
        return f"{self.namespace}:webhooks:dlq"

    def batch(self, batch_id: str, part: str = "") -> str:
        """A batch's record, or one of its parts (``BATCH_PARTS``): one hash tag, so a batch's
        keys live together while its lines' jobs spread over the models' partitions."""
        return f"{self.namespace}:batch:{{{batch_id}}}" + (f":{part}" if part else "")

    @property
    def batches(self) -> str:
        return f"{self.namespace}:batches"

    @property
    def batches_active(self) -> str:
        return f"{self.namespace}:batches:active"

    @property
    def dlq_pattern(self) -> str:
        """A SCAN pattern matching every dead-letter stream (``parse_dlq`` the matches)."""
        return _glob_escape(f"{self.namespace}:dlq:{{") + "*"

    def parse_dlq(self, key: str) -> str | None:
        """The model of a dead-letter stream key, or None if it is not one."""
        prefix = f"{self.namespace}:dlq:{{"
        if not key.startswith(prefix) or not key.endswith("}"):
            return None
        model = key[len(prefix) : -1]
        return model if is_valid_name(model) else None

    # -- control plane (one slot) ----------------------------------------------------------

    @property
    def _control_plane(self) -> str:
        return f"{self.namespace}:{{{self.namespace}}}"

    @property
    def workers(self) -> str:
        return f"{self._control_plane}:workers"

    def worker(self, worker_id: str) -> str:
        return f"{self._control_plane}:worker:{worker_id}"

    def worker_stats(self, worker_id: str) -> str:
        return f"{self._control_plane}:workerstats:{worker_id}"

    @property
    def models(self) -> str:
        return f"{self._control_plane}:models"

    @property
    def control(self) -> str:
        return f"{self._control_plane}:control"

    def control_reply(self, command_id: str) -> str:
        return f"{self._control_plane}:control:reply:{command_id}"

    @property
    def policies(self) -> str:
        return f"{self._control_plane}:policies"

    @property
    def policy_generation(self) -> str:
        return f"{self._control_plane}:policy:generation"

    def model_status(self, model: str) -> str:
        return f"{self._control_plane}:modelstatus:{model}"

    def model_lock(self, model: str) -> str:
        return f"{self._control_plane}:lock:model:{model}"

    @property
    def demand(self) -> str:
        """Demand hints for on-demand workers (``protocol.demand``)."""
        return f"{self._control_plane}:demand"

    def load_claim(self, model: str) -> str:
        """Held (``SET NX PX``) by the on-demand worker loading the model, then for the
        load-after interval: one worker at a time adds capacity for it (``consumer.ondemand``)."""
        return f"{self._control_plane}:loadclaim:{model}"

    @property
    def stats(self) -> str:
        return f"{self._control_plane}:stats"

    @property
    def stats_lease(self) -> str:
        return f"{self._control_plane}:stats:lease"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


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
