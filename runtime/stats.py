"""One refresher of the backlog statistics per namespace, elected through Redis.

See ``protocol.stats`` for why. Every gateway runs a ``StatsRefresher`` loop; at most one of them
(the holder of ``Keys.stats_lease``) collects and publishes each ``interval_s``:

- Election: a gateway takes the lease with ``SET lease me NX PX ttl`` when the published
  snapshot is missing or stale (so while a holder is alive, the others send nothing for it);
  the holder renews it with each publication (``RENEW_SCRIPT``: only while it is still its own).
  A holder that dies stops renewing; its lease expires after ``ttl`` (3 intervals) and another
  gateway takes over.
- Collection: ``runtime.lag.collect``, the one reader of the backlog: without detail (``XLEN``
  and ``XINFO GROUPS`` of every stream) each interval, and every ``detail_every`` intervals the
  full collection (pending ages, live consumers, dead letters). Between full collections the
  last full values are carried over.

Readers (``read_snapshot``, then ``to_backlog``) take the value as it is; a snapshot older than a
few intervals is treated as absent, and callers fall back to ``collect`` themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import cast

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from protocol import ProtocolError
from protocol.keys import Keys, Lane
from protocol.stats import LaneRow, StatsSnapshot
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.faults import RETRYABLE
from runtime.lag import Backlog, LagError, LagSource, LaneLag, collect, discover_partitions

RENEW_SCRIPT = """
-- KEYS[1]: the lease. ARGV[1]: its holder, ARGV[2]: TTL (ms). 1 when renewed, 0 when lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_ERRORS: tuple[type[BaseException], ...] = (*RETRYABLE, LagError)

STALE_AFTER_INTERVALS = 3
"""A snapshot older than this many intervals is treated as absent (its publisher is gone)."""


def to_rows(backlog: Backlog) -> tuple[LaneRow, ...]:
    return tuple(
        LaneRow(
            lane.model,
            lane.lane.value,
            lane.partition,
            lane.length,
            lane.lag,
            lane.lag_source.value,
            lane.pending,
            lane.consumers,
            lane.consumers_registered,
            lane.oldest_pending_ms,
            lane.entries_read,
        )
        for lane in backlog.lanes
    )


def to_backlog(snapshot: StatsSnapshot, keys: Keys) -> Backlog:
    """The snapshot as ``runtime.lag.collect`` would have read it; rows naming an unknown lane
    or lag source are left out."""
    out = []
    for row in snapshot.lanes:
        try:
            lane, source = Lane(row.lane), LagSource(row.lag_source)
        except ValueError:
            continue
        out.append(
            LaneLag(
                model=row.model,
                lane=lane,
                stream=keys.stream(row.model, lane, row.partition),
                length=row.length,
                lag=row.lag,
                lag_source=source,
                pending=row.pending,
                consumers=row.consumers,
                consumers_registered=row.consumers_registered,
                oldest_pending_ms=row.oldest_pending_ms,
                entries_read=row.entries_read,
                sampled_ms=snapshot.sampled_ms,
                partition=row.partition,
            )
        )
    return Backlog(tuple(out), dict(snapshot.dead_letters))


def decode_snapshot(raw: bytes | None) -> StatsSnapshot | None:
    if raw is None:
        return None
    try:
        return StatsSnapshot.decode(raw)
    except ProtocolError:
        return None


async def read_snapshot(redis: aioredis.Redis, keys: Keys) -> StatsSnapshot | None:
    """The published snapshot, or None (none, or not readable)."""
    return decode_snapshot(cast(bytes | None, await redis.get(keys.stats)))


class StatsRefresher:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        me: str,
        now_ms: Callable[[], int],
        *,
        interval_s: float,
        detail_every: int,
        backoff: Backoff,
        latest: Callable[[], StatsSnapshot | None],
        publish: Callable[[StatsSnapshot], None] | None = None,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._me = me
        self._now_ms = now_ms
        self.interval_s = interval_s
        self._detail_every = max(1, detail_every)
        self._backoff = backoff
        self._latest = latest
        """The last snapshot this process read (the registry reads it every refresh)."""
        self._publish = publish
        """Called with each snapshot this process publishes, so it uses it at once."""
        self._renew: AsyncScript = redis.register_script(RENEW_SCRIPT)
        self.leader = False
        self._rounds = 0
        self._detail: dict[tuple[str, str, int], LaneLag] = {}
        self._detailed_ms = 0
        self._dead_letters: dict[str, int] = {}
        self.published = 0

    @property
    def ttl_ms(self) -> int:
        return int(self.interval_s * 1000 * STALE_AFTER_INTERVALS)

    async def run(self) -> None:
        while not cancelling():
            try:
                await self.tick()
                self._backoff.succeeded()
            except _ERRORS as e:
                self.leader = False
                self._backoff.record(e)
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        """Renew or take the lease as needed; publish when holding it."""
        if self.leader:
            renewed = await self._renew(keys=[self._keys.stats_lease], args=[self._me, self.ttl_ms])
            self.leader = bool(renewed)
        if not self.leader:
            latest = self._latest()
            if latest is not None and latest.fresh(self._now_ms(), self.ttl_ms):
                return  # someone publishes: nothing to do
            self.leader = bool(
                await self._redis.set(self._keys.stats_lease, self._me, nx=True, px=self.ttl_ms)
            )
            if not self.leader:
                return
        await self.publish()

    async def publish(self) -> StatsSnapshot:
        detail = self._rounds % self._detail_every == 0
        self._rounds += 1
        models = await discover_partitions(self._redis, self._keys, scan=False)
        # Stamped before the reads: a request queued meanwhile may be counted twice by a
        # gateway for a moment (its own count and the lag), never missed.
        started_ms = self._now_ms()
        backlog = await collect(self._redis, self._keys, self._now_ms, models=models, detail=detail)
        if detail:
            self._detail = {(r.model, r.lane.value, r.partition): r for r in backlog.lanes}
            sampled = backlog.sampled_ms
            self._detailed_ms = self._now_ms() if sampled is None else sampled
            self._dead_letters = backlog.dead_letters
        else:
            backlog = Backlog(tuple(map(self._carry, backlog.lanes)), self._dead_letters)
        snapshot = StatsSnapshot(
            sampled_ms=started_ms,
            detailed_ms=self._detailed_ms,
            lanes=to_rows(backlog),
            dead_letters=self._dead_letters,
            publisher=self._me,
        )
        await self._redis.set(self._keys.stats, snapshot.encode(), px=self.ttl_ms)
        self.published += 1
        if self._publish is not None:
            self._publish(snapshot)
        return snapshot

    def _carry(self, lane: LaneLag) -> LaneLag:
        """A light sample completed with the last full one's live consumers and pending age
        (the age grows with the time since; none when nothing is pending now)."""
        before = self._detail.get((lane.model, lane.lane.value, lane.partition))
        if before is None:
            return lane
        oldest = None
        if lane.pending and before.oldest_pending_ms is not None:
            oldest = before.oldest_pending_ms + max(0, lane.sampled_ms - before.sampled_ms)
        return replace(lane, consumers=before.consumers, oldest_pending_ms=oldest)
