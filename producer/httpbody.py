"""What the HTTP routes read from a request: the body (limited, held, timed, decompressed),
its content type and the V2 binary header length, and the caller's cache and trace headers.

The infer fast path (``producer.fastpath``) and the Starlette routes (``producer.app``: job
submission, model control) read bodies through these same functions, from the ASGI ``receive``.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope

from producer.errors import (
    BadRequest,
    ClientClosedRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from producer.inflight import BodyHold
from producer.traceparent import traceparent
from runtime.tracing import REQUEST_TRACE

if TYPE_CHECKING:
    from producer.settings import GatewaySettings

BODY_RECEIVED = "inferq.body_received"
"""Set (True) in a request's ASGI scope by the gateway's HTTP protocol (``producer.server``)
when the whole body had arrived before the app began reading it: ``receive`` then returns it
without waiting, so no ``--body-timeout-s`` timer is armed for it (``body_received``)."""

JSON_TYPES = ("application/json",)
BINARY_TYPES = ("application/octet-stream",)


def caller_traceparent(headers: Mapping[str, str]) -> str:
    """The caller's W3C trace context, or a new one, so logs on every hop join up. Traced,
    it is the request's server span (a child of the caller's)."""
    traced = REQUEST_TRACE.get().traceparent
    if traced is not None:
        return traced
    return traceparent(headers.get("traceparent"))


def digits(raw: str | None) -> int | None:
    """A header's non-negative integer value; None unless it is plain ASCII digits. Over 18
    digits (more than any body) reads as the largest int64, never as a 4,300-digit int()."""
    if raw is None:
        return None
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()):
        return None
    return int(raw) if len(raw) <= 18 else 2**63 - 1


def header_length(headers: Mapping[str, str]) -> int | None:
    """The JSON part's length of a binary-tensor body, None for a plain JSON body; 400/415 for
    a content type or length the V2 protocol does not allow. Read before the body, so a bad
    Content-Type is refused at once."""
    raw = headers.get("inference-header-content-length")
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if raw is None:
        if content_type in BINARY_TYPES:
            raise BadRequest(
                "binary request bodies need an Inference-Header-Content-Length header "
                "giving the length of the JSON part"
            )
        if content_type and content_type not in JSON_TYPES:
            raise UnsupportedMediaType(
                f"Content-Type '{content_type}' is not supported: send JSON with "
                "'Content-Type: application/json', or the binary tensor extension with "
                "'Content-Type: application/octet-stream' and Inference-Header-Content-Length"
            )
        return None
    if content_type and content_type not in (*BINARY_TYPES, *JSON_TYPES):
        raise UnsupportedMediaType(
            f"Content-Type '{content_type}' is not supported with the binary tensor extension; "
            "use application/octet-stream"
        )
    length = digits(raw)
    if length is None:
        raise BadRequest("Inference-Header-Content-Length must be a non-negative integer")
    return length


def header_bytes(scope: Scope) -> int:
    """About what a request's line and headers took on the wire (what the parser keeps of
    them): what a request's hold counts for them while it is answered."""
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
    return size


def request_headers(scope: Scope) -> dict[str, str]:
    """The request's headers by (ASGI's lower-case) name, the first of a repeated one, as
    Starlette's ``Headers.get`` reads them: one pass over the scope, then dict lookups. The
    infer path reads six headers a request, and ``Headers.get`` scans the list for each
    (1.5 to 3.5 % of a gateway's CPU at c=128, BENCHMARKS.md, issue #27)."""
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return headers


def body_received(scope: Scope) -> bool:
    """Whether the request's whole body is already in the server's buffer (``BODY_RECEIVED``)."""
    return scope.get(BODY_RECEIVED, False) is True


def no_cache(headers: Mapping[str, str]) -> bool:
    """``Cache-Control: no-cache`` (or ``no-store``): the caller wants a fresh answer."""
    directives = headers.get("cache-control", "").lower()
    return "no-cache" in directives or "no-store" in directives


async def body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The request body as it arrives (what Starlette's ``Request.stream`` does); 499 when the
    client hangs up before it has sent it all."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientClosedRequest("the client went away while sending its request")
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def read_inference_body(
    headers: Mapping[str, str],
    receive: Receive,
    hold: BodyHold,
    settings: GatewaySettings,
    *,
    received: bool = False,
) -> tuple[bytes, int | None]:
    """A V2 inference body (infer, job submission) and its binary header length, held against
    ``--max-inflight-bytes`` as it arrives. The content type is checked first: 415 at once.
    ``received`` (``body_received``): the whole body has arrived, so ``receive`` cannot wait
    and ``--body-timeout-s`` needs no timer."""
    length = header_length(headers)
    raw = await read_body(
        headers,
        body_chunks(receive),
        settings.max_body_bytes,
        hold=hold,
        timeout_s=None if received else settings.body_timeout_s,
    )
    return raw, length


async def read_body(
    headers: Mapping[str, str],
    chunks: AsyncIterator[bytes],
    limit: int,
    *,
    hold: BodyHold | None = None,
    timeout_s: float | None = None,
) -> bytes:
    """The whole body, decompressed: 413 past ``limit``; with a ``hold``, its bytes are held
    against the gateway's in-flight cap as they arrive (429 before reading the rest); 408 when
    it has not arrived within ``timeout_s``."""
    declared = digits(headers.get("content-length"))
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"request body of {declared} bytes exceeds the limit of {limit} bytes"
        )
    if hold is not None and declared is not None:
        hold.grow_to(declared)
    parts: list[bytes] = []
    if timeout_s is None:
        # No Timeout at all: entering one (or a null context) costs µs a request, unarmed too.
        await _gather(chunks, limit, hold, parts)
    else:
        try:
            async with asyncio.timeout(timeout_s):
                await _gather(chunks, limit, hold, parts)
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {timeout_s:g} s "
                f"(received {sum(map(len, parts))} bytes)"
            ) from None
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    return _inflate(body, encoding, limit, hold)


async def _gather(
    chunks: AsyncIterator[bytes], limit: int, hold: BodyHold | None, parts: list[bytes]
) -> None:
    """Append the body's chunks to ``parts`` as they arrive (so a timeout can tell how much
    came): 413 past ``limit``; with a ``hold``, each chunk is held first (429)."""
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if hold is not None:
            hold.grow_to(size)
        parts.append(chunk)


def _inflate(body: bytes, encoding: str, limit: int, hold: BodyHold | None) -> bytes:
    """The decompressed body: 413 past ``limit``; 400 unless it is whole, complete streams (a
    gzip body may hold several members, RFC 1952) with nothing after them: a truncated body or
    trailing bytes are a client's bug, not a request to guess at."""
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedMediaType(
            f"Content-Encoding '{encoding}' is not supported (use gzip, deflate or none)"
        )
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    parts: list[bytes] = []
    size = 0
    rest = body
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            part = inflater.decompress(rest, limit - size + 1)
        except zlib.error as e:
            raise BadRequest(f"request body is not valid {encoding} data: {e}") from None
        size += len(part)
        if size > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(f"decompressed request body exceeds the limit of {limit} bytes")
        parts.append(part)
        if not inflater.eof:
            raise BadRequest(
                f"request body is truncated {encoding} data: the compressed stream ends before "
                "its end marker"
            )
        rest = inflater.unused_data
        if not rest:
            break
        if encoding != "gzip" or not rest.startswith(b"\x1f\x8b"):
            raise BadRequest(
                f"request body has {len(rest)} bytes after the end of its {encoding} data"
            )
    plain = parts[0] if len(parts) == 1 else b"".join(parts)
    if hold is not None:
        hold.grow_to(len(plain))
    return plain
