"""Event streams: ``GET /v2/{jobs|batches}/{id}/events`` as ``text/event-stream``.

A stream tells each state of one object, as ``GET`` shows it, then ends after the final one.
It hears changes through the gateway's one events reader (``producer.events.EventFanout``): a
client costs a subscription and its request's own task, no task or Redis connection of its own.
Each event's id is an events-stream entry id, the same on every gateway, with the promise "this
client has seen the object as it was at that entry": a client that reconnects anywhere with
``Last-Event-ID`` gets what changed after it, read with one ``XRANGE``, then the live events.

- The first connection tells the object's whole chain of states (a job that already succeeded:
  queued, running, succeeded), each with the id of the stream position it was read at.
- A resume reads the entries after ``Last-Event-ID`` (at most ``HISTORY_COUNT``): if none is
  about this object, the client is up to date (a final object then answers 204, which tells an
  ``EventSource`` to stop reconnecting); else each state after the one the client last saw. A
  history that was trimmed or is too long falls back to the whole chain: events may repeat,
  but none is skipped.
- Comment lines (``: keepalive``) every ``--sse-heartbeat-s`` keep proxies from closing an idle
  stream; at each the stream checks whether its client has gone, and ends if so. Every
  ``REREAD_EVERY`` heartbeats it re-reads the object, in case an announcement was lost.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from producer.errors import BadRequest, NotFound, redis_unavailable
from producer.events import (
    EventFanout,
    Subscription,
    Watched,
    WatchedState,
    announced_status,
    unseen,
)
from protocol.keys import text
from runtime.faults import RETRYABLE

log = structlog.get_logger("inferq.gateway")

HISTORY_COUNT = 10_000
"""Most events-stream entries a resume reads; an older ``Last-Event-ID`` gets the whole
chain."""
REREAD_EVERY = 4
HEARTBEAT = b": keepalive\n\n"
_ENTRY_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass events on as they come
]


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    state: WatchedState

    def frame(self) -> bytes:
        data = json.dumps(self.state.body, separators=(",", ":"))
        return f"id: {self.id}\ndata: {data}\n\n".encode()


def last_event_id(raw: str | None) -> str | None:
    """The ``Last-Event-ID`` header, checked: an events-stream entry id (400 if not)."""
    if raw is None or not raw.strip():
        return None
    if not _ENTRY_ID.match(raw.strip()):
        raise BadRequest(
            f"Last-Event-ID must be an event id this API sent (like 1700000000000-0), got {raw!r}"
        )
    return raw.strip()


async def open_stream(
    watched: Watched,
    fanout: EventFanout,
    redis: aioredis.Redis,
    events_key: str,
    object_id: str,
    resume_from: str | None,
    heartbeat_s: float,
) -> Response:
    """The response to ``GET /v2/{path}/{id}/events``: 404 for an unknown object, 204 for a
    resume that has seen the final state, else the stream."""
    subscription = fanout.subscribe(watched.field, object_id)
    try:
        try:
            state = await watched.state(object_id)
            if state is None:
                raise NotFound(
                    f"no {text(watched.field)} '{object_id}' (unknown, or past its retention)"
                )
            if resume_from is None:
                first = [Event(fanout.position, s) for s in state.chain]
            else:
                first = await _resumed(redis, events_key, watched, object_id, resume_from, state)
        except RETRYABLE as e:
            raise redis_unavailable(e, f"read the {text(watched.field)}") from e
        if not first and state.final:
            fanout.unsubscribe(subscription)
            return Response(status_code=204)
        return EventStreamResponse(
            watched, fanout, subscription, object_id, first, state, heartbeat_s
        )
    except BaseException:
        fanout.unsubscribe(subscription)
        raise


async def _resumed(
    redis: aioredis.Redis,
    events_key: str,
    watched: Watched,
    object_id: str,
    since: str,
    state: WatchedState,
) -> list[Event]:
    """What a client that saw the object as of entry ``since`` is still to be told."""
    rows = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        await redis.xrange(events_key, min=since, max="+", count=HISTORY_COUNT),
    )
    found = bool(rows) and text(rows[0][0]) == since
    complete = (found or since == "0-0") and len(rows) < HISTORY_COUNT
    ours = [(text(i), f) for i, f in rows if text(f.get(watched.field, b"")) == object_id]
    chain = state.chain
    by_status = {s.status: i for i, s in enumerate(chain)}
    seen: WatchedState | None = None
    if ours and ours[0][0] == since:  # the client's last event was this object's own entry
        status = announced_status(ours.pop(0)[1])
        seen = chain[by_status[status]] if status in by_status else None
    elif complete and not ours:
        seen = state  # nothing happened to it since: the client has it as it is
    elif complete:
        announced = announced_status(ours[0][1])
        before = by_status.get(announced, 0) - 1 if announced is not None else -1
        seen = chain[before] if before >= 0 else None
    events: list[Event] = []
    for entry_id, fields in ours:
        for s in unseen(state, seen, announced_status(fields)):
            events.append(Event(entry_id, s))
            seen = s
    if not complete:
        position = text(rows[-1][0]) if rows else since
        events += [Event(position, s) for s in unseen(state, seen, None)]
    return events


async def _client_gone(receive: Receive) -> bool:
    """Whether the client hung up, without waiting: the messages already there are read, and
    a read that would block is abandoned at once (no task watches the connection)."""
    try:
        async with asyncio.timeout(0):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return True
    except TimeoutError:
        return False


class EventStreamResponse(Response):
    """The stream itself, written by the request's own task."""

    def __init__(
        self,
        watched: Watched,
        fanout: EventFanout,
        subscription: Subscription,
        object_id: str,
        first: list[Event],
        state: WatchedState,
        heartbeat_s: float,
    ) -> None:
        # Not Response.__init__: it would declare a content-length of 0.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), *HEADERS]
        self._watched = watched
        self._fanout = fanout
        self._subscription = subscription
        self._object_id = object_id
        self._first = first
        self._state = state
        self._heartbeat_s = heartbeat_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await self._stream(receive, send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except RETRYABLE as e:
            # Mid-stream there is no status to answer with: end it; the client resumes.
            log.info("event stream ended: Redis unavailable", error=str(e))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._fanout.unsubscribe(self._subscription)

    async def _stream(self, receive: Receive, send: Send) -> None:
        seen: WatchedState | None = None
        for event in self._first:
            await self._send(send, event)
            seen = event.state
        if seen is None:
            seen = self._state  # a resume that had nothing new: the client has this state
        quiet = 0
        while not seen.final:
            item = await self._subscription.next(self._heartbeat_s)
            announced: str | None = None
            if item is None:
                if await _client_gone(receive):
                    return
                await send({"type": "http.response.body", "body": HEARTBEAT, "more_body": True})
                quiet += 1
                if quiet % REREAD_EVERY:
                    continue
                entry_id = self._fanout.position
            else:
                entry_id, fields = item
                if not self._subscription.overflowed:
                    announced = announced_status(fields)
                self._subscription.overflowed = False
            state = await self._watched.state(self._object_id)
            if state is None:
                return  # past its retention meanwhile
            for s in unseen(state, seen, announced):
                await self._send(send, Event(entry_id, s))
                seen = s

    @staticmethod
    async def _send(send: Send, event: Event) -> None:
        await send({"type": "http.response.body", "body": event.frame(), "more_body": True})
