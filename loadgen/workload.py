"""Turning a URL plus request description(s) into wire bytes, and what one unit of work is.

Load loops send *operations*: an :data:`Operation` performs unit of work number ``k`` on a
connection and returns the HTTP status that counts for it.  The default one
(:func:`send_operation`) writes prepared request ``k mod n`` and returns its response's status;
the jobs mode (:mod:`loadgen.jobs`) submits and then polls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from loadgen.http import HTTPConnection, PreparedRequest, Target, parse_url

__all__ = [
    "EncodedRequest",
    "Operation",
    "OperationFactory",
    "encode_workload",
    "send_operation",
]

#: (wire bytes, is a HEAD request) — what a load loop writes, prepared once.
EncodedRequest = tuple[bytes, bool]

#: ``await op(conn, k, budget_s)``: perform unit of work ``k`` on ``conn`` within ``budget_s``
#: (``None``: unbounded); return the HTTP status it counts as; raise an exception (recorded by
#: class name) when there is no status to count.
Operation = Callable[[HTTPConnection, int, "float | None"], Awaitable[int]]

#: Builds the operation of a run from the resolved target and the encoded requests.
OperationFactory = Callable[[Target, Sequence[EncodedRequest]], Operation]


def encode_workload(
    url: str,
    requests: Sequence[PreparedRequest] | PreparedRequest | None = None,
    *,
    method: str = "POST",
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
) -> tuple[Target, list[EncodedRequest]]:
    """Resolve ``url`` (``http://`` only) and encode the requests to send.

    With ``requests`` None, the workload is one ``method`` request to the URL's own path with
    ``body``/``headers``; otherwise ``requests`` (paths relative to the URL's server) are used
    and ``method``/``body``/``headers`` must be left at their defaults.
    """
    target = parse_url(url)
    if requests is None:
        reqs: list[PreparedRequest] = [
            PreparedRequest(method, target.path, bytes(body), dict(headers or {}))
        ]
    else:
        if body or headers:
            raise ValueError("give either requests=... or body/headers, not both")
        reqs = [requests] if isinstance(requests, PreparedRequest) else list(requests)
        if not reqs:
            raise ValueError("requests is empty")
    return target, [(r.encode(target.host_header), r.is_head) for r in reqs]


def send_operation(target: Target, requests: Sequence[EncodedRequest]) -> Operation:
    """Unit of work ``k``: send request ``k mod n``; it counts as its response's status."""
    reqs = list(requests)
    n = len(reqs)

    async def op(conn: HTTPConnection, k: int, budget_s: float | None) -> int:
        raw, head = reqs[k % n]
        return (await conn.send(raw, head=head, timeout=budget_s)).status

    return op
