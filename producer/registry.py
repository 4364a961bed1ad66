"""What the gateway knows about models: read from the workers' advertisements in Redis.

Refreshed on a schedule (one ``ZRANGEBYSCORE`` of live workers and one ``MGET`` of their
advertisements; also Redis's ``maxmemory-policy``, see ``runtime.eviction``), never per
request. A model is *known* if any worker ever published it (the ``models`` hash), and
*available* while at least one live worker serves it. The live workers also advertise what
their repositories hold (``repository``: every model a load call may name, loaded or not, with
its version folders or why its config does not load), which is how a load finds a model folder
added after the workers started.

Each model's backlog (admission control) comes from the snapshot one elected gateway publishes
(``runtime.stats``), read in the same round trip: its cost does not grow with the number of
gateways. Only while no fresh snapshot exists does a refresh read it itself (``runtime.lag``'s
``collect`` without detail: ``XLEN`` and ``XINFO GROUPS`` of every stream).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import redis.asyncio as aioredis
import structlog

from protocol import ProtocolError
from protocol.control import LoadReport, VersionPolicy, version_order
from protocol.envelope import decode_hash
from protocol.keys import LANES_BY_PRIORITY, Keys, Lane
from protocol.registry import ModelMetadata, RepositoryModel, WorkerInfo
from protocol.stats import StatsSnapshot
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.connections import RedisClock
from runtime.eviction import EvictionCheck
from runtime.faults import RETRYABLE
from runtime.lag import LagError, collect
from runtime.stats import STALE_AFTER_INTERVALS, decode_snapshot

log = structlog.get_logger("inferq.gateway")

_BACKLOG_ERRORS: tuple[type[BaseException], ...] = (*RETRYABLE, LagError)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    metadata: ModelMetadata
    workers: int
    """Live workers serving this model."""
    traffic: dict[str, float] = field(default_factory=dict)
    """Version -> share of requests that name no version (what the gateway routes by)."""
    policy: VersionPolicy | None = None
    """The committed admin policy, if any (None: the repository config decides)."""
    fallback: bool = False
    """Every live worker serving the model could not serve the committed policy (a version it
    names has no folder, or does not load) and serves the repository config's versions: the
    gateway routes by what they serve, not by the stale policy."""
    loadable: int = 0
    """Live on-demand workers (``--load on-demand``) that load it when requests for it wait:
    with none serving it, a request is queued and waits for a load within its deadline."""

    @property
    def unloaded(self) -> bool:
        return self.policy is not None and not self.policy.loaded

    @property
    def ready(self) -> bool:
        """A live worker serves a version of it: requests for it are routed."""
        return self.workers > 0 and not self.unloaded and bool(self.metadata.versions)

    @property
    def state(self) -> str:
        """``ready`` (a live worker serves it), ``loadable`` (none does, an on-demand worker
        loads it when a request arrives), ``unloaded`` (an administrator unloaded it) or
        ``unavailable`` (no live worker serves or may load it)."""
        if self.unloaded:
            return "unloaded"
        if self.ready:
            return "ready"
        return "loadable" if self.loadable else "unavailable"


@dataclass(frozen=True, slots=True)
class RepositoryEntry:
    """A model that some live worker's repository holds, loaded or not (``RepositoryModel``s
    of the advertisements, merged)."""

    name: str
    versions: tuple[str, ...]
    """Version folders, the union over the workers, oldest first."""
    metadata: ModelMetadata | None
    """As its config would serve it (from the newest worker that can load it)."""
    workers: tuple[str, ...]
    """The live workers a load of it goes to."""
    errors: dict[str, str] = field(default_factory=dict)
    """Worker -> why its config does not load there."""


def repository_view(workers: list[WorkerInfo]) -> dict[str, RepositoryEntry]:
    """Every model the live workers' repositories hold, merged across the workers."""
    found: dict[str, list[tuple[WorkerInfo, RepositoryModel]]] = {}
    for w in workers:
        for model in w.repository:
            found.setdefault(model.name, []).append((w, model))
    view: dict[str, RepositoryEntry] = {}
    for name, held in found.items():
        loadable = [(w, m) for w, m in held if m.metadata is not None]
        newest = max(loadable, key=lambda wm: wm[0].started_ms, default=None)
        versions = {v for _, m in held for v in m.versions}
        view[name] = RepositoryEntry(
            name,
            tuple(sorted(versions, key=version_order)),
            None if newest is None else newest[1].metadata,
            tuple(sorted(w.id for w, _ in held)),
            {w.id: m.error for w, m in held if m.error},
        )
    return view


