"""The gateway's reply listener against a real redis-server: replies resolve their waiters, a
reply published while the listener is disconnected is not lost, the keepalive keeps going
through Redis errors, and waiters whose requests Redis lost are answered (from a stored result)
or failed at once. Each holds on one Redis and on a Redis Cluster (where the reply stream and
the job events are read by two loops)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import structlog

import producer.replies
from producer.errors import ServiceUnavailable
from producer.replies import ReplyListener
from protocol.messages import FIELD, InferResult, Status
from runtime.backoff import Backoff
from tests.kinds import RedisUnderTest
from tests.support import until

pytestmark = pytest.mark.integration

log = structlog.get_logger()


@pytest.fixture
def r(either_redis: RedisUnderTest) -> Iterator[Any]:
    with either_redis.client() as client:
        yield client


def ok(request_id: str) -> bytes:
    return InferResult(request_id, Status.OK, "m", "1", worker="w").encode()


def with_listener(
    redis: RedisUnderTest,
    namespace: str,
    body: Callable[[ReplyListener], Awaitable[None]],
    *,
    reads: Backoff | None = None,
    keepalives: Backoff | None = None,
    run: bool = True,
) -> None:
    async def go() -> None:
        broker = await redis.broker()
        listener = ReplyListener(
            broker,
            f"{namespace}:replies:g",
            block_ms=100,
            ttl_s=60,
            reader_name=f"{namespace}-reader",
            job_events=f"{namespace}:jobevents",
            reads=reads,
            keepalives=keepalives,
        )
        await listener.keepalive()
        task = asyncio.create_task(listener.run()) if run else None
        try:
            await body(listener)
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await listener.close()
            await broker.aclose()

    asyncio.run(go())


def test_a_reply_resolves_its_waiter_and_other_entries_are_ignored(r, either_redis, namespace):
    async def body(listener: ReplyListener) -> None:
        waiter = listener.waiters.expect("a", "m", 0)
        r.xadd(listener.key, {b"keepalive": b"1"})
        r.xadd(listener.key, {FIELD: ok("nobody-waits-for-this")})
        r.xadd(listener.key, {FIELD: b"\x93garbage"})
        r.xadd(listener.key, {FIELD: ok("a")})
        result = await waiter.wait(5)
        assert result.id == "a" and result.status is Status.OK
        assert listener.waiting == 0

    with_listener(either_redis, namespace, body)


def test_a_waiter_gets_timeout_error_at_its_deadline(either_redis, namespace):
    async def body(listener: ReplyListener) -> None:
        waiter = listener.waiters.expect("late", "m", 0)
        with pytest.raises(TimeoutError):
            await waiter.wait(0.05)
        assert listener.waiting == 0  # the deadline settled it, through the record

    with_listener(either_redis, namespace, body)


def test_a_reply_published_while_the_listener_is_disconnected_is_delivered_after(
    r, either_redis, namespace
):
    reads = Backoff("replies", log, first_s=0.5)  # stays disconnected long enough to publish

    async def body(listener: ReplyListener) -> None:
        waiter = listener.waiters.expect("during", "m", 0)
        readers = f"{namespace}-reader"
        await until(
            lambda: any(c["cmd"] == "xread" for _, c in either_redis.clients_named(readers))
        )
        either_redis.kill_clients(readers)
        await until(lambda: not reads.healthy)  # it noticed, and waits before reconnecting
        r.xadd(listener.key, {FIELD: ok("during")})  # published while nobody reads
        result = await waiter.wait(5)
        assert result.id == "during"
        assert reads.healthy

    with_listener(either_redis, namespace, body, reads=reads)


def test_job_events_reach_the_watchers_of_that_job_in_order(r, either_redis, namespace):
    async def body(listener: ReplyListener) -> None:
        events = listener.events
        changed = events.subscribe(b"job", "job-1")
        other = events.subscribe(b"job", "job-2")
        first = r.xadd(f"{namespace}:jobevents", {b"job": b"job-1", b"status": b"running"})
        second = r.xadd(f"{namespace}:jobevents", {b"job": b"job-1", b"status": b"succeeded"})
        assert await changed.next(5) == (first.decode(), {b"job": b"job-1", b"status": b"running"})
        assert (await changed.next(5) or ("",))[0] == second.decode()
        assert events.position == second.decode()
        assert await other.next(0.01) is None
        events.unsubscribe(other)
        events.unsubscribe(changed)
        assert events.watching == 0

    with_listener(either_redis, namespace, body)


def test_the_keepalive_carries_on_through_redis_errors(r, either_redis, namespace):
    keepalives = Backoff("reply-keepalive", log)

    async def body(listener: ReplyListener) -> None:
        r.delete(listener.key)
        r.set(listener.key, b"not a stream")  # every XADD to it now fails (WRONGTYPE)
        task = asyncio.create_task(listener.run_keepalive(0.01))
        await until(lambda: keepalives.failures >= 3)
        assert not task.done() and "WRONGTYPE" in (keepalives.problem or "")
        r.delete(listener.key)
        await until(lambda: keepalives.healthy)
        assert r.type(listener.key) == b"stream"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with_listener(either_redis, namespace, body, keepalives=keepalives, run=False)


def test_after_the_reply_stream_was_lost_stored_results_answer_and_lost_requests_fail(
    r, either_redis, namespace
):
    """The reply stream vanished (its replies with it) and so did one request's entry: the
    request whose result is stored is answered from it; the one Redis lost fails with 503 at
    once; the one still queued keeps waiting."""
    stream = f"{namespace}:stream:m:normal"
    done_id = r.xadd(stream, {FIELD: b"done"}).decode()
    queued_id = r.xadd(stream, {FIELD: b"queued"}).decode()
    r.set(f"{namespace}:result:done", ok("done"))

    async def body(listener: ReplyListener) -> None:
        done, lost, queued = (
            listener.waiters.expect(i, "m", 0) for i in ("done", "lost", "queued")
        )
        done.enqueued(stream, done_id, f"{namespace}:result:done")
        queued.enqueued(stream, queued_id, f"{namespace}:result:queued")
        r.xdel(stream, done_id)  # acknowledged and trimmed
        lost.enqueued(stream, "1-1", f"{namespace}:result:lost")  # long gone
        r.delete(listener.key)
        await listener.keepalive()  # finds the stream gone: recreates it and sweeps
        assert (await done.future).id == "done"
        with pytest.raises(ServiceUnavailable, match="lost"):
            await lost.future
        assert not queued.future.done() and listener.waiting == 1
        assert listener.losses == 1 and listener.lost == 1

    with_listener(either_redis, namespace, body, run=False)


def test_a_request_gone_from_its_stream_without_a_result_fails_at_the_second_sweep(
    r, either_redis, namespace
):
    """A failure is stored only as a reply, which may still be on its way: one sweep marks the
    request suspect, the next fails it."""
    stream = f"{namespace}:stream:m:normal"
    r.xadd(stream, {FIELD: b"newer"})

    async def body(listener: ReplyListener) -> None:
        waiter = listener.waiters.expect("gone", "m", 0)
        waiter.enqueued(stream, "1-1", f"{namespace}:result:gone")
        await listener.sweep()
        assert not waiter.future.done() and waiter.suspect
        await listener.sweep()
        with pytest.raises(ServiceUnavailable):
            await waiter.future
        assert listener.waiting == 0

    with_listener(either_redis, namespace, body, run=False)


def test_unconfirmed_requests_wait_until_redis_is_known_to_have_lost_its_data(
    r, either_redis, namespace
):
    """A request whose XADD got no reply has no entry id to judge it by: ordinary sweeps leave
    it waiting (it may be queued); once the reply stream is found gone, one whose result is
    stored is answered from it and one without fails at once (issue #21, defect 5)."""
    stream = f"{namespace}:stream:m:normal"
    r.set(f"{namespace}:result:ran", ok("ran"))

    async def body(listener: ReplyListener) -> None:
        ran, gone = (listener.waiters.expect(i, "m", 0) for i in ("ran", "gone"))
        ran.unconfirmed_in(stream, f"{namespace}:result:ran", listener.losses)
        gone.unconfirmed_in(stream, f"{namespace}:result:gone", listener.losses)
        await listener.sweep()
        await listener.sweep()
        assert not ran.future.done() and not gone.future.done()
        r.delete(listener.key)
        await listener.keepalive()  # the reply stream is gone: Redis lost data
        assert (await ran.future).id == "ran"
        with pytest.raises(ServiceUnavailable, match="lost"):
            await gone.future

    with_listener(either_redis, namespace, body, run=False)


def sweep_fails_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener's next loss sweep raises as a pooled connection to a Redis that went away
    does; later ones run."""
    real = producer.replies.sweep
    failures = [redis.ConnectionError("Connection closed by server.")]

    async def flaky(*args: Any, **kw: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real(*args, **kw)

    monkeypatch.setattr(producer.replies, "sweep", flaky)


def test_a_loss_whose_sweep_failed_is_swept_at_the_next_keepalive(
    r, either_redis, namespace, monkeypatch
):
    """Redis restarted empty: the keepalive finds its reply stream gone (and makes it again),
    then its sweep fails (a pooled connection still to the Redis that went away). The next
    keepalive sees the stream there, yet must still sweep after the loss: the request Redis
    lost fails at once rather than at its deadline (the CI flake of issue #21)."""
    stream = f"{namespace}:stream:m:normal"
    r.xadd(stream, {FIELD: b"newer"})

    async def body(listener: ReplyListener) -> None:
        sweep_fails_once(monkeypatch)
        waiter = listener.waiters.expect("gone", "m", 0)
        waiter.enqueued(stream, "1-1", f"{namespace}:result:gone")  # Redis lost its entry
        r.delete(listener.key)
        with pytest.raises(redis.ConnectionError):
            await listener.keepalive()
        assert r.exists(listener.key) and not waiter.future.done()
        await listener.keepalive()
        assert waiter.future.done()  # failed now, not at its deadline
        with pytest.raises(ServiceUnavailable, match="lost"):
            await waiter.future
        assert listener.losses == 1 and listener.lost == 1

    with_listener(either_redis, namespace, body, run=False)


def test_an_xadd_found_unconfirmed_after_the_loss_sweep_is_judged_by_that_loss(
    r, either_redis, namespace
):
    """The XADD was sent before Redis restarted empty, and its failure is seen only after the
    sweep for that loss: the next ordinary sweep fails it at once (no result is stored)."""
    stream = f"{namespace}:stream:m:normal"

    async def body(listener: ReplyListener) -> None:
        waiter = listener.waiters.expect("late", "m", 0)
        sent_at = listener.losses  # the XADD leaves now
        r.delete(listener.key)
        await listener.keepalive()  # the loss is found and swept: the XADD is still in flight
        assert listener.losses == 1 and not waiter.future.done()
        waiter.unconfirmed_in(stream, f"{namespace}:result:late", sent_at)
        await listener.sweep()
        assert waiter.future.done()  # failed now, not at its deadline
        with pytest.raises(ServiceUnavailable, match="lost"):
            await waiter.future

    with_listener(either_redis, namespace, body, run=False)


def test_an_unconfirmed_xadd_sent_after_the_loss_was_found_keeps_waiting(
    r, either_redis, namespace, monkeypatch
):
    """An XADD sent to the Redis that came back, whose reply was lost, may be queued there: a
    sweep for the earlier loss (retried, since its first attempt failed) leaves it waiting."""
    stream = f"{namespace}:stream:m:normal"

    async def body(listener: ReplyListener) -> None:
        sweep_fails_once(monkeypatch)
        r.delete(listener.key)
        with pytest.raises(redis.ConnectionError):
            await listener.keepalive()  # the loss is found; its sweep fails
        waiter = listener.waiters.expect("after", "m", 0)
        waiter.unconfirmed_in(stream, f"{namespace}:result:after", listener.losses)
        await listener.keepalive()  # sweeps after the loss, now
        await listener.sweep()
        assert not waiter.future.done() and listener.lost == 0

    with_listener(either_redis, namespace, body, run=False)
