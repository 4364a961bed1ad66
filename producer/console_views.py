"""What the operator console shows: each view as a JSON document, built from what the gateway
already holds in memory wherever it can (the model registry, the published backlog snapshot,
the eviction policy), and from Redis where it must (the workers' statistics and heartbeats, the
job index, dead letters).

Every view is cached for ``CACHE_S`` per gateway: five browsers refreshing every few seconds
cost what one does. A view that needs Redis while it is down raises ``RETRYABLE``: the route
answers 503 with a message and the page shows it as a banner over the last data it had.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from redis.exceptions import ResponseError

from producer import console_rates as rates
from producer import jobindex
from producer.gateway import Gateway
from producer.jobs import document, watched_state
from protocol import ProtocolError
from protocol.control import version_order
from protocol.jobs import JobStatus
from protocol.keys import GROUP, Lane, text
from protocol.messages import FIELD, InferRequest
from protocol.modelstats import WorkerStatistics, summed
from runtime import deadletters
from runtime.eviction import is_evicting, warning
from runtime.lag import Backlog, DrainEstimator, collect
from runtime.stats import to_backlog

CACHE_S = 1.0
"""How long one view's document is reused (per gateway, whoever asks)."""
RATE_INTERVAL_S = 2.0
"""Rates compare readings at least this far apart."""
GONE_SHOWN_MS = 120_000
"""Workers whose heartbeat expired this recently are listed as gone."""
DLQ_SHOWN = 50
"""Newest dead letters listed per model."""
PREVIEW_CHARS = 400


