"""The lean pipelining connection against a real redis-server: batches get their own replies
in order however many are in flight, error replies are redis-py's exceptions and fail only
their command, the session is set up as redis-py would (AUTH, database, client name, TLS or a
Unix socket) and knows its client id, and a connection that breaks or stops answering fails
what is in flight and is replaced."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from inferq.redisserver import RedisServer
from runtime.faults import Fault, classify
from runtime.resp import Endpoint, RespConnection

pytestmark = pytest.mark.integration


def endpoint_of(url: str, **options: object) -> Endpoint:
    return Endpoint.of(aioredis.Redis.from_url(url, **options))  # type: ignore[arg-type]


def with_connection(endpoint: Endpoint, body: Callable[[RespConnection], Awaitable[None]]) -> None:
    async def go() -> None:
        connection = RespConnection(endpoint)
        try:
            await body(connection)
        finally:
            await connection.close()

    asyncio.run(go())


def test_a_batch_gets_its_replies_in_order(redis_url, namespace):
    async def body(c: RespConnection) -> None:
        key = f"{namespace}:k"
        assert await c.execute([("SET", key, b"v"), ("GET", key), ("INCR", f"{key}:n")]) == [
            b"OK",
            b"v",
            1,
        ]

    with_connection(endpoint_of(redis_url), body)


def test_an_empty_batch_gets_no_replies_at_once(redis_url, namespace):
    """No reply would end it: it resolves without waiting (a writer flush that only had
    deleted entries to let go sends nothing)."""

    async def body(c: RespConnection) -> None:
        assert await c.execute([("PING",)]) == [b"PONG"]
        assert await asyncio.wait_for(c.execute([]), 1.0) == []

    with_connection(endpoint_of(redis_url), body)


def test_batches_in_flight_together_each_get_their_own_replies(redis_url, namespace):
    async def body(c: RespConnection) -> None:
        key = f"{namespace}:n"
        batches = [[("INCR", key), ("GET", key)] for _ in range(300)]
        replies = await asyncio.gather(*(c.execute(b) for b in batches))
        assert [r[0] for r in replies] == list(range(1, 301))
        assert all(int(got) == n for n, got in replies)

    with_connection(endpoint_of(redis_url), body)


def test_an_error_reply_is_redis_pys_exception_and_fails_only_its_command(redis_url, namespace):
    async def body(c: RespConnection) -> None:
        text = f"{namespace}:text"
        replies = await c.execute(
            [
                ("SET", text, "a"),
                ("XADD", text, "*", "f", "v"),
                ("EVALSHA", "0" * 40, 0),
                ("GET", text),
            ]
        )
        assert replies[0] == b"OK" and replies[3] == b"a"
        assert isinstance(replies[1], ResponseError) and "WRONGTYPE" in str(replies[1])
        assert isinstance(replies[2], NoScriptError)
        assert classify(replies[1]) is classify(ResponseError("WRONGTYPE x"))

    with_connection(endpoint_of(redis_url), body)


def test_the_session_has_the_urls_database_and_the_clients_name(redis_server, namespace):
    url = f"redis://127.0.0.1:{redis_server.port}/5"
    endpoint = endpoint_of(url, client_name="inferq-test-lean")
    assert (endpoint.db, endpoint.client_name) == (5, "inferq-test-lean")

    async def body(c: RespConnection) -> None:
        await c.execute([("SET", f"{namespace}:db5", "here")])
        assert await c.execute([("CLIENT", "GETNAME")]) == [b"inferq-test-lean"]
        assert await c.execute([("CLIENT", "ID")]) == [c.client_id]

    with_connection(endpoint, body)
    assert redis.Redis.from_url(url).get(f"{namespace}:db5") == b"here"
    assert redis.Redis.from_url(redis_server.url).get(f"{namespace}:db5") is None


def test_a_password_in_the_url_authenticates_and_a_wrong_one_is_refused(namespace):
    with RedisServer(password="s3cret") as server:
        good = endpoint_of(server.url)
        bad = endpoint_of(f"redis://:wrong@127.0.0.1:{server.port}/0")

        async def authenticated(c: RespConnection) -> None:
            assert await c.execute([("PING",)]) == [b"PONG"]

        async def refused(c: RespConnection) -> None:
            with pytest.raises(redis.AuthenticationError):
                await c.execute([("PING",)])

        with_connection(good, authenticated)
        with_connection(bad, refused)


def test_tls_urls_get_an_ssl_context_and_unix_socket_urls_a_path():
    tls = endpoint_of("rediss://:pw@127.0.0.1:6390/0?ssl_cert_reqs=none")
    assert tls.ssl is not None and tls.password == "pw" and tls.path is None
    unix = endpoint_of("unix:///tmp/redis.sock?db=2")
    assert (unix.path, unix.db, unix.ssl) == ("/tmp/redis.sock", 2, None)


def test_a_lost_server_fails_the_batch_in_flight_and_the_next_batch_reconnects(namespace):
    first = RedisServer().start()
    endpoint = endpoint_of(first.url)
    second = RedisServer(port=first.port)

    async def body(c: RespConnection) -> None:
        assert await c.execute([("PING",)]) == [b"PONG"]
        first.stop()
        with pytest.raises(RedisConnectionError):
            await c.execute([("PING",)])
        with pytest.raises(RedisConnectionError):  # nothing listens: connecting fails, clearly
            await c.execute([("PING",)])
        second.start()
        assert await c.execute([("PING",)]) == [b"PONG"]

    try:
        with_connection(endpoint, body)
    finally:
        first.stop()
        second.stop()


def test_a_reply_later_than_the_timeout_fails_the_batch_and_the_connection_recovers(
    redis_url, namespace
):
    endpoint = endpoint_of(redis_url, socket_timeout=0.3)
    admin = redis.Redis.from_url(redis_url)

    async def body(c: RespConnection) -> None:
        assert await c.execute([("PING",)]) == [b"PONG"]
        admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        try:
            with pytest.raises(RedisTimeoutError) as overdue:
                await c.execute([("GET", f"{namespace}:x")])
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        assert classify(overdue.value) is Fault.CONNECTION  # what loops back off on, and 503
        assert await c.execute([("PING",)]) == [b"PONG"]

    with_connection(endpoint, body)


def test_a_connect_cancelled_while_the_session_is_set_up_closes_its_socket():
    """A loop cancelled while its connection waits for AUTH/CLIENT ID leaves no socket open (an
    unclosed transport would only be found by the garbage collector)."""
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, never answers
        port = server.getsockname()[1]
        endpoint = Endpoint("127.0.0.1", port, connect_timeout_s=30, reply_timeout_s=30)

        async def go() -> None:
            connection = RespConnection(endpoint)
            sent = asyncio.create_task(connection.execute([("PING",)]))
            peer, _ = await asyncio.get_running_loop().sock_accept(server)
            with peer:
                assert b"CLIENT" in await asyncio.get_running_loop().sock_recv(peer, 1024)
                sent.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await sent
                assert not connection.open
                closed = asyncio.get_running_loop().sock_recv(peer, 1024)
                assert await asyncio.wait_for(closed, 2) == b""  # now, not at a timeout

        server.setblocking(False)
        asyncio.run(go())


def resolver(*behaviours: str) -> tuple[list[str], Callable[..., Awaitable[object]]]:
    """A loop's ``getaddrinfo`` whose lookups go as ``behaviours`` say, the last one repeated:
    "miss" (the name is not known), "hang" (no answer) or "local" (127.0.0.1); and the names it
    was asked."""
    asked: list[str] = []
    real = asyncio.get_running_loop().getaddrinfo

    async def getaddrinfo(host: str, *args: object, **kw: object) -> object:
        asked.append(host)
        then = behaviours[min(len(asked), len(behaviours)) - 1]
        if then == "miss":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if then == "hang":
            await asyncio.Event().wait()
        return await real("127.0.0.1", *args, **kw)

    return asked, getaddrinfo


def a_name() -> str:
    """A host name no other test has resolved (runtime.lookup keeps each name's last addresses)."""
    return f"redis-{uuid.uuid4().hex[:8]}"


def test_a_name_that_misses_a_lookup_for_a_moment_is_looked_up_again_and_connects(redis_server):
    """A container network's DNS drops a lookup while a container joins: the connection asks
    again within its connect timeout instead of failing the request (a deploy-test 503)."""
    name = a_name()
    endpoint = Endpoint(name, redis_server.port, connect_timeout_s=3)

    async def go() -> None:
        asked, getaddrinfo = resolver("miss", "miss", "local")
        asyncio.get_running_loop().getaddrinfo = getaddrinfo  # type: ignore[method-assign]
        connection = RespConnection(endpoint)
        try:
            assert await connection.execute([("PING",)]) == [b"PONG"]
        finally:
            await connection.close()
        assert asked == [name] * 3

    asyncio.run(go())


def test_a_name_whose_lookups_hang_after_it_resolved_connects_to_its_last_address(redis_server):
    endpoint = Endpoint(a_name(), redis_server.port, connect_timeout_s=3)

    async def go() -> None:
        asked, getaddrinfo = resolver("local", "hang")
        asyncio.get_running_loop().getaddrinfo = getaddrinfo  # type: ignore[method-assign]
        for _ in range(2):  # a new connection each time, as the pool opens one
            connection = RespConnection(endpoint)
            try:
                assert await connection.execute([("PING",)]) == [b"PONG"]
            finally:
                await connection.close()
        assert len(asked) == 2

    asyncio.run(go())


@pytest.mark.serial  # counts lookups within a 0.3 s connect timeout
def test_a_name_that_never_resolves_fails_at_the_connect_timeout_with_the_resolvers_words():
    name = a_name()
    endpoint = Endpoint(name, 6379, connect_timeout_s=0.3)

    async def go() -> None:
        asked, getaddrinfo = resolver("miss")
        asyncio.get_running_loop().getaddrinfo = getaddrinfo  # type: ignore[method-assign]
        connection = RespConnection(endpoint)
        with pytest.raises(RedisConnectionError) as failed:
            await connection.execute([("PING",)])
        assert f"cannot connect to Redis at {name}:6379: [Errno -2] Name or service not known" in (
            str(failed.value)
        )
        assert 2 <= len(asked) <= 6, asked  # 50 ms, then doubling: not a busy loop
        assert not connection.open

    asyncio.run(go())
