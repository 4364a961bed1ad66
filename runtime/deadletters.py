"""Dead letters read and acted on one way, for ``inferq dlq`` and the gateway's console:
``describe`` (a decoded preview), ``replay`` (back on the original stream) and ``purge``.

A replay moves one entry atomically (``MULTI``: ``XADD`` to the same lane of partition 0, which
shares the dead-letter stream's hash slot, then ``XDEL``), so an entry is never both replayed
and still listed, nor lost between the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, cast

import redis.asyncio as aioredis

from protocol import ProtocolError
from protocol.deadline import deadline_after
from protocol.keys import Keys
from protocol.messages import FIELD, DeadLetter, InferRequest

_DELIVERED = re.compile(r"delivered (\d+) times")


def deliveries(reason: str) -> int:
    """How often the entry was delivered before it was dead-lettered: the worker says so in
    the reason of a poisoned entry; an undecodable one was read once."""
    found = _DELIVERED.search(reason)
    return int(found.group(1)) if found else 1


def describe(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any]:
    """A dead letter as a JSON-able document: where it came from, why, and its request decoded
    (``request`` None and ``undecodable`` the reason when it cannot be)."""
    letter = DeadLetter.from_fields(fields)
    doc: dict[str, Any] = {
        "id": entry_id.decode(),
        "stream": letter.stream,
        "entry": letter.entry_id,
        "reason": letter.reason,
        "deliveries": deliveries(letter.reason),
    }
    try:
        request = InferRequest.decode(letter.payload)
    except ProtocolError as e:
        doc["request"] = None
        doc["undecodable"] = str(e)
        return doc
    doc["request"] = {
        "id": request.id,
        "kind": request.kind.value,
        "model": request.model,
        "version": request.version,
        "priority": request.priority,
        "inputs": [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in request.inputs
        ],
        "traceparent": request.traceparent,
    }
    return doc


async def entries(
    r: aioredis.Redis, stream: str, ids: list[str] | None
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries ``ids`` names (every entry when None), oldest first; ids not in the stream
    are left out (``missing`` tells which)."""
    if ids is None:
        return cast(list[tuple[bytes, dict[bytes, bytes]]], await r.xrange(stream))
    found: list[tuple[bytes, dict[bytes, bytes]]] = []
    for entry_id in ids:
        found += cast(list[tuple[bytes, Any]], await r.xrange(stream, entry_id, entry_id))
    return found


def missing(ids: list[str], found: list[tuple[bytes, Any]]) -> list[str]:
    have = {i.decode() for i, _ in found}
    return [i for i in ids if i not in have]


@dataclass(frozen=True, slots=True)
class Replayed:
    replayed: int
    skipped: list[tuple[str, str]]
    """(dead letter id, why) of those left where they are."""


async def replay(
    r: aioredis.Redis,
    keys: Keys,
    model: str,
    found: list[tuple[bytes, dict[bytes, bytes]]],
    *,
    extend_deadline_s: float = 0.0,
) -> Replayed:
    """Put each entry back on its original lane (partition 0) and delete it from the model's
    dead letters; ``extend_deadline_s`` gives each request a fresh deadline that far ahead."""
    stream = keys.dlq(model)
    now_ms = int((await r.time())[0]) * 1000
    replayed, skipped = 0, []
    for entry_id, fields in found:
        letter = DeadLetter.from_fields(fields)
        payload = letter.payload
        original = keys.parse_stream_key(letter.stream)
        if original is None:
            skipped.append((entry_id.decode(), "no original stream recorded"))
            continue
        target = keys.stream(original.model, original.lane)
        if extend_deadline_s > 0:
            try:
                request = InferRequest.decode(payload)
            except ProtocolError as e:
                skipped.append((entry_id.decode(), f"undecodable ({e})"))
                continue
            deadline = deadline_after(now_ms, extend_deadline_s * 1000)
            payload = replace(request, deadline_ms=deadline).encode()
        pipe = r.pipeline(transaction=True)
        pipe.xadd(target, {FIELD: payload})
        pipe.xdel(stream, entry_id)
        await pipe.execute()
        replayed += 1
    return Replayed(replayed, skipped)


async def purge(r: aioredis.Redis, stream: str, found: list[tuple[bytes, Any]]) -> int:
    """Delete the entries; how many were still there."""
    return int(await r.xdel(stream, *(i for i, _ in found))) if found else 0
