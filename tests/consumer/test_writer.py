"""The result writer against a real redis-server of its own (its config is changed here): it
stores results, replies, job transitions and dead letters, checks every reply of its pipeline,
retries what Redis refused with backoff, and acknowledges an entry only once all of it is
stored."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from consumer.ledger import Ledger, Stage
from consumer.metrics import WorkerMetrics
from consumer.outgoing import JobUpdate, Outgoing
from consumer.writer import MAX_PERMANENT_TRIES, ResultWriter
from inferq.redisserver import RedisServer
from protocol.jobs import TRANSITION_SCRIPT, JobStatus, transition_args
from protocol.keys import GROUP
from protocol.messages import FIELD, DeadLetter
from runtime.broker import connect
from runtime.connections import RedisSettings
from tests.support import until

pytestmark = pytest.mark.integration

STREAM = "w:stream:m:normal"
REPLIES = "w:replies:g"
EVENTS = "w:jobevents"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def r(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.config_set("maxmemory", 0)
    yield client
    client.config_set("maxmemory", 0)
    client.close()


def pending_entry(r: redis.Redis) -> bytes:
    """One entry queued and read by this worker (pending, not acknowledged)."""
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    entry_id: bytes = r.xadd(STREAM, {FIELD: b"request"})
    r.xreadgroup(GROUP, "me", {STREAM: ">"})
    r.xadd(REPLIES, {b"keepalive": b"1"})
    return entry_id


def run_writer(
    url: str,
    body: Callable[[ResultWriter, Ledger, aioredis.Redis], Awaitable[None]],
    metrics: WorkerMetrics | None = None,
    ledger: Ledger | None = None,
    trim_interval_s: float = 0.5,
) -> None:
    async def go() -> None:
        broker = await connect(RedisSettings(url=url), name="writer")
        client = broker.commands
        held = ledger if ledger is not None else Ledger()
        writer = ResultWriter(
            broker,
            held,
            job_events=EVENTS,
            transition=broker.script(TRANSITION_SCRIPT),
            metrics=metrics,
            ack_delay_s=0.0,
            trim_interval_s=trim_interval_s,
        )
        task = asyncio.create_task(writer.run())
        try:
            await body(writer, held, client)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await broker.aclose()

    asyncio.run(go())


def result(entry_id: bytes, **fields: Any) -> Outgoing:
    return Outgoing(STREAM, entry_id, b"payload", model="m", **fields)


def backed_up(entry_id: bytes, key: str) -> Outgoing:
    """An uncached synchronous result: its per-request key only backs up its reply."""
    return result(entry_id, result_key=key, ttl_ms=60_000, reply_to=REPLIES, result_backup=True)


def test_a_cached_result_and_its_reply_are_stored_before_the_entry_is_acknowledged(server, r):
    entry_id = pending_entry(r)

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        writer.put([result(entry_id, result_key="w:cache:1", ttl_ms=60_000, reply_to=REPLIES)])
        await writer.wait_idle()
        assert len(ledger) == 0

    run_writer(server.url, body)
    assert r.get("w:cache:1") == b"payload"
    assert 0 < r.pttl("w:cache:1") <= 60_000
    assert r.xrange(REPLIES)[-1][1] == {FIELD: b"payload"}
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_an_uncached_sync_result_is_written_once_to_the_reply_stream(server, r):
    """The reply carries the same bytes as the per-request result key: the key is not written
    (the cache is off, and the waiting gateway reads the reply)."""
    entry_id = pending_entry(r)

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        writer.put([backed_up(entry_id, "w:result:1")])
        await writer.wait_idle()
        assert len(ledger) == 0

    run_writer(server.url, body)
    assert r.xrange(REPLIES)[-1][1] == {FIELD: b"payload"}
    assert not r.exists("w:result:1")
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_an_undeliverable_reply_stores_the_result_key_before_the_entry_is_acknowledged(server, r):
    """The gateway's reply stream is missing (expired, evicted, lost): the reply is dropped
    (NOMKSTREAM), so the result goes to its key, where the gateway's loss sweep looks."""
    entry_id = pending_entry(r)
    r.delete(REPLIES)
    acked_with_key: list[bool] = []

    class Watched(Ledger):
        def acknowledged(self, entries: Any) -> None:
            acked_with_key.append(r.get("w:result:2") == b"payload")
            super().acknowledged(entries)

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        writer.put([backed_up(entry_id, "w:result:2")])
        await writer.wait_idle()
        assert len(ledger) == 0

    run_writer(server.url, body, ledger=Watched())
    assert not r.exists(REPLIES)  # not recreated
    assert r.get("w:result:2") == b"payload"
    assert 0 < r.pttl("w:result:2") <= 60_000
    assert acked_with_key == [True]  # acknowledged once, and only after the key was stored
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_a_result_without_a_reply_stream_is_stored_in_its_key(server, r):
    """Nobody waits on a reply stream (a replayed dead letter, a hand-queued request): the
    result key is where it is read."""
    entry_id = pending_entry(r)

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        writer.put([result(entry_id, result_key="w:result:3", ttl_ms=60_000, result_backup=True)])
        await writer.wait_idle()

    run_writer(server.url, body)
    assert r.get("w:result:3") == b"payload"
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_a_refused_result_is_retried_and_its_entry_stays_pending_until_stored(server, r):
    entry_id = pending_entry(r)
    metrics = WorkerMetrics()

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        r.config_set("maxmemory", 1)  # out of memory, noeviction: writes refused
        writer.put([result(entry_id, result_key="w:cache:2", ttl_ms=60_000, reply_to=REPLIES)])
        await until(lambda: writer.failures >= 3)  # tried, refused, tried again, ...
        assert r.xpending(STREAM, GROUP)["pending"] == 1
        assert ledger.stage((STREAM, entry_id)) is Stage.DELIVERED
        r.config_set("maxmemory", 0)
        await writer.wait_idle()

    run_writer(server.url, body, metrics)
    assert r.get("w:cache:2") == b"payload"
    assert r.xpending(STREAM, GROUP)["pending"] == 0
    refused = metrics.registry.get_sample_value(
        "inferq_worker_write_failures_total", {"model": "m", "reason": "oom"}
    )
    assert refused is not None and refused >= 3


