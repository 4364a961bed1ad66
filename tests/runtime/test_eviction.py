"""Redis's maxmemory-policy: which ones may evict inferq's keys, read from a real Redis, and a
warning that names the setting and the fix, given once per change."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from runtime.eviction import UNKNOWN, EvictionCheck, is_evicting, read_policy, warning


class Log:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, event: str, **_: object) -> None:
        self.warnings.append(event)

    def info(self, event: str, **_: object) -> None:
        pass


@pytest.mark.parametrize(
    "policy",
    [
        "allkeys-lru",
        "allkeys-lfu",
        "allkeys-random",
        "volatile-lru",
        "volatile-lfu",
        "volatile-random",
        "volatile-ttl",
    ],
)
def test_every_allkeys_and_volatile_policy_may_evict(policy):
    assert is_evicting(policy)


def test_noeviction_and_an_unknown_policy_do_not_count_as_evicting():
    assert not is_evicting("noeviction") and not is_evicting(UNKNOWN)


def test_the_warning_names_the_setting_and_the_fix():
    text = warning("allkeys-lru")
    assert "maxmemory-policy is allkeys-lru" in text
    assert "CONFIG SET maxmemory-policy noeviction" in text


def test_a_policy_is_warned_about_once_per_change_and_every_change_reported():
    log = Log()
    seen: list[tuple[str, bool]] = []
    check = EvictionCheck(log, lambda policy, evicting: seen.append((policy, evicting)))
    for policy in ("noeviction", "allkeys-lru", "allkeys-lru", "volatile-ttl", "noeviction"):
        check.observe(policy)
    assert len(log.warnings) == 2 and not check.evicting
    assert seen == [
        ("noeviction", False),
        ("allkeys-lru", True),
        ("volatile-ttl", True),
        ("noeviction", False),
    ]


@pytest.mark.integration
def test_the_policy_is_read_from_redis(redis_url):
    async def go() -> str:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await read_policy(client)
        finally:
            await client.aclose()

    assert asyncio.run(go()) == "noeviction"
