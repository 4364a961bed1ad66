"""A Redis host name's addresses: a lookup that misses is asked again, and once the name has
resolved, a lookup that fails or hangs is answered with the name's last addresses."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from runtime import lookup

LOCAL = [(socket.AF_INET, ("127.0.0.1", 6379))]
ELSEWHERE = [(socket.AF_INET, ("127.0.0.2", 6379))]


def a_name() -> str:
    """A name no other test has resolved (the last addresses are kept per process)."""
    return f"redis-{uuid.uuid4().hex[:8]}"


class Resolver:
    """A loop's ``getaddrinfo``: each lookup takes the next behaviour, "miss" (the resolver
    does not know the name), "hang" (no answer, ever) or an address to answer."""

    def __init__(self, *behaviours: str) -> None:
        self.behaviours = list(behaviours)
        self.asked = 0

    async def __call__(self, host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        self.asked += 1
        then = self.behaviours.pop(0) if len(self.behaviours) > 1 else self.behaviours[0]
        if then == "miss":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if then == "hang":
            await asyncio.Event().wait()
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (then, port))]


def run(resolver: Resolver, body: Callable[[], Awaitable[None]]) -> None:
    async def go() -> None:
        asyncio.get_running_loop().getaddrinfo = resolver  # type: ignore[method-assign]
        await body()

    asyncio.run(go())


def test_a_name_that_misses_lookups_is_asked_again_after_a_pause_until_it_resolves():
    resolver, failures = Resolver("miss", "miss", "127.0.0.1"), []

    async def body() -> None:
        assert await lookup.addresses(a_name(), 6379, failures) == LOCAL

    run(resolver, body)
    assert resolver.asked == 3
    assert [f.errno for f in failures] == [socket.EAI_NONAME] * 2


def test_a_name_that_never_resolves_is_asked_until_the_callers_timeout_and_not_in_a_busy_loop():
    resolver, failures = Resolver("miss"), []

    async def body() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await lookup.addresses(a_name(), 6379, failures)

    run(resolver, body)
    assert 2 <= resolver.asked <= 6 and len(failures) == resolver.asked  # 50 ms, doubling


def test_once_a_name_has_resolved_a_lookup_that_misses_gets_its_last_addresses_at_once():
    name, resolver, failures = a_name(), Resolver("127.0.0.1", "miss"), []

    async def body() -> None:
        assert await lookup.addresses(name, 6379, failures) == LOCAL
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await lookup.addresses(name, 6379, failures) == LOCAL
        assert loop.time() - started < lookup.STALE_AFTER_S

    run(resolver, body)
    assert failures == []


def test_once_a_name_has_resolved_a_lookup_that_hangs_gets_its_last_addresses_after_a_moment():
    name, resolver = a_name(), Resolver("127.0.0.1", "hang")

    async def body() -> None:
        await lookup.addresses(name, 6379, [])
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await lookup.addresses(name, 6379, []) == LOCAL
        assert lookup.STALE_AFTER_S <= loop.time() - started < 3  # within a connect timeout

    run(resolver, body)


def test_a_lookup_that_answers_replaces_the_names_last_addresses():
    """A Redis that came back elsewhere is found at its new address, and that one is kept."""
    name, resolver = a_name(), Resolver("127.0.0.1", "127.0.0.2", "miss")

    async def body() -> None:
        assert await lookup.addresses(name, 6379, []) == LOCAL
        assert await lookup.addresses(name, 6379, []) == ELSEWHERE
        assert await lookup.addresses(name, 6379, []) == ELSEWHERE

    run(resolver, body)


def test_the_last_addresses_are_kept_per_name_and_port():
    name, resolver = a_name(), Resolver("127.0.0.1", "miss")

    async def body() -> None:
        await lookup.addresses(name, 6379, [])
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await lookup.addresses(name, 6380, [])

    run(resolver, body)
