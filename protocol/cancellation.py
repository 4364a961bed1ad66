"""Requests whose callers have gone: the gateway marks them, workers drop them unrun.

When an HTTP client hangs up (or a gRPC call is cancelled) before its request ran, nobody will
read the answer. The gateway adds the request id to the model's cancelled set
(``Keys.cancelled(model)``, a sorted set scored by the request's deadline) with ``MARK_SCRIPT``;
a worker forming a batch asks once for all the batch's synchronous requests that have waited at
least ``CHECK_AFTER_MS`` (``ZMSCORE``: one command per batch, not per request) and acknowledges
the cancelled ones without running them. Members are pruned once their deadline has passed (a
worker drops those anyway), and the set expires a minute after the last deadline it holds, so it
stays small and never outlives its use. Marks are best effort: a request already in a running
batch finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

CHECK_AFTER_MS = 10
"""Requests younger than this (enqueued to batch, Redis clock) are not looked up: at low load
every request is a batch of its own, and the lookup's round trip would add to every request's
latency to catch a caller that hangs up within milliseconds. Abandoned requests are the ones
that waited: behind a backlog, a paused or a missing worker."""

KEEP_AFTER_DEADLINE_MS = 60_000
"""How long the set outlives the latest deadline in it (clock offsets between hosts)."""

MARK_SCRIPT = """
-- KEYS[1]: a model's cancelled set. ARGV[1]: request id, ARGV[2]: its deadline,
-- ARGV[3]: now (both ms on the Redis clock), ARGV[4]: how long to keep the set past a deadline.
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
local keep = tonumber(ARGV[2]) - tonumber(ARGV[3]) + tonumber(ARGV[4])
if redis.call('PTTL', KEYS[1]) < keep then
  redis.call('PEXPIRE', KEYS[1], keep)
end
return 1
"""


def mark_args(request_id: str, deadline_ms: int, now_ms: int) -> list[str | int]:
    """ARGV of ``MARK_SCRIPT``."""
    return [request_id, deadline_ms, now_ms, KEEP_AFTER_DEADLINE_MS]


def cancelled_of(request_ids: Sequence[str], scores: Sequence[float | None]) -> set[str]:
    """The ids a ``ZMSCORE`` of ``request_ids`` found in the cancelled set."""
    return {i for i, score in zip(request_ids, scores, strict=True) if score is not None}
