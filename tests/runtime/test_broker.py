"""The one face for Redis (``runtime.broker``), on one Redis and on a Redis Cluster alike: the
server says which it is; batches, scripts, colocated keys, WAIT and blocking reads behave the
same on both; nothing answering is a clear ConnectionError, not a hang."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from inferq.redisserver import RedisServer, free_port
from protocol.keys import GROUP
from runtime import lookup
from runtime.broker import Broker, ClusterBroker, StandaloneBroker, connect
from runtime.connections import RedisSettings
from runtime.readconn import BlockingReads
from tests.kinds import RedisUnderTest
from tests.localcluster import LocalCluster
from tests.support import until

pytestmark = pytest.mark.integration

COUNTER = """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
return n
"""
EACH = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('INCRBY', key, ARGV[1]) end
return out
"""


def with_broker(redis: RedisUnderTest, body: Callable[[Broker], Awaitable[None]]) -> None:
    async def go() -> None:
        broker = await redis.broker()
        try:
            await body(broker)
        finally:
            await broker.aclose()

    asyncio.run(go())


def test_the_server_says_which_broker_a_url_needs(redis_server, redis_cluster):
    async def kinds() -> list[type[Broker]]:
        found = []
        for url in (redis_server.url, redis_cluster.url, redis_cluster.seed_url(1)):
            broker = await connect(RedisSettings(url=url), name="t")
            found.append(type(broker))
            await broker.aclose()
        return found

    assert asyncio.run(kinds()) == [StandaloneBroker, ClusterBroker, ClusterBroker]


def test_with_nothing_answering_one_seed_is_one_redis_and_several_are_a_cluster():
    async def kinds() -> list[str]:
        found = []
        for url in (
            f"redis://127.0.0.1:{free_port()}/0",
            f"redis://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/0",
        ):
            broker = await connect(RedisSettings(url=url, connect_timeout_s=0.2), name="t")
            found.append(broker.kind)
            with pytest.raises(RedisConnectionError):  # a clear error, no hang
                await broker.batch([("PING",)])
            await broker.aclose()
        return found

    assert asyncio.run(kinds()) == ["standalone", "cluster"]


def test_a_batch_answers_in_order_and_an_error_reply_fails_only_its_command(
    either_redis, namespace
):
    async def body(broker: Broker) -> None:
        text, n = f"{namespace}:text", f"{namespace}:n"
        replies = await broker.batch(
            [("SET", text, "a"), ("XADD", text, "*", "f", "v"), ("INCR", n), ("GET", text)]
        )
        assert replies[0] in (b"OK", True) and replies[2] == 1 and replies[3] == b"a"
        assert isinstance(replies[1], ResponseError) and "WRONGTYPE" in str(replies[1])

    with_broker(either_redis, body)


def test_colocated_keys_are_what_one_command_may_name_together(either_redis, namespace):
    async def body(broker: Broker) -> None:
        keys = [f"{namespace}:{{a}}:1", f"{namespace}:{{b}}:1", f"{namespace}:{{a}}:2"]
        groups = broker.colocated(keys)
        assert sorted(k for g in groups for k in g) == sorted(keys)
        for group in groups:  # each group may go in one multi-key command
            assert await broker.commands.mget(group) == [None] * len(group)
        assert broker.colocated([]) == []

    with_broker(either_redis, body)


def test_a_script_runs_alone_in_a_pipeline_and_after_redis_forgot_it(either_redis, namespace):
    async def body(broker: Broker) -> None:
        script = broker.script(COUNTER)
        key = f"{namespace}:counter"
        assert await script(keys=[key], args=[2]) == 2
        pipe = broker.commands.pipeline(transaction=False)
        script.queue(pipe, [key], [3])
        pipe.get(key)
        assert await pipe.execute() == [5, b"5"]
        await broker.commands.script_flush()  # as a restarted or failed-over Redis would
        assert await script(keys=[key], args=[1]) == 6

    with_broker(either_redis, body)


def test_a_script_batch_runs_each_call_in_one_round_trip_even_after_redis_forgot_it(
    either_redis, namespace
):
    async def body(broker: Broker) -> None:
        script = broker.script(COUNTER)
        keys = [f"{namespace}:{{batch{i}}}" for i in range(6)]
        await broker.commands.set(keys[2], "not a number")
        await broker.commands.script_flush()  # NOSCRIPT for every EVALSHA: EVAL follows
        after = [("SET", f"{namespace}:{{then}}", "sent")]
        replies = await script.batch([([k], [i + 1]) for i, k in enumerate(keys)], then=after)
        assert isinstance(replies[2], ResponseError)  # an error reply fails only its call
        assert [r for i, r in enumerate(replies) if i != 2] == [1, 2, 4, 5, 6]
        assert await broker.commands.get(f"{namespace}:{{then}}") == b"sent"
        assert await script.batch([([keys[1]], [1])]) == [3]  # cached now: EVALSHA alone

    with_broker(either_redis, body)


def test_a_script_over_keys_of_several_slots_runs_once_per_group(either_redis, namespace):
    async def body(broker: Broker) -> None:
        keys = [f"{namespace}:{{job{i}}}" for i in range(8)]
        await broker.commands.set(keys[3], 10)
        assert await broker.script(EACH).per_key(keys, [1]) == [1, 1, 1, 11, 1, 1, 1, 1]
        assert await broker.script(EACH).per_key([], [1]) == []

    with_broker(either_redis, body)


