"""Waiting requests that Redis has lost, found without waiting out their deadlines.

``sweep`` judges the queued waiters: an entry is *gone* when its stream no longer holds it
(missing, empty, or starting after its id). A gone entry with a stored result is answered from
it (its reply was lost); one without is *suspect*, and lost at the next sweep, or at once after
a known loss (``after_loss``: the reply stream or Redis's data vanished). A waiter whose ``XADD``
got no reply (*unconfirmed*) is judged only by a loss found after that ``XADD`` was sent
(``losses`` counts the losses found, ``Waiter.losses_seen`` those found before the send), at
whichever sweep first sees it unconfirmed: before that it may be queued in a Redis that is still
there. Each sweep costs one
``XRANGE ... COUNT 1`` per stream with waiters and a ``GET`` per gone entry; nothing per
request. Why it is sound: ARCHITECTURE.md, "Requests Redis lost".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from producer.waiters import Waiter
from protocol.keys import id_before, text

SWEEP_CHUNK = 1000
"""Commands per pipeline, so that 10,000 waiters do not make one giant round trip."""


@dataclass(slots=True)
class Verdict:
    found: list[tuple[Waiter, bytes]] = field(default_factory=list)
    """Waiters whose results are stored (the reply was lost, the result was not)."""
    lost: list[Waiter] = field(default_factory=list)
    """Waiters whose requests Redis lost: not in their stream, no result."""


async def sweep(
    redis: aioredis.Redis, waiters: Iterable[Waiter], *, after_loss: bool, losses: int
) -> Verdict:
    """Judge every queued waiter (see the module docstring) and mark the suspects.
    ``after_loss``: Redis is known to have lost data (fail gone requests now, and look for
    results of all, not only gone ones). ``losses``: how many losses of Redis's data have been
    found so far. Redis errors propagate."""
    everyone = list(waiters)
    queued = [w for w in everyone if w.queued]
    # Unconfirmed (their XADD got no reply): nothing to judge them by, until Redis is known to
    # have lost data after their XADD was sent, which lost them too unless their result is
    # stored. Sent after the last loss found, one may be queued in the Redis there now.
    unconfirmed = [w for w in everyone if w.unconfirmed and not w.queued and w.losses_seen < losses]
    verdict = Verdict()
    if unconfirmed:
        results = await _results(redis, [(w.id, w.result_key) for w in unconfirmed])
        for w in unconfirmed:
            payload = results.get(w.id)
            if payload is not None:
                verdict.found.append((w, payload))
            else:
                verdict.lost.append(w)
    if not queued:
        return verdict
    firsts = await _first_ids(redis, sorted({w.stream for w in queued}))
    gone = {
        w.id
        for w in queued
        if w.stream in firsts and (firsts[w.stream] is None or _before(w, firsts[w.stream]))
    }
    look = [w for w in queued if after_loss or w.id in gone]
    results = await _results(redis, [(w.id, w.result_key) for w in look])
    for w in queued:
        payload = results.get(w.id)
        if payload is not None:
            verdict.found.append((w, payload))
        elif w.id in gone and (after_loss or w.suspect):
            verdict.lost.append(w)
        else:
            w.suspect = w.id in gone
    return verdict


def _before(w: Waiter, first: str | None) -> bool:
    return first is not None and id_before(w.entry_id, first)


async def _first_ids(redis: aioredis.Redis, streams: list[str]) -> dict[str, str | None]:
    """Each stream's first entry id (None: missing or empty). Streams Redis could not answer
    for are left out (nothing is judged on them)."""
    out: dict[str, str | None] = {}
    for start in range(0, len(streams), SWEEP_CHUNK):
        chunk = streams[start : start + SWEEP_CHUNK]
        pipe = redis.pipeline(transaction=False)
        for stream in chunk:
            pipe.xrange(stream, "-", "+", count=1)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        for stream, reply in zip(chunk, replies, strict=True):
            if isinstance(reply, Exception):
                continue
            out[stream] = text(reply[0][0]) if reply else None
    return out


async def _results(redis: aioredis.Redis, keys: list[tuple[str, str]]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    keys = [(rid, key) for rid, key in keys if key]
    for start in range(0, len(keys), SWEEP_CHUNK):
        chunk = keys[start : start + SWEEP_CHUNK]
        pipe = redis.pipeline(transaction=False)
        for _, key in chunk:
            pipe.get(key)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        for (rid, _), reply in zip(chunk, replies, strict=True):
            if isinstance(reply, bytes):
                out[rid] = reply
    return out