def merge(
    workers: list[WorkerInfo],
    known: dict[str, ModelMetadata],
    policies: dict[str, VersionPolicy] | None = None,
) -> dict[str, ModelEntry]:
    """Combine advertisements: versions are the union across live workers, the rest of the
    metadata comes from the most recently started worker (the newest rollout wins). A committed
    policy narrows the versions to those it names and sets the traffic split."""
    policies = policies or {}
    entries: dict[str, ModelEntry] = {
        name: _entry(meta, 0, set(meta.versions), policies.get(name))
        for name, meta in known.items()
    }
    newest: dict[str, tuple[int, ModelMetadata, set[str], int]] = {}
    fell_back: dict[str, int] = {}
    for w in workers:
        for m in w.models:
            started, meta, versions, count = newest.get(m.name, (-1, m, set(), 0))
            versions = versions | set(m.versions)
            if w.started_ms >= started:
                started, meta = w.started_ms, m
            newest[m.name] = (started, meta, versions, count + 1)
            policy = policies.get(m.name)
            if policy is not None and w.fallbacks.get(m.name, -1) >= policy.generation:
                fell_back[m.name] = fell_back.get(m.name, 0) + 1
    for name, (_, meta, versions, count) in newest.items():
        # Every worker serving it fell back from the policy: route by what they serve.
        fallback = fell_back.get(name, 0) == count
        entries[name] = _entry(meta, count, versions, policies.get(name), fallback=fallback)
    return _with_loadable(entries, workers, policies)


def _with_loadable(
    entries: dict[str, ModelEntry], workers: list[WorkerInfo], policies: dict[str, VersionPolicy]
) -> dict[str, ModelEntry]:
    """Count, per model, the live on-demand workers that would load it; a model only they
    can serve is described from their repository's metadata (none has loaded it yet)."""
    loadable: dict[str, int] = {}
    described: dict[str, tuple[int, ModelMetadata]] = {}
    for w in workers:
        if not w.on_demand:
            continue
        for r in w.repository:
            if r.metadata is None:
                continue
            loadable[r.name] = loadable.get(r.name, 0) + 1
            if w.started_ms >= described.get(r.name, (-1, r.metadata))[0]:
                described[r.name] = (w.started_ms, r.metadata)
    for name, count in loadable.items():
        entry = entries.get(name)
        if entry is None:
            meta = described[name][1]
            entry = _entry(meta, 0, set(meta.versions), policies.get(name))
        entries[name] = replace(entry, loadable=count)
    return entries


def _entry(
    meta: ModelMetadata,
    workers: int,
    versions: set[str],
    policy: VersionPolicy | None,
    *,
    fallback: bool = False,
) -> ModelEntry:
    if policy is not None and not fallback:
        # Versions the policy names, whether or not a worker advertises them yet: a worker that
        # restarts mid-swap must not make the gateway route around the committed policy.
        versions = set(policy.versions)
        split = policy.traffic()
    else:
        split = VersionPolicy(
            tuple(sorted(versions, key=version_order)),
            {v: w for v, w in meta.weights.items() if v in versions}
            if any(meta.weights.get(v, 0) > 0 for v in versions)
            else {},
        ).traffic()
    ordered = tuple(sorted(versions, key=version_order))
    default = max(ordered, key=lambda v: (split.get(v, 0.0), version_order(v)), default="")
    merged = replace(meta, versions=ordered, default_version=default)
    traffic = {v: w for v, w in split.items() if w > 0}
    return ModelEntry(merged, workers, traffic, policy, fallback=fallback and policy is not None)