def test_a_job_transition_refused_is_retried_and_the_job_ends_succeeded(server, r):
    entry_id = pending_entry(r)
    r.hset("w:job:1", mapping={"status": "running"})
    update = JobUpdate(
        "w:job:1",
        "1",
        JobStatus.RUNNING,
        transition_args(JobStatus.SUCCEEDED, finished_ms=5, result=b"payload"),
        60_000,
    )

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        r.config_set("maxmemory", 1)
        writer.put([result(entry_id, job=update)])
        await until(lambda: writer.failures >= 2)
        assert r.hget("w:job:1", "status") == b"running"
        assert r.xpending(STREAM, GROUP)["pending"] == 1
        r.config_set("maxmemory", 0)
        await writer.wait_idle()

    run_writer(server.url, body)
    assert r.hget("w:job:1", "status") == b"succeeded"
    assert r.hget("w:job:1", "result") == b"payload"
    assert r.xrange(EVENTS)[-1][1] == {b"job": b"1", b"status": b"succeeded"}
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_a_step_that_was_stored_is_not_written_again_when_another_is_retried(server, r):
    """The result key is written, the reply refused: only the reply is retried."""
    entry_id = pending_entry(r)
    r.set("w:reply-is-not-a-stream", b"x")  # XADD to it fails with WRONGTYPE, every time

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        writer.put(
            [
                Outgoing(
                    STREAM,
                    entry_id,
                    b"payload",
                    model="m",
                    result_key="w:result:3",
                    ttl_ms=60_000,
                    reply_to="w:reply-is-not-a-stream",
                    dead_letter="w:dlq:m",
                    reason="why",
                    raw=b"raw",
                )
            ]
        )
        await writer.wait_idle()  # given up after MAX_PERMANENT_TRIES
        assert (STREAM, entry_id) not in ledger
        assert writer.failures == MAX_PERMANENT_TRIES

    run_writer(server.url, body)
    assert r.xlen("w:dlq:m") == 1  # written once, not once per try
    letter = DeadLetter.from_fields(r.xrange("w:dlq:m")[0][1])
    assert letter == DeadLetter(STREAM, entry_id.decode(), "why", b"raw")
    # Not acknowledged: it stays pending for another worker to reclaim (and dead-letter).
    assert r.xpending(STREAM, GROUP)["pending"] == 1


