"""The ledger of stream entries a worker holds: read from Redis and not yet acknowledged.

Each held entry moves ``DELIVERED`` (read or claimed, queued for a batch) -> ``RUNNING`` (in a
model call) -> ``STORED`` (its result, reply, job transition or dead letter is in Redis), and
leaves the ledger when its ``XACK`` has succeeded. The reader takes entries in, the dispatchers
mark them running, the writer marks them stored and acknowledged, and the reclaimer renews the
ones held long. An entry is acknowledged only once stored: ``acknowledged`` refuses anything
else, so the rule is enforced here, not left to each caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

Entry = tuple[str, bytes]
"""(stream, entry id)"""


class Stage(Enum):
    DELIVERED = "delivered"
    RUNNING = "running"
    STORED = "stored"


class NotStored(RuntimeError):
    """Acknowledging an entry whose outcome is not stored in Redis: that would lose it."""


@dataclass(slots=True)
class _Held:
    stage: Stage
    since: float
    """When it was read or last renewed (monotonic): how long its claim has been idle."""


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[Entry, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, entry: object) -> bool:
        return entry in self._held

    def holds_any(self, streams: set[str]) -> bool:
        """Whether an entry of one of ``streams`` is still held (a model being unloaded)."""
        return any(stream in streams for stream, _ in self._held)

    def stage(self, entry: Entry) -> Stage | None:
        held = self._held.get(entry)
        return None if held is None else held.stage

    def take(self, stream: str, entry_id: bytes) -> bool:
        """Hold a newly read or claimed entry; False if it is already held (re-read from this
        worker's pending list, or claimed again)."""
        if (stream, entry_id) in self._held:
            return False
        self._held[(stream, entry_id)] = _Held(Stage.DELIVERED, self._clock())
        return True

    def running(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            held = self._held.get(entry)
            if held is not None and held.stage is Stage.DELIVERED:
                held.stage = Stage.RUNNING

    def stored(self, entry: Entry) -> None:
        """Its outcome is in Redis: it may now be acknowledged."""
        held = self._held.get(entry)
        if held is not None:
            held.stage = Stage.STORED

    def ackable(self, entries: Iterable[Entry]) -> list[Entry]:
        """Of ``entries``, those that may be acknowledged now (stored and still held)."""
        return [e for e in entries if (h := self._held.get(e)) and h.stage is Stage.STORED]

    def acknowledged(self, entries: Iterable[Entry]) -> None:
        """Their XACK succeeded: forget them. Raises ``NotStored`` for an entry held but not
        stored (a bug: acknowledging it would have lost it)."""
        entries = list(entries)
        early = [e for e in entries if (h := self._held.get(e)) and h.stage is not Stage.STORED]
        if early:
            raise NotStored(f"{len(early)} entries acknowledged before their outcome was stored")
        for entry in entries:
            self._held.pop(entry, None)

    def unfinished(self, streams: set[str]) -> dict[str, list[bytes]]:
        """Per stream of ``streams``, entries held whose outcome is not stored yet (queued or
        running): what a model unloaded past its drain timeout leaves (``abandon`` them)."""
        left: dict[str, list[bytes]] = {}
        for (stream, entry_id), held in self._held.items():
            if stream in streams and held.stage is not Stage.STORED:
                left.setdefault(stream, []).append(entry_id)
        return left

    def abandon(self, entry: Entry) -> None:
        """Stop holding an entry without acknowledging it: it stays pending in Redis, is no
        longer renewed, and another worker reclaims it after ``claim_idle_ms``."""
        self._held.pop(entry, None)

    def idle_since(self, before: float) -> dict[str, list[bytes]]:
        """Per stream, entries read or renewed before ``before`` (monotonic): claims to renew."""
        stale: dict[str, list[bytes]] = {}
        for (stream, entry_id), held in self._held.items():
            if held.since < before:
                stale.setdefault(stream, []).append(entry_id)
        return stale

    def renewed(self, stream: str, entry_ids: Iterable[bytes]) -> None:
        now = self._clock()
        for entry_id in entry_ids:
            held = self._held.get((stream, entry_id))
            if held is not None:
                held.since = now
