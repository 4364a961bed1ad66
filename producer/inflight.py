"""Admission by memory: a cap on the bytes of request bodies one gateway holds at once.

Counting requests alone lets eight 64 MiB bodies take a gateway past a gigabyte (and Redis with
it, once they are queued). Every request therefore holds its body's bytes from the moment its
size is known (``Content-Length``, or the bytes read so far) until its answer is sent: a body
that would take the gateway past ``--max-inflight-bytes`` is refused with 429 before the rest of
it is read, and one larger than the whole cap, which could never be admitted, with 413.
Transports take a hold with ``InferenceService.hold_body`` and keep it for the request's life.
A request's line and headers count too: the HTTP server holds them while they arrive
(``producer.server``), and the request's hold counts them from then on (``fixed``).
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

    def hold(self, fixed: int = 0) -> BodyHold:
        """A hold of ``fixed`` bytes at once (a request's headers) plus its body as it grows;
        raises (429, 413) without holding anything when even ``fixed`` does not fit."""
        hold = BodyHold(self, fixed)
        if fixed:
            hold.grow_to(0)
        return hold

    def take(self, extra: int, total: int) -> None:
        if total > self.limit:
            raise PayloadTooLarge(
                f"a request of {total} bytes (headers and body) is larger than this gateway "
                "admits at once "
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

    def __init__(self, budget: InflightBytes, fixed: int = 0) -> None:
        self._budget = budget
        self._fixed = fixed
        self.size = 0
        """The bytes held now: ``fixed`` plus the body's so far."""

    def grow_to(self, size: int) -> None:
        """Hold ``fixed`` plus ``size`` bytes in all, or raise (429, 413) without holding
        more."""
        size += self._fixed
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
