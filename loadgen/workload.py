"""Turning a URL plus request description(s) into wire bytes, shared by the load modes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loadgen.http import PreparedRequest, Target, parse_url

__all__ = ["EncodedRequest", "encode_workload"]

#: (wire bytes, is a HEAD request) — what a load loop writes, prepared once.
EncodedRequest = tuple[bytes, bool]


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
