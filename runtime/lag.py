"""The backlog of every model's request streams, read from Redis one way: ``collect``.

Everything that shows or acts on the backlog reads it here: the elected refresher that publishes
it for every process (``runtime.stats``), the gateway's stream gauges and admission control when
no snapshot is fresh, and ``inferq lag``, which formats it.

One ``LaneLag`` per model, partition and lane (``Keys.stream(model, lane, partition)``, consumer
group ``workers``): LENGTH (``XLEN``), LAG (entries no worker has read; Redis 7's ``XINFO GROUPS``
``lag``, else worked out another way and marked estimated, see ``LagSource``), PENDING, live
CONSUMERS and the age of the oldest pending entry. A ``Backlog`` is one reading: its lanes, the
dead-letter counts, and sums of its lanes by model, lane or partition (``Totals``).
``DrainEstimator`` turns two readings into drain rates and an ETA.

Models come from the ``{ns}:models`` hash and, unless ``scan=False``, from a ``SCAN`` for
``{ns}:stream:*`` keys. One reading costs two or three round trips: discovery, one pipeline
(``TIME``, the workers zset, two or four commands per stream, the dead-letter lengths), and
``XINFO STREAM`` only for streams whose lag Redis could not give.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import ProtocolError
from protocol.keys import GROUP, LANES_BY_PRIORITY, Keys, Lane, is_valid_name, text
from protocol.registry import ModelMetadata

K = TypeVar("K")


class LagError(Exception):
    """Redis answered something ``inferq lag`` cannot read (a key of the wrong type...)."""


class LagSource(StrEnum):
    """Where a LAG figure comes from. Only the last two are estimates."""

    XINFO = "xinfo"
    """``XINFO GROUPS`` ``lag`` (Redis 7): exact."""
    NO_GROUP = "no-group"
    """No consumer group yet (no worker ever served the model): every entry is unread, XLEN."""
    CAUGHT_UP = "caught-up"
    """The group has read up to the stream's last id: 0."""
    UNREAD = "unread"
    """The group's last-read id is before the first entry still in the stream: XLEN."""
    ENTRIES_READ = "entries-read"
    """Estimate: entries ever added minus entries the group read; counts deleted entries too,
    so it can only be too high (capped at XLEN)."""
    XLEN = "xlen"
    """Estimate: XLEN minus pending, when Redis knows neither lag nor entries read (entries
    deleted mid-stream); too high by the acknowledged entries not yet trimmed."""


EXACT_SOURCES = frozenset(
    {LagSource.XINFO, LagSource.NO_GROUP, LagSource.CAUGHT_UP, LagSource.UNREAD}
)


@dataclass(frozen=True, slots=True)
class LaneLag:
    """The consumer group's position on one request stream, sampled at ``sampled_ms``."""

    model: str
    lane: Lane
    stream: str
    length: int
    lag: int
    lag_source: LagSource
    pending: int
    consumers: int
    """Live workers in the group (heartbeat current)."""
    consumers_registered: int
    """Every consumer the group knows, dead workers included."""
    oldest_pending_ms: int | None
    """Age of the oldest pending entry since it was enqueued; None when nothing is pending."""
    entries_read: int | None
    """The group's entries-read counter (Redis 7); None when Redis cannot tell."""
    sampled_ms: int
    """Redis-clock time of the sample."""
    partition: int = 0

    @property
    def backlog(self) -> int:
        return self.lag + self.pending

    @property
    def lag_exact(self) -> bool:
        return self.lag_source in EXACT_SOURCES


@dataclass(frozen=True, slots=True)
class Drain:
    """How fast one lane's backlog goes, from two samples."""

    read_per_s: float
    """Entries the group read per second (entries-read delta over time)."""
    arrival_per_s: float
    """Entries added per second (entries read plus lag, delta over time)."""
    eta_s: float | None
    """Backlog over (reads minus arrivals); 0 with no backlog; None when it is not shrinking."""


