"""Closed-loop traffic for chaos scenarios: request ids ``0..n-1`` over a few connections, every
answer recorded in a ``Tally`` (see ``accounting.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from loadgen.http import HTTPClientError, HTTPConnection, Response
from tests.chaos.accounting import Tally, request_body

CLIENT_TIMEOUT_S = 60.0
"""Longer than any deadline a scenario sets: a request still unanswered then is lost."""


def _body(response: Response) -> dict[str, Any] | None:
    """The decoded JSON body (a V2 answer or an error), None if it is not JSON."""
    try:
        doc = response.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


async def send(
    url: str,
    model: str,
    n: int,
    concurrency: int,
    tally: Tally,
    *,
    on_progress: Callable[[Tally], None] | None = None,
    retry_503_s: float = 0.0,
    first: int = 0,
    **parameters: object,
) -> int:
    """Send requests ``first..first+n-1`` to ``model``'s ``/infer`` over ``concurrency``
    keep-alive connections. A client that retries a 503 for ``retry_503_s`` (as a well-behaved
    one does while Redis is down) sends the same id again; its last answer counts.

    Returns how often a connection was reopened: the client reopens a connection the server
    closed and resends, once, a request that got no byte of an answer (a gateway killed with
    the request in flight), as HTTP clients do."""
    host, port = url.removeprefix("http://").split(":")
    ids = iter(range(first, first + n))
    path = f"/v2/models/{model}/infer"
    headers = {"content-type": "application/json"}

    async def lane() -> int:
        conn = HTTPConnection(host, int(port), timeout=CLIENT_TIMEOUT_S)
        try:
            for i in ids:
                give_up = time.monotonic() + retry_503_s
                while True:
                    tally.send(i)
                    try:
                        r = await conn.request("POST", path, request_body(i, **parameters), headers)
                    except HTTPClientError:
                        # Reconnects on the next request; this one got no answer.
                        tally.no_answer(i)
                        break
                    if r.status == 503 and time.monotonic() < give_up:
                        await asyncio.sleep(0.1)
                        continue
                    tally.answer(i, r.status, _body(r))
                    break
                if on_progress is not None:
                    on_progress(tally)
        finally:
            await conn.aclose()
        return max(0, conn.connects - 1)

    return sum(await asyncio.gather(*(lane() for _ in range(concurrency))))
