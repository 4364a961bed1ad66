"""Whether Redis may evict inferq's keys: its ``maxmemory-policy``, read and judged.

inferq keeps accepted work in Redis: request streams, job records (with TTLs) and results. Under
memory pressure, an ``allkeys-*`` policy evicts any key and a ``volatile-*`` policy any key with
a TTL, so an evicting Redis silently loses requests that were answered "accepted". Only
``noeviction`` is safe: a full Redis then refuses writes, which inferq answers with 503 and
retries, losing nothing it acknowledged.

Gateways and workers read the policy at start and on every refresh (``EvictionCheck.refresh``),
log a warning that names the setting and the fix whenever it is (or becomes) an evicting one,
and export it (``runtime.metrics.RuntimeGauges.set_policy``); ``inferq lag`` shows it too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

UNKNOWN = "unknown"
"""The policy when Redis does not let us read it (CONFIG disabled, as on some managed Redis)."""


def is_evicting(policy: str) -> bool:
    return policy.startswith(("allkeys-", "volatile-"))


def warning(policy: str) -> str:
    """What to tell an operator about an evicting policy: the setting and the fix."""
    return (
        f"Redis maxmemory-policy is {policy}: under memory pressure Redis may evict inferq's "
        "request streams, job records and results, losing accepted work. Set "
        "maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in redis.conf) "
        "so that a full Redis refuses writes instead"
    )


async def read_policy(redis: aioredis.Redis) -> str:
    """``CONFIG GET maxmemory-policy``; ``UNKNOWN`` when Redis refuses CONFIG. Connection
    errors propagate."""
    try:
        reply: Any = await redis.config_get("maxmemory-policy")
    except ResponseError:
        return UNKNOWN
    value = reply.get("maxmemory-policy") or reply.get(b"maxmemory-policy")
    if value is None:
        return UNKNOWN
    return value.decode() if isinstance(value, bytes) else str(value)


class EvictionCheck:
    """Remembers the policy; warns when it becomes an evicting one; reports every change."""

    def __init__(self, log: Any, on_policy: Callable[[str, bool], None] | None = None) -> None:
        self._log = log
        self._on_policy = on_policy
        self.policy: str | None = None

    @property
    def evicting(self) -> bool:
        return self.policy is not None and is_evicting(self.policy)

    async def refresh(self, redis: aioredis.Redis) -> None:
        self.observe(await read_policy(redis))

    def observe(self, policy: str) -> None:
        if policy == self.policy:
            return
        self.policy = policy
        if is_evicting(policy):
            self._log.warning(warning(policy), maxmemory_policy=policy)
        elif policy == UNKNOWN:
            self._log.info(
                "cannot read Redis's maxmemory-policy (CONFIG GET refused); make sure it is "
                "noeviction"
            )
        if self._on_policy is not None:
            self._on_policy(policy, is_evicting(policy))