class DrainEstimator:
    """Drain rates from consecutive samples of the same lanes; pure (times come in the samples).

    A rate needs the group's entries-read counter in both samples and an exact lag (arrivals are
    derived from entries read plus lag); without them, or after the counter went backwards (Redis
    restarted, the group was recreated), the lane has no estimate until the next sample.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, Lane, int], LaneLag] = {}

    def update(self, lanes: Iterable[LaneLag]) -> dict[tuple[str, Lane, int], Drain]:
        """Drains keyed by (model, lane, partition)."""
        drains: dict[tuple[str, Lane, int], Drain] = {}
        for lane in lanes:
            key = (lane.model, lane.lane, lane.partition)
            before = self._last.get(key)
            self._last[key] = lane
            if before is None:
                continue
            drain = estimate(before, lane)
            if drain is not None:
                drains[key] = drain
        return drains


def estimate(before: LaneLag, after: LaneLag) -> Drain | None:
    """The drain between two samples of one lane, or None when they cannot tell."""
    dt_s = (after.sampled_ms - before.sampled_ms) / 1000
    if dt_s <= 0 or before.entries_read is None or after.entries_read is None:
        return None
    if not (before.lag_exact and after.lag_exact):
        return None
    read = after.entries_read - before.entries_read
    added = (after.entries_read + after.lag) - (before.entries_read + before.lag)
    if read < 0 or added < 0:
        return None
    read_per_s, arrival_per_s = read / dt_s, added / dt_s
    net = read_per_s - arrival_per_s
    if after.backlog == 0:
        eta: float | None = 0.0
    elif net > 0:
        eta = after.backlog / net
    else:
        eta = None
    return Drain(read_per_s, arrival_per_s, eta)


@dataclass(frozen=True, slots=True)
class Totals:
    """Lanes summed (live consumers: the most in any lane; pending age: the oldest)."""

    length: int
    lag: int
    pending: int
    consumers: int
    oldest_pending_ms: int | None
    lag_exact: bool

    @property
    def backlog(self) -> int:
        return self.lag + self.pending

    @classmethod
    def of(cls, lanes: Sequence[LaneLag]) -> Totals:
        ages = [r.oldest_pending_ms for r in lanes if r.oldest_pending_ms is not None]
        return cls(
            length=sum(r.length for r in lanes),
            lag=sum(r.lag for r in lanes),
            pending=sum(r.pending for r in lanes),
            consumers=max((r.consumers for r in lanes), default=0),
            oldest_pending_ms=max(ages) if ages else None,
            lag_exact=all(r.lag_exact for r in lanes),
        )


@dataclass(frozen=True, slots=True)
class Backlog:
    """One reading of a namespace's request streams."""

    lanes: tuple[LaneLag, ...]
    """Model by model (as discovered, sorted), each model's partitions and lanes in order."""
    dead_letters: dict[str, int]
    """Model -> entries in its dead-letter stream; empty when not read (``detail=False``)."""

    @property
    def sampled_ms(self) -> int | None:
        return self.lanes[0].sampled_ms if self.lanes else None

    @property
    def partitions(self) -> dict[str, int]:
        """Model -> partitions, to read the same streams again (``collect(models=...)``)."""
        out: dict[str, int] = {}
        for lane in self.lanes:
            out[lane.model] = max(out.get(lane.model, 1), lane.partition + 1)
        return out

    def by(self, key: Callable[[LaneLag], K]) -> dict[K, Totals]:
        """The lanes summed per ``key`` (``lambda r: (r.model, r.lane)``...), in lane order."""
        grouped: dict[K, list[LaneLag]] = {}
        for lane in self.lanes:
            grouped.setdefault(key(lane), []).append(lane)
        return {k: Totals.of(rows) for k, rows in grouped.items()}

    def by_model(self) -> dict[str, Totals]:
        return self.by(lambda r: r.model)

    def above(self, threshold: int | None) -> list[str]:
        """Models whose backlog (lag + pending over their lanes) is above ``threshold``."""
        if threshold is None:
            return []
        return [m for m, t in self.by_model().items() if t.backlog > threshold]


# -- collection ------------------------------------------------------------------------------