def test_wait_goes_to_the_node_that_owns_the_key(either_redis, namespace):
    async def body(broker: Broker) -> None:
        key = f"{namespace}:{{durable}}"
        pipe = broker.commands.pipeline(transaction=False)
        pipe.set(key, 1)
        await broker.queue_wait(pipe, key, replicas=1, timeout_ms=50)
        assert (await pipe.execute())[1] == 0  # no replica here: nobody confirmed it

    with_broker(either_redis, body)


def with_reads(
    redis: RedisUnderTest,
    stream: str,
    name: str,
    body: Callable[[Broker, BlockingReads], Awaitable[None]],
) -> None:
    async def reading(broker: Broker) -> None:
        reads = broker.blocking_reads(stream, name=name, block_ms=5000)
        try:
            await body(broker, reads)
        finally:
            await reads.aclose()

    with_broker(redis, reading)


def blocked(redis: RedisUnderTest, name: str) -> bool:
    """Whether a connection called ``name`` is blocked in Redis now."""
    return any("b" in str(c["flags"]) for _, c in redis.clients_named(name))


def test_blocking_reads_wait_for_entries_and_wake_when_asked(either_redis, namespace):
    stream, name = f"{namespace}:{{s}}:stream", f"{namespace}-reads"

    async def body(broker: Broker, reads: BlockingReads) -> None:
        await broker.commands.xgroup_create(stream, GROUP, id="0", mkstream=True)
        read = asyncio.create_task(
            reads.xreadgroup(GROUP, "me", {stream: ">"}, count=10, block_ms=5000)
        )
        await until(lambda: blocked(either_redis, name))
        entry_id = await broker.commands.xadd(stream, {b"f": b"v"})
        assert await read == [(stream.encode(), [(entry_id, {b"f": b"v"})])]
        # Blocked on nothing to come: woken at once, with nothing.
        read = asyncio.create_task(
            reads.xreadgroup(GROUP, "me", {stream: ">"}, count=10, block_ms=5000)
        )
        await until(lambda: blocked(either_redis, name))
        await reads.unblock()
        assert await asyncio.wait_for(read, 2) == []
        # Its own pending list, with an entry deleted meanwhile: no fields.
        await broker.commands.xdel(stream, entry_id)
        pending = await reads.xreadgroup(GROUP, "me", {stream: "0"}, count=10)
        assert pending == [(stream.encode(), [(entry_id, None)])]

    with_reads(either_redis, stream, name, body)


def test_a_blocking_read_reconnects_after_its_connection_is_killed(either_redis, namespace):
    stream, name = f"{namespace}:{{k}}:stream", f"{namespace}-killed"

    async def body(broker: Broker, reads: BlockingReads) -> None:
        read = asyncio.create_task(reads.xread({stream: "$"}, count=1, block_ms=5000))
        await until(lambda: blocked(either_redis, name))
        either_redis.kill_clients(name)
        with pytest.raises(RedisConnectionError):
            await read
        assert await reads.reset(RedisConnectionError("gone")) is False  # back off first
        await broker.commands.xadd(stream, {b"f": b"1"})
        assert len((await reads.xread({stream: "0"}, count=10))[0][1]) == 1

    with_reads(either_redis, stream, name, body)


def test_a_password_protected_redis_serves_every_part_of_the_broker(namespace):
    with RedisServer(password="s3cret") as server:
        redis = RedisUnderTest("standalone", server.url, (server.port,))

        async def body(broker: Broker) -> None:
            key = f"{namespace}:auth"
            assert await broker.batch([("SET", key, "1")]) == [b"OK"]
            assert await broker.commands.get(key) == b"1"
            reads = broker.blocking_reads(key, name="auth", block_ms=100)
            try:
                assert await reads.xread({f"{namespace}:none": "0"}, count=1) == []
            finally:
                await reads.aclose()

        with_broker(redis, body)


def test_the_pooled_commands_look_their_host_up_as_the_lean_connection_does(redis_url):
    """A container network's DNS reload must not fail a new pooled connection either
    (runtime.lookup)."""

    async def go() -> None:
        broker = StandaloneBroker(RedisSettings(url=redis_url), name="lookup")
        try:
            assert broker.commands.connection_pool.connection_class is lookup.LookedUpConnection
            assert await broker.commands.ping() is True
        finally:
            await broker.aclose()

    asyncio.run(go())


def test_a_unix_socket_url_reaches_redis_over_the_socket(tmp_path, namespace):
    path = str(tmp_path / "redis.sock")
    with RedisServer(extra_args=("--unixsocket", path, "--unixsocketperm", "700")):
        redis = RedisUnderTest("standalone", f"unix://{path}?db=1", ())

        async def body(broker: Broker) -> None:
            key = f"{namespace}:sock"
            assert await broker.batch([("SET", key, "1"), ("GET", key)]) == [b"OK", b"1"]
            assert await broker.commands.get(key) == b"1"  # database 1 for both

        with_broker(redis, body)


def test_a_cluster_broker_on_a_single_seed_finds_every_node(redis_cluster: LocalCluster):
    redis = RedisUnderTest("cluster", redis_cluster.seed_url(2), tuple(redis_cluster.ports))

    async def body(broker: Broker) -> None:
        keys = [f"seed:{{{i}}}" for i in range(20)]
        assert len(broker.colocated(keys)) == 20
        replies = await broker.batch([("SET", k, i) for i, k in enumerate(keys)])
        assert all(r is True or r == b"OK" for r in replies)

    with_broker(redis, body)
