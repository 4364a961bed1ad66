"""One record per request the gateway waits on, and the registry of them by request id.

A ``Waiter`` owns its future, deadline timer, place in Redis, watcher and per-model count. It
is registered before its request is queued (an instant reply finds it) and settled once, through
its methods, by whoever ends it: the reply, the deadline, the loss sweep, the caller going away,
shutdown. Settling releases it in one place (``_release``). Per request: the record, its future,
one timer at a time, and a watcher task only past ``WATCH_AFTER_S``. Why: ARCHITECTURE.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import structlog

from protocol.cancellation import CHECK_AFTER_MS
from protocol.messages import InferResult

log = structlog.get_logger("inferq.gateway")

WATCH_AFTER_S = CHECK_AFTER_MS / 1000
"""Callers are watched once their request has waited as long as workers wait before they look
for cancellations: a request answered sooner costs neither a watcher task nor a lookup."""


class Waiter:
    """A request this gateway has registered, and (once queued) where it sits in Redis."""

    __slots__ = (
        "_timer",
        "_waiters",
        "_watcher",
        "deadline_ms",
        "entry_id",
        "future",
        "id",
        "losses_seen",
        "model",
        "result_key",
        "stream",
        "suspect",
        "unconfirmed",
    )

    def __init__(self, waiters: Waiters, request_id: str, model: str, deadline_ms: int) -> None:
        self._waiters: Waiters | None = waiters
        """The registry while this waiter is in it; None once released."""
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.id = request_id
        self.model = model
        self.deadline_ms = deadline_ms
        """The request's deadline on the Redis clock (what its cancellation mark keeps)."""
        self.future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        self.stream = ""
        self.entry_id = ""
        self.result_key = ""
        self.suspect = False
        """Gone from its stream without a result at the last loss sweep (``producer.losses``)."""
        self.unconfirmed = False
        """Its ``XADD`` got no reply: it may or may not be queued (``unconfirmed_in``)."""
        self.losses_seen = 0
        """Losses of Redis's data the gateway had found when the unconfirmed ``XADD`` was sent."""

    @property
    def queued(self) -> bool:
        return bool(self.entry_id)

    def enqueued(self, stream: str, entry_id: str, result_key: str) -> None:
        """Where the request was queued: what the loss sweep checks."""
        self.stream, self.entry_id, self.result_key = stream, entry_id, result_key

    def unconfirmed_in(self, stream: str, result_key: str, losses_seen: int) -> None:
        """The request's ``XADD`` to ``stream``, sent when the gateway had found
        ``losses_seen`` losses of Redis's data (``ReplyListener.losses``), got no reply: no
        entry id to check, but once a later loss is found a sweep looks for its result, and
        fails it if there is none (``producer.losses``)."""
        self.stream, self.result_key, self.unconfirmed = stream, result_key, True
        self.losses_seen = losses_seen

    async def wait(
        self,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[None]] | None = None,
        abandon: Callable[[str], object] | None = None,
    ) -> InferResult:
        """The result, or TimeoutError after ``timeout_s``. With ``disconnected`` (returns once
        the caller has hung up) the caller is watched from ``WATCH_AFTER_S`` on, and
        ``abandon(request id)`` is called if it goes."""
        if self._waiters is None:  # answered (or failed) before its caller began to wait
            return await self.future
        loop = asyncio.get_running_loop()
        expires = loop.time() + max(0.0, timeout_s)
        if disconnected is not None and abandon is not None and timeout_s > WATCH_AFTER_S:
            watch = self._watch
            self._timer = loop.call_later(WATCH_AFTER_S, watch, expires, disconnected, abandon)
        else:
            self._timer = loop.call_at(expires, self._expire)
        return await self.future

    def resolve(self, result: InferResult) -> bool:
        """Answer it; False if it was settled already."""
        return self._settle(result, None)

    def fail(self, error: BaseException) -> bool:
        """Fail it with ``error``; False if it was settled already."""
        return self._settle(None, error)

    def close(self) -> None:
        """Let go of it, settled or not (its waiting coroutine is leaving)."""
        if self._waiters is not None:
            self._release()

    def _settle(self, result: InferResult | None, error: BaseException | None) -> bool:
        if self._waiters is None:
            return False
        self._release()
        if not self.future.done():  # a cancelled caller cancelled it
            if error is None:
                self.future.set_result(result)  # type: ignore[arg-type]
            else:
                self.future.set_exception(error)
        return True

    def _expire(self) -> None:
        self.fail(TimeoutError())

    def _watch(
        self,
        expires: float,
        disconnected: Callable[[], Awaitable[None]],
        abandon: Callable[[str], object],
    ) -> None:
        """``WATCH_AFTER_S`` has passed: arm the deadline, and watch the caller."""
        self._timer = asyncio.get_running_loop().call_at(expires, self._expire)
        self._watcher = asyncio.create_task(self._watch_caller(disconnected, abandon))

    async def _watch_caller(
        self, disconnected: Callable[[], Awaitable[None]], abandon: Callable[[str], object]
    ) -> None:
        try:
            await disconnected()
        except Exception as e:  # a transport that cannot tell: keep waiting
            log.debug("cannot watch for the caller going away", error=str(e))
            return
        self._watcher = None  # this task ends here: settling need not cancel it
        abandon(self.id)

    def _release(self) -> None:
        waiters, self._waiters = self._waiters, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if waiters is not None:
            waiters._remove(self)


class Waiters:
    """The waiters of one gateway by request id, with a count per model (admission reads it)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Waiter] = {}
        self._per_model: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(list(self._by_id.values()))

    def expect(self, request_id: str, model: str, deadline_ms: int) -> Waiter:
        """Register a request before it is queued."""
        waiter = self._by_id[request_id] = Waiter(self, request_id, model, deadline_ms)
        self._per_model[model] = self._per_model.get(model, 0) + 1
        return waiter

    def get(self, request_id: str) -> Waiter | None:
        return self._by_id.get(request_id)

    def count(self, model: str) -> int:
        """Requests for ``model`` this gateway waits on."""
        return self._per_model.get(model, 0)

    def fail_all(self, error: BaseException) -> None:
        for waiter in list(self._by_id.values()):
            waiter.fail(error)

    def _remove(self, waiter: Waiter) -> None:
        del self._by_id[waiter.id]
        left = self._per_model[waiter.model] - 1
        if left:
            self._per_model[waiter.model] = left
        else:
            del self._per_model[waiter.model]
