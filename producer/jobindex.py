"""The job index: the newest jobs, so that an operator can list them (the console's job view)
when all they have is a model name and a status, not a job id.

One sorted set (``Keys.job_index``): member the job id, score its creation time (ms, Redis
clock). Written by the submission itself: ``queue_add`` puts ``ZADD`` and an exact trim
(``ZREMRANGEBYRANK 0 -(cap+1)``) on the pipeline that queues the job, so indexing costs no
round trip, two commands of O(log N) each, and about 140 bytes of Redis memory per entry (a
32-character member and a score in a skiplist): at ``JOB_INDEX_MAXLEN`` (10,000), 1.4 MB
(``bench/console.py`` measures it, and the time each submission takes with and without it).
The set never holds more than its cap, whatever the traffic.

The index holds ids only; statuses change, so a page reads each listed job's fields from its
record (``HMGET``, one pipeline per chunk) and filters there. An id whose record is gone (past
retention, or a submission refused by its Idempotency-Key after the id was indexed) is skipped.
A filtered page scans at most ``MAX_SCAN`` ids and says where to go on (``Page.cursor``), so a
rare status costs a bounded read, never a walk of the whole index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from protocol.jobs import JobStatus
from protocol.keys import JOB_INDEX_MAXLEN, Keys
from runtime.resp import Command

MAX_SCAN = 2_000
"""Index entries one page reads at most, filters or not."""
_CHUNK = 200
FIELDS = ("model", "version", "status", "created_ms", "finished_ms", "error")
"""The record fields a list row shows."""


def queue_add(pipe: Any, keys: Keys, job_id: str, created_ms: int) -> None:
    """Index a job on the pipeline that submits it (two commands, no round trip of their own)."""
    for command in commands(keys, {job_id: created_ms}):
        pipe.execute_command(*command)


def commands(keys: Keys, jobs: Mapping[str, int]) -> list[Command]:
    """The two commands that index ``jobs`` (job id -> creation time, ms), to send with the
    commands that submit them."""
    scored = [item for job_id, created_ms in jobs.items() for item in (created_ms, job_id)]
    return [
        ("ZADD", keys.job_index, *scored),
        ("ZREMRANGEBYRANK", keys.job_index, 0, -(JOB_INDEX_MAXLEN + 1)),
    ]


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page ends: the score of the last id scanned, and how many ids with that same
    score were scanned (ties are read past, not skipped)."""

    score: int
    skip: int

    def encode(self) -> str:
        return f"{self.score}.{self.skip}"

    @classmethod
    def parse(cls, raw: str) -> Cursor:
        """A cursor from ``encode``; ``ValueError`` when it is not one."""
        score, _, skip = raw.partition(".")
        cursor = cls(int(score), int(skip or 0))
        if cursor.score < 0 or cursor.skip < 0:
            raise ValueError(raw)
        return cursor


@dataclass(frozen=True, slots=True)
class Page:
    rows: list[dict[str, Any]]
    """Newest first: ``id`` and ``FIELDS`` (times as ms, 0 for not yet)."""
    cursor: str | None
    """The next page's ``cursor``; None at the end of the index."""
    scanned: int
    indexed: int
    """Entries in the index now (at most ``JOB_INDEX_MAXLEN``)."""


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode(errors="replace")


async def page(
    redis: aioredis.Redis,
    keys: Keys,
    *,
    limit: int,
    model: str | None = None,
    status: JobStatus | None = None,
    cursor: Cursor | None = None,
) -> Page:
    """Up to ``limit`` jobs, newest first, older than ``cursor``, of ``model`` and in
    ``status`` when given."""
    rows: list[dict[str, Any]] = []
    scanned = 0
    at = cursor or Cursor(-1, 0)
    done = False
    while len(rows) < limit and scanned < MAX_SCAN:
        top = "+inf" if at.score < 0 else at.score
        chunk = min(_CHUNK, MAX_SCAN - scanned)
        found = cast(
            list[tuple[bytes, float]],
            await redis.zrevrangebyscore(
                keys.job_index, top, "-inf", start=at.skip, num=chunk, withscores=True
            ),
        )
        if not found:
            done = True
            break
        pipe = redis.pipeline(transaction=False)
        for member, _ in found:
            pipe.hmget(keys.job(_text(member)), list(FIELDS))
        records = await pipe.execute()
        for (member, score), values in zip(found, records, strict=True):
            scanned += 1
            score_ms = int(score)
            at = Cursor(score_ms, at.skip + 1 if score_ms == at.score else 1)
            fields = dict(zip(FIELDS, (_text(v) for v in values), strict=True))
            if not fields["status"]:
                continue  # its record is gone
            if model and fields["model"] != model:
                continue
            if status and fields["status"] != status.value:
                continue
            rows.append(
                {
                    "id": _text(member),
                    **fields,
                    "created_ms": int(fields["created_ms"] or 0),
                    "finished_ms": int(fields["finished_ms"] or 0),
                }
            )
            if len(rows) >= limit:
                break
        if len(found) < chunk and len(rows) < limit:
            done = True
            break
    indexed = int(await redis.zcard(keys.job_index))
    return Page(rows, None if done else at.encode(), scanned, indexed)
