"""Admission by memory: a cap on the bytes of request bodies one gateway holds at once.

Counting requests alone lets eight 64 MiB bodies take a gateway past a gigabyte (and Redis with
it, once they are queued). Every request therefore holds its body's bytes from the moment its
size is known (``Content-Length``, or the bytes read so far) until its answer is sent: a body
that would take the gateway past ``--max-inflight-bytes`` is refused with 429 before the rest of
it is read, and one larger than the whole cap, which could never be admitted, with 413.
Transports take a hold with ``InferenceService.hold_body`` and keep it for the request's life.
"""

from __future__ import annotations

from types import TracebackType

from producer.errors import PayloadTooLarge, TooManyRequests

RETRY_AFTER_S = 1.0
"""Bodies held are answered within their deadlines; a second is the typical turnover."""


class InflightBytes:
    """The bytes held by every request of one gateway, against a cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def hold(self) -> BodyHold:
        return BodyHold(self)

    def take(self, extra: int, total: int) -> None:
        if total > self.limit:
            raise PayloadTooLarge(
                f"a request body of {total} bytes is larger than this gateway admits at once "
                f"({self.limit} bytes, --max-inflight-bytes)"
            )
        if self.held + extra > self.limit:
            raise TooManyRequests(
                f"the gateway holds {self.held} bytes of requests, and this one's {total} bytes "
                f"would pass its limit of {self.limit} bytes in flight; retry shortly",
                retry_after_s=RETRY_AFTER_S,
            )
        self.held += extra


class BodyHold:
    """What one request holds; it grows as the body arrives and is given back once."""

    def __init__(self, budget: InflightBytes) -> None:
        self._budget = budget
        self.size = 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all, or raise (429, 413) without holding more."""
        if size > self.size:
            self._budget.take(size - self.size, size)
            self.size = size

    def release(self) -> None:
        self._budget.held -= self.size
        self.size = 0

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
