"""One record per waiting request: settled once, by whoever ends it (reply, deadline, loss,
abandonment, shutdown), and out of the registry and its per-model count as soon as it is."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from producer.waiters import WATCH_AFTER_S, Waiters
from protocol.messages import InferResult, Status


def run(body: Callable[[Waiters], Awaitable[None]]) -> None:
    asyncio.run(body(Waiters()))


def ok(request_id: str) -> InferResult:
    return InferResult(request_id, Status.OK, "m", "1")


def test_a_reply_settles_the_waiter_once_and_a_second_settler_finds_it_gone():
    async def body(waiters: Waiters) -> None:
        a = waiters.expect("a", "m", 0)
        waiters.expect("b", "n", 0)
        assert (len(waiters), waiters.count("m"), waiters.count("n")) == (2, 1, 1)
        assert a.resolve(ok("a"))
        assert (len(waiters), waiters.count("m"), waiters.get("a")) == (1, 0, None)
        assert not a.fail(RuntimeError("too late")) and not a.resolve(ok("a"))
        assert (await a.wait(5)).id == "a"  # answered before its caller began to wait

    run(body)


def test_the_deadline_fails_the_waiter_with_timeout_error_and_releases_it():
    async def body(waiters: Waiters) -> None:
        late = waiters.expect("late", "m", 0)
        with pytest.raises(TimeoutError):
            await late.wait(0.001)
        assert len(waiters) == 0 and waiters.get("late") is None

    run(body)


def test_a_caller_is_watched_only_after_watch_after_s_and_its_going_abandons_the_request():
    async def body(waiters: Waiters) -> None:
        hung_up = asyncio.Event()
        watched = asyncio.Event()
        abandoned: list[str] = []

        async def disconnected() -> None:
            watched.set()
            await hung_up.wait()

        def abandon(request_id: str) -> None:
            abandoned.append(request_id)
            waiters.get(request_id).fail(ConnectionError("gone"))  # type: ignore[union-attr]

        waiter = waiters.expect("w", "m", 0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiting = asyncio.create_task(waiter.wait(30, disconnected, abandon))
        await asyncio.wait_for(watched.wait(), 5)
        assert loop.time() - started >= WATCH_AFTER_S * 0.9  # the loop's clock resolution
        hung_up.set()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(waiting, 5)
        assert abandoned == ["w"] and len(waiters) == 0

    run(body)


def test_a_request_answered_before_watch_after_s_never_starts_a_watcher():
    async def body(waiters: Waiters) -> None:
        async def disconnected() -> None:
            raise AssertionError("watched")

        waiter = waiters.expect("quick", "m", 0)
        waiting = asyncio.create_task(waiter.wait(30, disconnected, lambda _: None))
        await asyncio.sleep(0)  # it waits, its one timer set
        waiter.resolve(ok("quick"))
        assert (await waiting).id == "quick"
        await asyncio.sleep(WATCH_AFTER_S * 2)  # past the point a watcher would have started
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    run(body)


def test_settling_cancels_the_watcher_of_a_request_still_watched():
    async def body(waiters: Waiters) -> None:
        watched = asyncio.Event()

        async def disconnected() -> None:
            watched.set()
            await asyncio.Event().wait()  # the caller never goes

        waiter = waiters.expect("slow", "m", 0)
        waiting = asyncio.create_task(waiter.wait(30, disconnected, lambda _: None))
        await asyncio.wait_for(watched.wait(), 5)
        waiter.resolve(ok("slow"))
        assert (await waiting).id == "slow"
        await asyncio.sleep(0)  # the cancelled watcher finishes
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    run(body)


def test_shutdown_fails_every_waiter_and_close_lets_go_of_one_never_settled():
    async def body(waiters: Waiters) -> None:
        never_queued = waiters.expect("x", "m", 0)
        never_queued.close()
        assert len(waiters) == 0 and not never_queued.future.done()
        a, b = waiters.expect("a", "m", 0), waiters.expect("b", "m", 0)
        waiters.fail_all(ConnectionAbortedError("stopping"))
        for waiter in (a, b):
            with pytest.raises(ConnectionAbortedError):
                await waiter.future
        assert len(waiters) == 0 and waiters.count("m") == 0

    run(body)