class ModelRegistry:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        clock: RedisClock,
        *,
        refresh_s: float,
        eviction: EvictionCheck | None = None,
        backoff: Backoff | None = None,
        workers_on_demand: bool = False,
    ) -> None:
        self.workers_on_demand = workers_on_demand
        """``--workers-on-demand``: a scaler starts workers on the backlog (see
        ``on_demand``)."""
        self._redis = redis
        self._eviction = eviction
        self._backoff = backoff or Backoff("registry", log)
        self._keys = keys
        self._clock = clock
        self._refresh_s = refresh_s
        self.models: dict[str, ModelEntry] = {}
        self.repository: dict[str, RepositoryEntry] = {}
        """What the live workers' repositories hold, as of the last refresh."""
        self.redis_ok = False
        self._last_refresh = 0.0
        self._refreshing: asyncio.Lock = asyncio.Lock()
        self._workers: list[WorkerInfo] = []
        self._known: dict[str, ModelMetadata] = {}
        self._policies: dict[str, VersionPolicy] = {}
        self._backlog: dict[tuple[str, Lane], int] = {}
        self._queued_since: dict[str, deque[int]] = {}
        """Per model, when (Redis clock) this gateway queued each request not yet counted by
        the backlog it last took (the snapshot may be older than the refresh that read it)."""
        self.stats: StatsSnapshot | None = None
        """The backlog snapshot the elected gateway publishes (``runtime.stats``), as of the
        last refresh; None when there is none or it is stale."""

    def backlog(self, model: str, through: Lane = Lane.LOW) -> int:
        """Requests queued for the model in ``through``'s lane and the lanes above it, not yet
        read by any worker: the consumer group's lag at the last refresh, plus what this
        gateway queued since."""
        lanes = LANES_BY_PRIORITY[: LANES_BY_PRIORITY.index(through) + 1]
        since = len(self._queued_since.get(model, ()))
        return sum(self._backlog.get((model, lane), 0) for lane in lanes) + since

    async def apply_policy(self, model: str, policy: VersionPolicy | None) -> None:
        """A policy this gateway just committed (None: the model's policy was deleted, its
        repository config decides): route by it now, not at the next refresh.

        After any refresh in flight: one that read the policies before the commit would
        otherwise put the old one back when it ends (a request sent right after an unload was
        then routed, and answered from the cache, by the version just unloaded). A refresh
        that starts later reads the committed policy from Redis."""
        async with self._refreshing:
            self._apply_policy(model, policy)

    def _apply_policy(self, model: str, policy: VersionPolicy | None) -> None:
        if policy is None:
            self._policies = {k: v for k, v in self._policies.items() if k != model}
        elif policy.generation >= getattr(self._policies.get(model), "generation", -1):
            self._policies = {**self._policies, model: policy}
        else:
            return
        self.models = merge(self._workers, self._known, self._policies)

    def live_worker_infos(self) -> list[WorkerInfo]:
        """The live workers' advertisements as of the last refresh."""
        return self._workers

    def note_queued(self, model: str) -> None:
        self._queued_since.setdefault(model, deque()).append(self._clock.now_ms())

    @property
    def live_workers(self) -> int:
        """Live workers of the model served by most; a model unloaded by an administrator (or
        left with no version) does not count: nothing can be routed to it."""
        return max((e.workers for e in self.models.values() if e.ready), default=0)

    def on_demand(self, entry: ModelEntry) -> bool:
        """Whether a request for a model that no live worker serves is queued anyway, to wait
        within its deadline: an on-demand worker can load it (``entry.loadable``), or a scaler
        starts workers on the backlog (``--workers-on-demand``). The one hook by which the
        gateway treats such a model as servable. Not for a model an administrator unloaded."""
        if entry.unloaded:
            return False
        return entry.loadable > 0 or (self.workers_on_demand and bool(entry.metadata.versions))

    def not_serving(self) -> str | None:
        """Why no request can be served (readiness' reason), or None when some model is
        ready, or servable on demand (``on_demand``)."""
        if any(e.ready or self.on_demand(e) for e in self.models.values()):
            return None
        unloaded = sorted(name for name, e in self.models.items() if e.unloaded and e.workers)
        if unloaded:
            return (
                f"every served model is unloaded ({', '.join(unloaded)}): "
                "POST /v2/repository/models/{model}/load loads one"
            )
        if self.repository:
            return (
                "no model is loaded; the workers' repositories hold "
                f"{', '.join(sorted(self.repository))} (POST /v2/repository/models/{{model}}"
                "/load loads one)"
            )
        return "no live worker serves any model"

    async def refresh(self) -> None:
        async with self._refreshing:
            try:
                ids = cast(
                    list[bytes],
                    await self._redis.zrangebyscore(
                        self._keys.workers, self._clock.now_ms(), "+inf"
                    ),
                )
                pipe = self._redis.pipeline(transaction=False)
                queue_snapshot(pipe, self._keys, ids)
                pipe.get(self._keys.stats)
                replies = await pipe.execute()
                if self._eviction is not None:
                    await self._eviction.refresh(self._redis)
            except RETRYABLE as e:
                self._backoff.record(e)
                self.redis_ok = False
                return
            self._backoff.succeeded()
            self.redis_ok = True
            self._last_refresh = time.monotonic()
            workers, known, policies = parse_snapshot(ids, replies[:-1])
            # Models are never removed from the models hash, so one gone from it was lost with
            # Redis's data (evicted, or a restart): still known here, served once workers are.
            known = {**self._known, **known}
            self._workers, self._known, self._policies = workers, known, policies
            self.models = merge(workers, known, policies)
            self.repository = repository_view(workers)
            stats = decode_snapshot(replies[-1])
            if stats is not None and stats.fresh(self._clock.now_ms(), self._stale_after_ms):
                self.accept_stats(stats)
            else:
                # Nobody publishes (this gateway is starting, or the refresher just moved):
                # ask Redis directly, as every gateway once did each refresh.
                self.stats = None
                self._counted_until(self._clock.now_ms())
                await self._refresh_backlog()

    @property
    def _stale_after_ms(self) -> int:
        return int(self._refresh_s * 1000 * STALE_AFTER_INTERVALS)

    def _counted_until(self, sampled_ms: int) -> None:
        """Requests this gateway queued up to ``sampled_ms`` are in the backlog now."""
        for queued in self._queued_since.values():
            while queued and queued[0] <= sampled_ms:
                queued.popleft()

    def accept_stats(self, stats: StatsSnapshot) -> None:
        """Take the backlog from a published snapshot (read at a refresh, or just published
        by this gateway's own refresher)."""
        backlog: dict[tuple[str, Lane], int] = {}
        for row in stats.lanes:
            try:
                key = (row.model, Lane(row.lane))
            except ValueError:
                continue
            backlog[key] = backlog.get(key, 0) + row.lag
        self.stats = stats
        self._backlog = backlog
        self._counted_until(stats.sampled_ms)

    async def _refresh_backlog(self) -> None:
        models = {name: entry.metadata.partitions for name, entry in self.models.items()}
        try:
            backlog = await collect(
                self._redis, self._keys, self._clock.now_ms, models=models, detail=False
            )
        except _BACKLOG_ERRORS:
            return
        by_lane = backlog.by(lambda r: (r.model, r.lane))
        self._backlog = {key: totals.lag for key, totals in by_lane.items()}

    async def run(self) -> None:
        """Refresh every ``refresh_s``. A failed refresh keeps what was known, reports the
        failure to readiness and is retried at the next tick (errors never end the loop)."""
        while not cancelling():
            await asyncio.sleep(self._refresh_s)
            await self.refresh()

    async def lookup(self, name: str) -> ModelEntry | None:
        """The model's entry; an unknown name triggers one early refresh (rate-limited), so a
        worker that just started is found without waiting for the schedule."""
        entry = self.models.get(name)
        if (entry is None or entry.workers == 0) and time.monotonic() - self._last_refresh > 0.2:
            await self.refresh()
            entry = self.models.get(name)
        return entry