def _id_ms(entry_id: Any) -> int:
    return int(text(entry_id).partition("-")[0])


def _id_tuple(entry_id: Any) -> tuple[int, int]:
    ms, _, seq = text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _missing(reply: Any) -> bool:
    """A per-command error that only means the stream or its group does not exist (yet)."""
    if not isinstance(reply, ResponseError):
        return False
    text = str(reply).lower()
    return "no such key" in text or "nogroup" in text


def _checked(reply: Any, what: str) -> Any:
    if isinstance(reply, Exception):
        if isinstance(reply, ResponseError):
            raise LagError(f"{what}: {reply}") from reply
        raise reply
    return reply


async def discover_models(redis: aioredis.Redis, keys: Keys, *, scan: bool = True) -> list[str]:
    """Model names from the ``{ns}:models`` hash and, with ``scan``, existing request streams.

    ``SCAN`` walks the whole keyspace (result and cache keys included), so the periodic gauges
    skip it: every model the gateway accepts requests for is in the hash anyway.
    """
    return sorted(await discover_partitions(redis, keys, scan=scan))


async def discover_partitions(
    redis: aioredis.Redis, keys: Keys, *, scan: bool = True
) -> dict[str, int]:
    """Model name -> partitions: what the last published metadata says, or more where ``scan``
    finds streams of higher partitions (a model whose partitions were reduced)."""
    raw = await redis.hgetall(keys.models)
    found: dict[str, int] = {}
    for name, value in raw.items():
        model = text(name)
        try:
            raw_meta = value if isinstance(value, bytes) else str(value).encode()
            found[model] = ModelMetadata.decode(raw_meta).partitions
        except ProtocolError:
            found[model] = 1
    if scan:
        pattern = _glob_escape(f"{keys.namespace}:stream:") + "*"
        async for key in redis.scan_iter(match=pattern, count=1000, _type="stream"):
            parsed = keys.parse_stream_key(text(key))
            if parsed is not None:
                found[parsed.model] = max(found.get(parsed.model, 1), parsed.partition + 1)
    return {n: p for n, p in sorted(found.items()) if is_valid_name(n)}


