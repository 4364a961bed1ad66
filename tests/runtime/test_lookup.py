"""A Redis host name's addresses: a lookup that misses is asked again, and once the name has
resolved, a lookup that fails or hangs is answered with the name's last addresses."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from runtime import lookup
from runtime.broker import StandaloneBroker
from runtime.connections import RedisSettings

# serial: bounds connect and lookup times.
pytestmark = pytest.mark.serial

LOCAL = [(socket.AF_INET, ("127.0.0.1", 6379))]
ELSEWHERE = [(socket.AF_INET, ("127.0.0.2", 6379))]


def a_name() -> str:
    """A name no other test has resolved (the last addresses are kept per process)."""
    return f"redis-{uuid.uuid4().hex[:8]}"


class Resolver:
    """A loop's ``getaddrinfo``: each lookup takes the next behaviour, "miss" (the resolver
    does not know the name), "hang" (no answer, ever) or an address to answer; with a
    ``gate``, lookups wait for it to be set before they are asked."""

    def __init__(self, *behaviours: str, gate: asyncio.Event | None = None) -> None:
        self.behaviours = list(behaviours)
        self.gate = gate
        self.asked = 0

    async def __call__(self, host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        if self.gate is not None:
            await self.gate.wait()
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


def test_connections_opened_while_a_lookup_hangs_wait_on_that_one_lookup_not_their_own():
    """A hung lookup holds an executor thread until glibc gives up (5 s): one per connect could
    fill the executor. Connects meanwhile, at once or one after another, share the lookup in flight,
    and each still gets the last addresses after a moment."""
    name, resolver = a_name(), Resolver("127.0.0.1", "hang")

    async def body() -> None:
        await lookup.addresses(name, 6379, [])
        at_once = [lookup.addresses(name, 6379, []) for _ in range(5)]
        assert await asyncio.gather(*at_once) == [LOCAL] * 5
        assert await lookup.addresses(name, 6379, []) == LOCAL

    run(resolver, body)
    assert resolver.asked == 2  # the first lookup, then the one that hangs


def test_connections_opened_at_once_share_one_answer_and_the_next_connection_asks_afresh():
    name, resolver = a_name(), Resolver("127.0.0.1", "127.0.0.2")

    async def body() -> None:
        assert (
            await asyncio.gather(*(lookup.addresses(name, 6379, []) for _ in range(3)))
            == [LOCAL] * 3
        )
        assert await lookup.addresses(name, 6379, []) == ELSEWHERE

    run(resolver, body)
    assert resolver.asked == 2


def test_a_connection_that_stops_waiting_leaves_the_shared_lookup_to_the_others():
    """A name never resolved: one caller's timeout does not cancel the lookup the others wait on."""
    name, gate = a_name(), asyncio.Event()
    resolver = Resolver("127.0.0.1", gate=gate)

    async def body() -> None:
        async def impatient() -> None:
            async with asyncio.timeout(0.05):
                await lookup.addresses(name, 6379, [])

        patient = asyncio.ensure_future(lookup.addresses(name, 6379, []))
        with pytest.raises(TimeoutError):
            await impatient()
        gate.set()
        assert await patient == LOCAL

    run(resolver, body)
    assert resolver.asked == 1


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


# redis-py's pooled clients (Broker.commands) look their host up the same way.


def pooled_client(name: str, port: int, connect_timeout_s: float = 3) -> Any:
    """The redis-py client a gateway's broker has for ordinary commands (a pool)."""
    url = f"redis://{name}:{port}/0"
    settings = RedisSettings(url=url, connect_timeout_s=connect_timeout_s)
    return StandaloneBroker(settings, name="lookup-test").commands


async def ping_over_a_new_pool(name: str, port: int) -> None:
    client = pooled_client(name, port)
    try:
        assert await client.ping() is True
    finally:
        await client.aclose()


@pytest.mark.integration
def test_a_pooled_client_whose_name_misses_lookups_for_a_moment_asks_again_and_connects(
    redis_server,
):
    resolver = Resolver("miss", "miss", "127.0.0.1")

    async def body() -> None:
        await ping_over_a_new_pool(a_name(), redis_server.port)

    run(resolver, body)
    assert resolver.asked == 3


@pytest.mark.integration
def test_a_pooled_client_whose_lookups_hang_after_the_name_resolved_uses_its_last_address(
    redis_server,
):
    name, resolver = a_name(), Resolver("127.0.0.1", "hang")

    async def body() -> None:
        for _ in range(2):  # a new pool, so a new connection, each time
            await ping_over_a_new_pool(name, redis_server.port)

    run(resolver, body)
    assert resolver.asked == 2


def test_a_pooled_client_whose_name_never_resolves_fails_at_the_connect_timeout_in_its_words():
    resolver = Resolver("miss")

    async def body() -> None:
        client = pooled_client(a_name(), 6379, connect_timeout_s=0.3)
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RedisConnectionError, match="Name or service not known"):
                await client.ping()
            assert loop.time() - started < 2
        finally:
            await client.aclose()

    run(resolver, body)
    assert 2 <= resolver.asked <= 6


def test_each_address_is_tried_in_turn_and_the_last_refusal_is_the_error(monkeypatch):
    tried: list[str] = []

    async def addresses(host: str, port: int, failures: list[Any]) -> list[lookup.Address]:
        return [(socket.AF_INET, ("127.0.0.3", port)), (socket.AF_INET, ("127.0.0.4", port))]

    async def refused(self: Any) -> None:
        tried.append(self._connection_arguments()["host"])
        raise ConnectionRefusedError(111, f"Connection refused by {tried[-1]}")

    monkeypatch.setattr(lookup, "addresses", addresses)
    monkeypatch.setattr(lookup.Connection, "_connect", refused)
    connection = lookup.LookedUpConnection(host=a_name(), port=6379)
    with pytest.raises(ConnectionRefusedError, match=r"127\.0\.0\.4"):
        asyncio.run(connection._connect())
    assert tried == ["127.0.0.3", "127.0.0.4"]
    assert connection._connection_arguments()["host"] == connection.host  # none left behind


def test_a_tls_connection_is_checked_against_the_hosts_name_not_its_address():
    connection = lookup.LookedUpSSLConnection(host="redis.example", port=6380)
    connection._address = "10.0.0.7"
    arguments = connection._connection_arguments()
    assert arguments["host"] == "10.0.0.7"
    assert arguments["server_hostname"] == "redis.example"
    assert arguments["ssl"] is not None


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://:pw@redis:6379/0", lookup.LookedUpConnection),
        ("rediss://redis:6380/0", lookup.LookedUpSSLConnection),
        ("unix:///run/redis.sock", None),
    ],
)
def test_tcp_and_tls_urls_get_the_looked_up_connections_and_a_unix_socket_redis_pys_own(url, kind):
    assert lookup.connection_class(url) is kind