def queue_snapshot(pipe: Any, keys: Keys, ids: list[bytes]) -> None:
    """Queue, on a pipeline (sync or asyncio), the reads ``parse_snapshot`` takes: the live
    workers' advertisements (``ids`` from ZRANGEBYSCORE of ``keys.workers``), the committed
    policies and the last-known metadata."""
    if ids:
        # execute_command: redis-py refuses pipe.mget on a cluster, though these keys share the
        # control plane's slot (see protocol.keys), which is all MGET needs there.
        pipe.execute_command("MGET", *(keys.worker(i.decode()) for i in ids))
    pipe.hgetall(keys.policies)
    pipe.hgetall(keys.models)


def parse_snapshot(
    ids: list[bytes], replies: list[Any]
) -> tuple[list[WorkerInfo], dict[str, ModelMetadata], dict[str, VersionPolicy]]:
    """The replies of ``queue_snapshot`` decoded: live workers, known models, policies. What
    does not decode is logged and left out."""
    workers = [w for raw in (replies[0] if ids else []) if raw and (w := _worker(raw))]
    policies = decode_hash(replies[-2], VersionPolicy.decode, _ignored("version policy"))
    known = decode_hash(replies[-1], ModelMetadata.decode, _ignored("model metadata"))
    return workers, known, policies


def status_lines(
    raw: dict[bytes, bytes], model: str, workers: list[WorkerInfo]
) -> list[LoadReport]:
    """A model's status hash (HGETALL of ``keys.model_status``), decoded: the lines of the live
    workers that serve it or may load it (a worker that has gone left a stale one)."""
    serving = {w.id for w in workers if w.holds(model)}
    lines = decode_hash(raw, LoadReport.decode)
    return [lines[w] for w in sorted(lines) if w in serving]


def _ignored(what: str) -> Callable[[str, ProtocolError], None]:
    def warn(name: str, error: ProtocolError) -> None:
        log.warning(f"ignoring a {what}", name=name, error=str(error))

    return warn


def _worker(raw: bytes) -> WorkerInfo | None:
    try:
        return WorkerInfo.decode(raw)
    except ProtocolError as e:
        log.warning("ignoring a worker advertisement", error=str(e))
        return None