class ConsoleViews:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self._drains = DrainEstimator()
        self._drained: dict[tuple[str, Lane, int], Any] = {}
        self._last_sample: int | None = None
        self._rates = rates.Rates()
        self._worker_rates: dict[str, tuple[float, int]] = {}
        self._batches_per_s: dict[str, float] = {}

    async def cached(self, name: str, build: Callable[[], Awaitable[dict[str, Any]]]) -> Any:
        hit = self._cache.get(name)
        now = time.monotonic()
        if hit is not None and now - hit[0] < CACHE_S:
            return hit[1]
        doc = await build()
        self._cache[name] = (now, doc)
        return doc

    def forget(self, name: str) -> None:
        """Drop a cached view (after an action changed what it shows)."""
        self._cache.pop(name, None)

    # -- overview ------------------------------------------------------------------------

    async def _backlog(self) -> Backlog:
        g = self._gateway
        if g.registry.stats is not None:
            return to_backlog(g.registry.stats, g.keys)
        models = {n: e.metadata.partitions for n, e in g.registry.models.items()}
        return await collect(g.redis, g.keys, g.clock.now_ms, models=models)

    async def _worker_stats(self) -> tuple[list[str], list[bytes | None]]:
        workers = [w.id for w in self._gateway.registry.live_worker_infos()]
        if not workers:
            return workers, []
        keys = [self._gateway.keys.worker_stats(w) for w in workers]
        return workers, cast(list[bytes | None], await self._gateway.redis.mget(keys))

    def _note_worker_batches(self, workers: list[str], raws: list[bytes | None]) -> None:
        now = time.monotonic()
        for worker, raw in zip(workers, raws, strict=True):
            total = sum(
                v.execution_count
                for versions in summed([raw]).models.values()
                for v in versions.values()
            )
            before = self._worker_rates.get(worker)
            if before is None or now - before[0] >= RATE_INTERVAL_S:
                if before is not None and total >= before[1]:
                    self._batches_per_s[worker] = round((total - before[1]) / (now - before[0]), 2)
                self._worker_rates[worker] = (now, total)

    async def overview(self) -> dict[str, Any]:
        g = self._gateway
        backlog = await self._backlog()
        if backlog.sampled_ms != self._last_sample:
            self._last_sample = backlog.sampled_ms
            self._drained = self._drains.update(backlog.lanes)
        workers, raws = await self._worker_stats()
        self._note_worker_batches(workers, raws)
        stats: WorkerStatistics = summed(raws)
        counts = rates.merged(
            rates.from_workers(stats), rates.from_histogram(g.metrics.request_duration)
        )
        self._rates.update(time.monotonic(), counts, RATE_INTERVAL_S)
        totals = backlog.by_model()
        names = sorted(set(g.registry.models) | set(totals))
        models = []
        for name in names:
            entry = g.registry.models.get(name)
            versions = sorted(entry.metadata.versions, key=version_order) if entry else []
            total = totals.get(name)
            models.append(
                {
                    "name": name,
                    "ready": bool(entry and entry.ready),
                    "workers": entry.workers if entry else 0,
                    "versions": [
                        {
                            "version": v,
                            "share": entry.traffic.get(v, 0.0) if entry else 0.0,
                            **self._rates.of((name, v)),
                        }
                        for v in versions
                    ],
                    "backlog": None
                    if total is None
                    else {
                        "backlog": total.backlog,
                        "lag": total.lag,
                        "pending": total.pending,
                        "consumers": total.consumers,
                        "oldest_pending_ms": total.oldest_pending_ms,
                    },
                    "dead_letters": backlog.dead_letters.get(name, 0),
                    "lanes": [
                        {
                            "lane": r.lane.value,
                            "partition": r.partition,
                            "length": r.length,
                            "lag": r.lag,
                            "pending": r.pending,
                            "backlog": r.backlog,
                            "consumers": r.consumers,
                            "oldest_pending_ms": r.oldest_pending_ms,
                        }
                        for r in backlog.lanes
                        if r.model == name
                    ],
                }
            )
        return {
            "sampled_ms": backlog.sampled_ms,
            "snapshot": g.registry.stats is not None,
            "models": models,
            "warnings": self.warnings(backlog),
        }

    def warnings(self, backlog: Backlog) -> list[str]:
        """What ``inferq lag`` warns of, and what it shows as stalled or growing: an evicting
        Redis, a backlog no live worker reads, lanes whose backlog does not drain."""
        out = []
        policy = self._gateway.eviction.policy
        if policy and is_evicting(policy):
            out.append(warning(policy))
        for name, total in backlog.by_model().items():
            if total.backlog and not total.consumers:
                out.append(
                    f"model {name}: backlog {total.backlog} and no live consumer reads it "
                    "(start a worker serving it, or look at the workers view)"
                )
        for (name, lane, partition), drain in sorted(self._drained.items()):
            row = next(
                (
                    r
                    for r in backlog.lanes
                    if (r.model, r.lane, r.partition) == (name, lane, partition)
                ),
                None,
            )
            if row is None or not row.backlog or drain.eta_s is not None:
                continue
            how = "stalled" if drain.read_per_s == 0 else "growing"
            out.append(
                f"model {name} lane {lane.value}"
                + (f" partition {partition}" if partition else "")
                + f": backlog {how} ({row.backlog} waiting, {drain.arrival_per_s:.1f}/s in, "
                f"{drain.read_per_s:.1f}/s read)"
            )
        return out

    # -- workers -------------------------------------------------------------------------

    async def workers(self) -> dict[str, Any]:
        g = self._gateway
        now = g.clock.now_ms()
        scored = cast(
            list[tuple[bytes, float]],
            await g.redis.zrangebyscore(
                g.keys.workers, now - GONE_SHOWN_MS, "+inf", withscores=True
            ),
        )
        expiry = {text(w): int(score) for w, score in scored}
        live = {w.id: w for w in g.registry.live_worker_infos()}
        workers, raws = await self._worker_stats()
        self._note_worker_batches(workers, raws)
        in_flight = await self._in_flight()
        rows = []
        for worker_id in sorted(set(expiry) | set(live)):
            info = live.get(worker_id)
            expires_in = expiry.get(worker_id, now) - now
            rows.append(
                {
                    "id": worker_id,
                    "live": info is not None and expires_in > 0,
                    "host": info.host if info else None,
                    "pid": info.pid if info else None,
                    "started_ms": info.started_ms if info else None,
                    "heartbeat_expires_in_ms": expires_in,
                    "models": [{"name": m.name, "versions": list(m.versions)} for m in info.models]
                    if info
                    else [],
                    "batches_per_s": self._batches_per_s.get(worker_id),
                    "in_flight": in_flight.get(worker_id, 0),
                    # 0: a worker of a release that does not say, or no /proc to read.
                    "resident_bytes": (info.resident_bytes or None) if info else None,
                    "restarts": info.restarts if info else None,
                }
            )
        return {"now_ms": now, "workers": rows}

    async def _in_flight(self) -> dict[str, int]:
        """Worker -> entries it has read and not yet acknowledged, over every stream of every
        served model (``XINFO CONSUMERS``: one pipeline; a consumer is named by its worker)."""
        g = self._gateway
        streams = [
            stream
            for name, entry in g.registry.models.items()
            for p in range(entry.metadata.partitions)
            for stream in g.keys.streams(name, p)
        ]
        if not streams:
            return {}
        pipe = g.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_consumers(stream, GROUP)
        out: dict[str, int] = {}
        for reply in await pipe.execute(raise_on_error=False):
            if isinstance(reply, ResponseError):
                continue  # no stream or no group yet
            if isinstance(reply, Exception):
                raise reply
            for consumer in reply:
                worker = text(consumer["name"])
                out[worker] = out.get(worker, 0) + int(consumer.get("pending") or 0)
        return out

    # -- jobs ----------------------------------------------------------------------------

    async def jobs(
        self,
        *,
        limit: int,
        model: str | None,
        status: JobStatus | None,
        cursor: jobindex.Cursor | None,
    ) -> dict[str, Any]:
        g = self._gateway
        page = await jobindex.page(
            g.redis, g.keys, limit=limit, model=model, status=status, cursor=cursor
        )
        return {
            "jobs": page.rows,
            "cursor": page.cursor,
            "scanned": page.scanned,
            "indexed": page.indexed,
        }

    async def job(self, job_id: str) -> dict[str, Any]:
        """The job's document (result or error), its record's times, and the states it went
        through (as its event stream tells them)."""
        record = await self._gateway.jobs.get(job_id)
        doc, _ = document(record, binary=False)
        state = watched_state(record)
        events = [{"status": s.status, "final": s.final} for s in (*state.earlier, state)]
        times = {
            "queued_ms": record.created_ms,
            "started_ms": record.started_ms,
            "finished_ms": record.finished_ms,
            "deadline_ms": record.deadline_ms,
        }
        return {"job": doc, "times": times, "events": events}

    # -- dead letters --------------------------------------------------------------------

    def _dlq_models(self) -> list[str]:
        g = self._gateway
        snapshot = g.registry.stats.dead_letters if g.registry.stats else {}
        return sorted({*g.registry.models, *g.registry.repository, *snapshot})

    async def dead_letters(self) -> dict[str, Any]:
        g = self._gateway
        names = self._dlq_models()
        pipe = g.redis.pipeline(transaction=False)
        for name in names:
            pipe.xlen(g.keys.dlq(name))
            pipe.xrevrange(g.keys.dlq(name), count=DLQ_SHOWN)
        replies = await pipe.execute()
        models = []
        for i, name in enumerate(names):
            total, found = int(replies[2 * i]), replies[2 * i + 1]
            if not total:
                continue
            models.append(
                {
                    "model": name,
                    "total": total,
                    "entries": [_preview(entry_id, fields) for entry_id, fields in found],
                }
            )
        return {"models": models}

    # -- models --------------------------------------------------------------------------

    async def models(self) -> dict[str, Any]:
        g = self._gateway
        rows = await g.admin.index()
        held = g.registry.repository
        return {
            "rows": rows,
            "available": {
                name: sorted(entry.versions, key=version_order) for name, entry in held.items()
            },
        }


def _preview(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any]:
    """``deadletters.describe``, with a preview of what it carries: a decoded request's first
    input values, or an undecodable payload's first bytes as text (hostile input: the page
    shows it as text, never as markup)."""
    doc = deadletters.describe(entry_id, fields)
    payload = fields.get(FIELD, b"") or b""
    doc["payload_bytes"] = len(payload)
    if doc["request"] is None:
        doc["preview"] = payload[:PREVIEW_CHARS].decode("utf-8", errors="replace")
        return doc
    try:
        request = InferRequest.decode(payload)
        doc["preview"] = "; ".join(
            f"{t.name}: {t.to_numpy().ravel()[:8].tolist()}" for t in request.inputs
        )[:PREVIEW_CHARS]
    except (ProtocolError, ValueError, TypeError) as e:
        doc["preview"] = f"(inputs not shown: {e})"
    return doc
