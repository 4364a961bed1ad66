"""What the events stream announces, and who hears it: the objects watched, their states, the
fan-out of the gateway's one events reader.

Workers and gateways write an entry to the events stream (``Keys.job_events``) on every change of
a job (``{JOB_EVENT_FIELD: id}``, with ``EVENT_STATUS_FIELD`` where the writer knows the new
status) or a batch (``{b"batch": id}``). Each kind of object is a ``Watched``; the gateway holds
one registry of them (``Watchers``, ``{field: Watched}``), which the webhook deliverer
(``producer.webhooks``) and the event streams (``producer.sse``) both use, so neither knows what
a job or a batch is. Long polls, event streams and the deliverer's wake-up all hear the stream
through ``EventFanout``, fed by the reply listener's one reader (``producer.replies``): no Redis
connection and no task per watcher.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.keys import text
from protocol.messages import EVENT_STATUS_FIELD

Fields = Mapping[bytes, bytes]
"""An events entry's fields, as Redis returned them."""

SUBSCRIPTION_BACKLOG = 64
"""Announcements one watcher may have unread; past it the oldest are dropped and the watcher
re-reads the object (``Subscription.overflowed``): a stalled client costs bounded memory."""


@dataclass(frozen=True, slots=True)
class Webhook:
    """What a job or batch asked for."""

    url: str
    events: frozenset[str]
    """Subset of queued, running, succeeded, failed, cancelled, expired (+ batch statuses);
    default: the final ones."""


@dataclass(frozen=True, slots=True)
class WatchedState:
    body: dict[str, Any]
    """Exactly the JSON that GET /v2/jobs/{id} or GET /v2/batches/{id} returns."""
    status: str
    final: bool
    webhook: Webhook | None
    earlier: tuple[WatchedState, ...] = ()
    """The states the object went through before this one, oldest first, each as GET showed it
    then, where they follow from this one (a job's path is fixed: ``JobStatus.path``); () where
    they do not. Event streams and webhooks report a state that was over before they read it."""

    @property
    def chain(self) -> tuple[WatchedState, ...]:
        """Every state from the first to this one."""
        return (*self.earlier, self)


class Watched(Protocol):
    """A kind of object announced on the events stream."""

    field: bytes
    """b"job" or b"batch"."""
    path: str
    """"jobs" or "batches" (URL segment)."""

    async def state(self, object_id: str) -> WatchedState | None:
        """None: unknown / past retention."""
        ...


class Watchers(dict[bytes, Watched]):
    """The gateway's registry: the events field of each kind of object -> its ``Watched``."""

    def add(self, watched: Watched) -> None:
        self[watched.field] = watched

    def announced(self, fields: Fields) -> tuple[Watched, str] | None:
        """The kind and id of the object an events entry is about; None for none we watch."""
        for field, watched in self.items():
            value = fields.get(field)
            if value is not None:
                return watched, text(value)
        return None

    def at(self, path: str) -> Watched | None:
        """The kind served under ``/v2/{path}``."""
        return next((w for w in self.values() if w.path == path), None)


def announced_status(fields: Fields) -> str | None:
    """The status an entry says its object moved to; None where it does not say."""
    value = fields.get(EVENT_STATUS_FIELD)
    return None if value is None else text(value)


def unseen(
    state: WatchedState, seen: WatchedState | None, announced: str | None
) -> list[WatchedState]:
    """What a watcher that last saw ``seen`` is still to be told, now that an entry announced
    ``announced`` (None: "re-read it") and the object is in ``state``: the states of its chain
    after ``seen``, up to the announced one (a later one waits for its own entry), or the state
    itself when only its body changed (a batch's progress)."""
    chain = state.chain
    statuses = [s.status for s in chain]
    start = statuses.index(seen.status) + 1 if seen is not None and seen.status in statuses else 0
    end = statuses.index(announced) + 1 if announced in statuses else len(chain)
    if start < end:
        return list(chain[start:end])
    if announced in (None, state.status) and seen is not None and seen.body != state.body:
        return [state]
    return []


class Subscription:
    """One watcher of one object: the entries about it since it subscribed, in order."""

    __slots__ = ("_entries", "_wake", "key", "overflowed")

    def __init__(self, key: tuple[bytes, str]) -> None:
        self.key = key
        self._entries: collections.deque[tuple[str, Fields]] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        self.overflowed = False
        """Entries were dropped (the watcher fell behind): re-read the object."""

    def put(self, entry_id: str, fields: Fields) -> None:
        if len(self._entries) >= SUBSCRIPTION_BACKLOG:
            self._entries.popleft()
            self.overflowed = True
        self._entries.append((entry_id, fields))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next(self, timeout_s: float) -> tuple[str, Fields] | None:
        """The next entry (id, fields), or None when none came within ``timeout_s``."""
        if not self._entries:
            self._wake = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._wake
            except TimeoutError:
                return None
            finally:
                self._wake = None
        return self._entries.popleft()


class EventFanout:
    """Hands each events entry to the watchers of its object, and to every tap."""

    def __init__(self) -> None:
        self._watchers: dict[tuple[bytes, str], set[Subscription]] = {}
        self._taps: list[Callable[[], None]] = []
        self.position = "0-0"
        """The last entry handed out: a watcher subscribed now hears every entry after it."""

    def subscribe(self, field: bytes, object_id: str) -> Subscription:
        """Subscribe before reading the object, so a change between the read and the wait is
        not missed; ``unsubscribe`` when done."""
        subscription = Subscription((field, object_id))
        self._watchers.setdefault(subscription.key, set()).add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        watchers = self._watchers.get(subscription.key)
        if watchers is not None:
            watchers.discard(subscription)
            if not watchers:
                del self._watchers[subscription.key]

    def tap(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (no await, no argument) after every batch of entries."""
        self._taps.append(callback)

    @property
    def watching(self) -> int:
        return sum(len(s) for s in self._watchers.values())

    def publish(self, entries: Sequence[tuple[Any, Fields]]) -> None:
        """Entries just read from the events stream, in order."""
        for entry_id, fields in entries:
            entry = text(entry_id)
            for field, value in fields.items():
                for subscription in self._watchers.get((field, text(value)), ()):
                    subscription.put(entry, fields)
        if entries:
            self.position = text(entries[-1][0])
            for callback in self._taps:
                callback()