def test_entries_of_a_stream_that_vanished_are_let_go_without_an_error(server, r):
    entry_id = pending_entry(r)

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        ledger.take(STREAM, entry_id)
        r.delete(STREAM)  # evicted, or Redis restarted empty
        writer.put([Outgoing(STREAM, entry_id, None, model="m")])
        await writer.wait_idle()
        assert len(ledger) == 0

    run_writer(server.url, body)


def test_a_flush_goes_over_the_brokers_pipelining_connection_not_the_pool(server, r):
    """Results, replies and acks of a flush are one ``Broker.batch`` (``runtime.resp``): the
    command pool opens no connection for them."""
    entry_id = pending_entry(r)
    pools: list[dict[str, int]] = []

    async def body(writer: ResultWriter, ledger: Ledger, client: aioredis.Redis) -> None:
        ledger.take(STREAM, entry_id)
        writer.put([result(entry_id, result_key="w:cache:2", ttl_ms=60_000, reply_to=REPLIES)])
        await writer.wait_idle()
        pool = client.connection_pool
        pools.append({"made": len(pool._in_use_connections) + len(pool._available_connections)})

    run_writer(server.url, body)
    assert pools == [{"made": 0}]
    assert r.get("w:cache:2") == b"payload"
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def trims(r: redis.Redis) -> int:
    """Trim scripts run since the last CONFIG RESETSTAT (sent as EVAL in the pipeline)."""
    return int(r.info("commandstats").get("cmdstat_eval", {}).get("calls", 0))


def answer(writer: ResultWriter, ledger: Ledger, r: redis.Redis) -> bytes:
    """Queue one more request, have this worker read it, and hand its result to the writer."""
    entry_id: bytes = r.xadd(STREAM, {FIELD: b"request"})
    r.xreadgroup(GROUP, "me", {STREAM: ">"})
    ledger.take(STREAM, entry_id)
    writer.put([result(entry_id, reply_to=REPLIES)])
    return entry_id


def test_a_trim_rides_with_a_streams_xack_at_most_once_per_interval(server, r):
    """Acknowledged entries leave their stream with the first ack, and with the trim at the end
    of the interval for acks that came sooner (here, alone: the writer went idle)."""
    pending_entry(r)
    r.xack(STREAM, GROUP, *[e for e, _ in r.xrange(STREAM)])
    r.config_resetstat()

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        answer(writer, ledger, r)
        await writer.wait_idle()
        assert (trims(r), r.xlen(STREAM)) == (1, 0)  # trimmed with its ack
        answer(writer, ledger, r)
        answer(writer, ledger, r)
        await writer.wait_idle()
        assert (trims(r), r.xlen(STREAM)) == (1, 2)  # acknowledged, its trim is not due yet
        await until(lambda: r.xlen(STREAM) == 0, what="the trim at the end of the interval")
        assert trims(r) == 2

    run_writer(server.url, body, trim_interval_s=1.0)
    assert r.xpending(STREAM, GROUP)["pending"] == 0


def test_draining_trims_at_once_what_waits_for_its_interval(server, r):
    """On shutdown the worker does not wait out the interval, nor leave the payloads behind."""
    pending_entry(r)
    r.xack(STREAM, GROUP, *[e for e, _ in r.xrange(STREAM)])

    async def body(writer: ResultWriter, ledger: Ledger, _: Any) -> None:
        answer(writer, ledger, r)
        await writer.wait_idle()
        answer(writer, ledger, r)
        await writer.wait_idle()
        assert r.xlen(STREAM) == 1  # its trim is an hour away
        await writer.drain()
        assert r.xlen(STREAM) == 0

    run_writer(server.url, body, trim_interval_s=3600)
