"""The one thread a Python model's code runs on, one call at a time, each waited for at most
until a deadline.

Python cannot stop a thread, so a call that overruns its deadline is left running and the caller
gets ``Overran``. Until that call returns, the thread refuses new calls at once (``Overran``
again): a model's code is written for one call at a time, and a second call into an object
whose first call is stuck (holding its lock, half through its state) would be neither safe nor
likely to finish. When the stuck call does return, its result is dropped and the thread serves
again. A coroutine (``async def``) runs on the thread's own event loop, never on the worker's;
at its deadline it is cancelled (``CancelledError`` at the ``await`` it is waiting on), so an
``async`` call that waits on something frees its thread at once.

The thread is a daemon: one still stuck when the worker exits does not hold the exit up.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from consumer.backends.base import Overran

CANCEL_GRACE_S = 0.5
"""How long a coroutine cancelled at its deadline is given to end (it ends at its next
``await``, at once unless the machine is very busy) before its thread counts as stuck."""


class _Call:
    """One call handed to the thread, and its outcome."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> None:
        self.fn, self.args, self.what = fn, args, what
        self.finished = False
        self._end = threading.Lock()  # held until the call ends (cheaper than an Event)
        self._end.acquire()
        self.value: Any = None
        self.error: BaseException | None = None
        self.task: asyncio.Task[Any] | None = None
        self.started = time.monotonic()
        self.overran_at = 0.0

    def end(self) -> None:
        """On the thread: the call has ended."""
        self.finished = True
        self._end.release()

    def wait(self, timeout: float | None) -> bool:
        """Whether the call ended within ``timeout`` seconds (None: however long it takes)."""
        if not self._end.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._end.release()  # so that any later wait returns at once
        return True

    def cancel_task(self) -> None:
        """On the thread's loop: cancel this call's coroutine if it is still running."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


class UserThread:
    """A daemon thread that runs calls one at a time, each bounded by a deadline."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        """Created on the thread for the first coroutine, closed when the thread ends."""
        self._overrun: _Call | None = None
        """A call that ran past its deadline and had not returned when last looked at."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread once it has run what it was given (a stuck call first returns)."""
        self._calls.put(None)

    def stuck(self) -> bool:
        """A call overran its deadline and is still running."""
        if self._overrun is not None and self._overrun.finished:
            self._overrun = None
        return self._overrun is not None

    def call(self, fn: Callable[..., Any], *args: Any, what: str, deadline: float | None) -> Any:
        """``fn(*args)`` on the thread (awaited there if it returns an awaitable), waited for
        until ``deadline`` (monotonic seconds; None: as long as it takes). Raises what the call
        raised, or ``Overran`` if it did not return in time or an earlier call is stuck."""
        old = self._overrun
        if old is not None and old.task is not None:
            old.wait(CANCEL_GRACE_S)  # a cancelled coroutine ends at its next await
        if self.stuck():
            assert old is not None
            raise Overran(
                f"not run: {old.what} overran its deadline {time.monotonic() - old.overran_at:.1f}"
                " s ago and has not returned (a running Python call cannot be stopped); calls "
                "fail at once until it returns"
            )
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise Overran(f"not run: the deadline had passed {-timeout:.3f} s before {what}")
        call = _Call(fn, args, what)
        self._calls.put(call)
        if call.wait(timeout):
            if call.error is not None:
                raise call.error
            return call.value
        call.overran_at = time.monotonic()
        late = f"{what} did not return by its deadline ({call.overran_at - call.started:.1f} s)"
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # closed: the thread has ended
                loop.call_soon_threadsafe(call.cancel_task)
        if call.task is not None:  # a coroutine: cancelled at the await it is waiting on
            if not call.wait(CANCEL_GRACE_S):
                self._overrun = call
            raise Overran(f"{late}: cancelled")
        self._overrun = call
        raise Overran(f"{late}; it is left running, and calls fail at once until it returns")

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                value = call.fn(*call.args)
                if inspect.isawaitable(value):
                    value = self._await(call, value)
                call.value = value
            except BaseException as e:  # the caller re-raises it; the thread serves on
                call.error = e
            finally:
                call.end()
        if self._loop is not None:
            self._loop.close()

    def _await(self, call: _Call, awaitable: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
        call.task = self._loop.create_task(_coroutine(awaitable))
        return self._loop.run_until_complete(call.task)


async def _coroutine(awaitable: Any) -> Any:
    return await awaitable