async def collect(
    redis: aioredis.Redis,
    keys: Keys,
    clock_now_ms: Callable[[], int] | None = None,
    *,
    scan: bool = True,
    models: Sequence[str] | Mapping[str, int] | None = None,
    detail: bool = True,
) -> Backlog:
    """One ``LaneLag`` per lane and partition of every model (discovered unless ``models``, a
    list of names or a map of name to partitions, is given), and each model's dead letters.

    ``clock_now_ms`` gives the Redis clock (``RedisClock.now_ms`` in a gateway, a fixed value
    in tests); without it the collector uses Redis ``TIME`` from the same round trip. Without
    ``detail`` it asks only ``XLEN`` and ``XINFO GROUPS`` (two commands a stream instead of
    four, and no dead letters): pending counts come from the group, live consumers and pending
    ages are left at 0 and None. Connection errors propagate; a reply it cannot read raises
    ``LagError``.
    """
    if models is None:
        models = await discover_partitions(redis, keys, scan=scan)
    if not models:
        return Backlog((), {})
    counts = dict(models) if isinstance(models, Mapping) else dict.fromkeys(models, 1)
    lanes = [
        (m, lane, p, keys.stream(m, lane, p))
        for m, partitions in counts.items()
        for p in range(partitions)
        for lane in LANES_BY_PRIORITY
    ]
    pipe = redis.pipeline(transaction=False)
    pipe.execute_command("TIME")  # pipe.time() is refused on a cluster pipeline
    pipe.zrange(keys.workers, 0, -1, withscores=True)
    per = 4 if detail else 2
    for _, _, _, stream in lanes:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        if detail:
            pipe.xpending(stream, GROUP)
            pipe.xinfo_consumers(stream, GROUP)
    letters = sorted(counts) if detail else []
    for name in letters:
        pipe.xlen(keys.dlq(name))
    replies = await pipe.execute(raise_on_error=False)
    seconds, micros = _checked(replies[0], "TIME")
    now = clock_now_ms() if clock_now_ms else int(seconds) * 1000 + int(micros) // 1000
    live = {text(w) for w, expiry in _checked(replies[1], keys.workers) if expiry >= now}
    rows: list[LaneLag] = []
    unknown: dict[int, Any] = {}  # row index -> last-delivered id, where Redis gave no lag
    for i, (model, lane, partition, stream) in enumerate(lanes):
        length_reply, groups, *details = replies[2 + per * i : 2 + per * (i + 1)]
        length = int(_checked(length_reply, f"XLEN {stream}"))
        group = None
        if not _missing(groups):
            listed = _checked(groups, f"XINFO GROUPS {stream}")
            group = next((g for g in listed if text(g["name"]) == GROUP), None)
        if group is None:
            rows.append(
                LaneLag(
                    model=model,
                    lane=lane,
                    stream=stream,
                    length=length,
                    lag=length,
                    lag_source=LagSource.NO_GROUP,
                    pending=0,
                    consumers=0,
                    consumers_registered=0,
                    oldest_pending_ms=None,
                    entries_read=None,
                    sampled_ms=now,
                    partition=partition,
                )
            )
            continue
        if detail:
            pending, consumers = details
            summary = _checked(pending, f"XPENDING {stream}")
            members = (
                [] if _missing(consumers) else _checked(consumers, f"XINFO CONSUMERS {stream}")
            )
            oldest = summary["min"]
            pending_count, registered = int(summary["pending"]), len(members)
        else:
            members, oldest = [], None
            pending_count = int(group.get("pending") or 0)
            registered = int(group.get("consumers") or 0)
        lag = group.get("lag")
        entries_read = group.get("entries-read")
        if lag is None:
            unknown[len(rows)] = group["last-delivered-id"]
        rows.append(
            LaneLag(
                model=model,
                lane=lane,
                stream=stream,
                length=length,
                lag=int(lag) if lag is not None else 0,
                lag_source=LagSource.XINFO,
                pending=pending_count,
                consumers=sum(1 for c in members if text(c["name"]) in live),
                consumers_registered=registered,
                oldest_pending_ms=max(0, now - _id_ms(oldest)) if oldest is not None else None,
                entries_read=int(entries_read) if entries_read is not None else None,
                sampled_ms=now,
                partition=partition,
            )
        )
    if unknown:
        await _estimate_lags(redis, rows, unknown)
    dlq = replies[2 + per * len(lanes) :]
    dead = {n: int(_checked(r, f"XLEN {keys.dlq(n)}")) for n, r in zip(letters, dlq, strict=True)}
    return Backlog(tuple(rows), dead)


async def _estimate_lags(
    redis: aioredis.Redis, rows: list[LaneLag], unknown: dict[int, Any]
) -> None:
    """Fill in the lag of rows where Redis gave none (entries deleted within the unread range):
    exact where the group has read everything or nothing still in the stream, else estimated."""
    pipe = redis.pipeline(transaction=False)
    for i in unknown:
        pipe.xinfo_stream(rows[i].stream)
    infos = await pipe.execute(raise_on_error=False)
    for (i, last_delivered), info in zip(unknown.items(), infos, strict=True):
        row = rows[i]
        delivered = _id_tuple(last_delivered)
        lag, source = row.length - row.pending, LagSource.XLEN
        if not _missing(info):
            info = _checked(info, f"XINFO STREAM {row.stream}")
            first = info.get("first-entry")
            last_generated = info.get("last-generated-id")
            if row.length == 0 or (
                last_generated is not None and delivered >= _id_tuple(last_generated)
            ):
                lag, source = 0, LagSource.CAUGHT_UP
            elif first is not None and delivered < _id_tuple(first[0]):
                lag, source = row.length, LagSource.UNREAD
            elif row.entries_read is not None and info.get("entries-added") is not None:
                lag = int(info["entries-added"]) - row.entries_read
                source = LagSource.ENTRIES_READ
        rows[i] = replace(row, lag=max(0, min(lag, row.length)), lag_source=source)
