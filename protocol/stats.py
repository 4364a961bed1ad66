"""The backlog snapshot one elected gateway publishes for every process of a namespace.

Every gateway needs each model's backlog once a second (admission control) and the stream gauges
every few seconds; every worker's reclaimer wants to know which streams hold pending entries.
Asked of Redis by each process, that costs processes x models x lanes commands a second at idle.
Instead one gateway, elected through Redis (``Keys.stats_lease``, ``SET NX PX``), collects
``XLEN`` and ``XINFO GROUPS`` of every stream once a second (and, every few seconds, the pending
ages and live consumers too) and writes the result under ``Keys.stats``; every other process
reads that one key. The idle cost then grows with models, not with processes times models.

``StatsSnapshot`` is the value's one codec. Each ``LaneRow`` is one model, partition and lane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.envelope import pack, unpack
from protocol.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class LaneRow:
    """One request stream's consumer-group position (see ``runtime.lag.LaneLag``)."""

    model: str
    lane: str
    partition: int
    length: int
    lag: int
    lag_source: str
    pending: int
    consumers: int
    consumers_registered: int
    oldest_pending_ms: int | None
    entries_read: int | None

    def wire(self) -> list[Any]:
        return [
            self.model,
            self.lane,
            self.partition,
            self.length,
            self.lag,
            self.lag_source,
            self.pending,
            self.consumers,
            self.consumers_registered,
            self.oldest_pending_ms,
            self.entries_read,
        ]

    @classmethod
    def from_wire(cls, item: Any) -> LaneRow:
        if not (isinstance(item, list) and len(item) == 11):
            raise ProtocolError("stats row is not an 11-field list")
        model, lane, partition, length, lag, source, pending, live, registered, oldest, read = item
        if not (isinstance(model, str) and isinstance(lane, str) and isinstance(source, str)):
            raise ProtocolError("stats row: invalid model, lane or lag source")
        counts = (partition, length, lag, pending, live, registered)
        if not all(_is_int(v) and v >= 0 for v in counts):
            raise ProtocolError(f"stats row {model}/{lane}: counts must be integers >= 0")
        if not all(v is None or _is_int(v) for v in (oldest, read)):
            raise ProtocolError(f"stats row {model}/{lane}: invalid pending age or entries read")
        return cls(
            model, lane, partition, length, lag, source, pending, live, registered, oldest, read
        )


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    sampled_ms: int
    """Redis-clock time of the collection."""
    detailed_ms: int
    """When pending ages and live consumers were last collected (every few seconds)."""
    lanes: tuple[LaneRow, ...]
    dead_letters: dict[str, int]
    """Model -> entries in its dead-letter stream, as of ``detailed_ms``."""
    publisher: str = ""
    """The gateway that published it."""

    def encode(self) -> bytes:
        return pack(
            [
                self.sampled_ms,
                self.detailed_ms,
                [row.wire() for row in self.lanes],
                self.dead_letters,
                self.publisher,
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> StatsSnapshot:
        sampled, detailed, lanes, letters, publisher = unpack(raw, "stats snapshot", 5)
        if not (_is_int(sampled) and _is_int(detailed) and isinstance(lanes, list)):
            raise ProtocolError("stats snapshot: invalid times or lanes")
        if not isinstance(letters, dict) or not all(
            isinstance(k, str) and _is_int(v) for k, v in letters.items()
        ):
            raise ProtocolError("stats snapshot: dead letters must map model names to counts")
        if not isinstance(publisher, str):
            raise ProtocolError("stats snapshot: invalid publisher")
        rows = tuple(LaneRow.from_wire(item) for item in lanes)
        return cls(sampled, detailed, rows, dict(letters), publisher)

    def fresh(self, now_ms: int, max_age_ms: int) -> bool:
        return 0 <= now_ms - self.sampled_ms <= max_age_ms


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
