"""The HTTP server around the gateway's app: uvicorn, with limits on slow and idle clients.

uvicorn closes a keep-alive connection idle between requests (``timeout_keep_alive``), but
nothing bounds how long a client may take to send a request's headers: a connection that opens
and sends nothing, or trickles a header line now and then (slowloris), holds a socket and a
protocol object for ever. ``HeaderDeadline`` gives each request ``--header-timeout-s`` from its
connection opening, or from the first byte of a following request, to complete its headers,
then answers 408 and closes. Bodies are bounded by the app itself (``--body-timeout-s``, see
``producer.app``); a request whose body has all arrived by the time the parser has seen it is
marked in its scope (``producer.httpbody.BODY_RECEIVED``), and the infer path arms no body
timer for it: its ``receive`` cannot wait.

Nor does httptools (uvicorn's parser whenever it is installed, as it is here) bound a request's
header block: it hands each header to uvicorn, which keeps them all, so 64 connections sending a
32 MiB header each and holding back the body took a gateway past 2 GB (issue #21). h11's
``max_incomplete_event_size`` bounds only h11. ``HeaderDeadline`` therefore counts the bytes of
each request's line and headers itself, before the parser sees them, whichever parser it is:
past ``MAX_HEADER_BYTES`` it answers 431 and closes. While they arrive, those bytes are held
against ``--max-inflight-bytes`` (``producer.inflight``; 429 when the gateway holds too much),
and once the headers are complete the request's own hold counts them until its answer
(``producer.httpbody.header_bytes``): the memory a gateway gives unfinished requests is bounded
by one number.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from producer.errors import GatewayError, PayloadTooLarge, TooManyRequests, http_form
from producer.httpbody import BODY_RECEIVED
from producer.inflight import BodyHold, InflightBytes
from producer.settings import GatewaySettings

KEEP_ALIVE_S = 5
"""Seconds an idle keep-alive connection stays open (uvicorn's default, stated)."""
MAX_HEADER_BYTES = 16 * 1024
"""The most bytes a request's line and header block may have (h11's default, for every
parser): 431 beyond."""
GRACEFUL_SHUTDOWN_S = 10

_REASONS = {
    408: b"Request Timeout",
    413: b"Content Too Large",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
}
LINGER_S = 2.0
LINGER_BYTES = 1024 * 1024
"""After a refusal the server makes itself (408, 413, 429, 431), it closes its side for writing
and reads on, discarding, for up to this long or this many bytes, before it closes: closing at
once with the client's bytes unread would reset the connection, and the client, still sending
its headers, would lose the answer (the lingering close of nginx and Apache)."""
_HEADER_END = (b"\n\r\n", b"\n\n")
"""What ends a header block (CRLF CRLF, or the bare LF LF parsers also take): any block ends
with one of these."""


def closing_response(status: int, error: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP response with a V2 error body, for a refusal the server makes before any
    request reaches the app; the connection is closed after it."""
    _, body, _ = http_form(GatewayError(error))
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS[status]), b"content-type: application/json"]
    head += [f"{k}: {v}".encode("latin-1") for k, v in (headers or {}).items()]
    head += [b"connection: close", b"content-length: %d" % len(body)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _timed_out_response(seconds: float) -> bytes:
    error = f"the request headers did not arrive within {seconds:g} s; the connection is closed"
    return closing_response(408, error)


def _too_large_response(limit: int) -> bytes:
    error = (
        f"the request line and headers exceed the limit of {limit} bytes; send large values "
        "in the body"
    )
    return closing_response(431, error)


HOLD_BODY_BYTES = 64 * 1024
"""Responses whose body is at most this size go out in one write with their headers; a larger
body is written after them as it is (joining would copy it)."""


class OneWrite:
    """A transport that sends each response's status line and headers together with its body.

    uvicorn writes a response's header block when the app starts the response and its body
    when the app sends it: two ``send()`` system calls, the first of them the gateway's largest
    single cost at concurrency 64 (BENCHMARKS.md, issue #14). This holds a header block until
    the next write (the body, in the same event-loop turn), or until the end of the turn, or a
    close, whichever comes first, so nothing is ever delayed past the current turn and the
    bytes keep their order."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) <= HOLD_BODY_BYTES:
                self._transport.write(held + data)
                return
            self._transport.write(held)
        elif data[:5] == b"HTTP/":
            self._held = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        self.flush()
        self._transport.writelines(lines)

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools, or h11 where httptools is missing) plus a deadline
    on each request's headers and a bound on their size, held against the in-flight budget
    while they arrive (see the module docstring). A new request's headers are complete when
    the protocol starts a new request cycle (``cycle``), the one attribute both
    implementations share."""

    header_timeout_s = 10.0
    max_header_bytes = MAX_HEADER_BYTES
    inflight: InflightBytes | None = None
    """The gateway's in-flight budget; None holds nothing (a server without a gateway)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._cycle_at_arm: Any = None
        self._block_after: Any = None
        """The request cycle the header block being counted follows (None: the first)."""
        self._block_bytes = 0
        self._tail = b""
        self._block_hold = None if self.inflight is None else BodyHold(self.inflight)
        """What the header block being received holds of the in-flight budget."""
        self._lingering: asyncio.TimerHandle | None = None
        self._discarded = 0
        super().connection_made(OneWrite(transport))
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            self._discard(data)
            return
        self._note_cycle()
        cycle = self.cycle
        # Once a request's body is in, what follows is the next request's line and headers.
        if (cycle is None or not cycle.more_body) and not self._header_block_fits(data):
            return
        between_requests = cycle is None or cycle.response_complete
        super().data_received(data)
        self._note_cycle()
        cycle = self.cycle
        if cycle is not None and not cycle.more_body:
            # The request's body is all in (or it has none): the app reads it without waiting
            # and arms no body timer for it (``producer.httpbody.BODY_RECEIVED``).
            cycle.scope[BODY_RECEIVED] = True
        if self._header_timer is not None:
            if self.cycle is not self._cycle_at_arm:
                self._disarm()  # the headers are complete: a request cycle began
        elif between_requests and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of a following request, its headers still incomplete

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def _note_cycle(self) -> None:
        """A request cycle began (here, or from pipelined bytes after a response): the header
        block counted is complete, and the request's own hold counts it from now
        (``producer.httpbody.header_bytes``)."""
        if self.cycle is not self._block_after:
            self._block_after = self.cycle
            self._block_bytes, self._tail = 0, b""
            self._release()

    def _header_block_fits(self, data: bytes) -> bool:
        """Count ``data``, which continues a header block, against the size bound and the
        budget; False (and the refusal sent) when it passes either."""
        room = self.max_header_bytes - self._block_bytes
        if len(data) > room and not any(end in self._tail + data[:room] for end in _HEADER_END):
            self._refuse(_too_large_response(self.max_header_bytes))
            return False
        self._block_bytes += len(data)
        self._tail = (self._tail + data[-2:])[-2:]
        if self._block_hold is not None:
            try:
                self._block_hold.grow_to(min(self._block_bytes, self.max_header_bytes))
            except (TooManyRequests, PayloadTooLarge) as e:
                self._refuse(closing_response(e.status, e.message, e.headers()))
                return False
        return True

    def _release(self) -> None:
        if self._block_hold is not None:
            self._block_hold.release()

    def _refuse(self, response: bytes) -> None:
        """Answer ``response`` and end the connection (see ``LINGER_S``)."""
        self._disarm()
        self._release()
        if self.transport.is_closing():
            return
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def _discard(self, data: bytes) -> None:
        self._discarded += len(data)
        if self._discarded > LINGER_BYTES:
            self.transport.close()

    def _arm(self) -> None:
        self._cycle_at_arm = self.cycle
        self._header_timer = asyncio.get_running_loop().call_later(
            self.header_timeout_s, self._headers_timed_out
        )

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        self._refuse(_timed_out_response(self.header_timeout_s))


def server_config(app: Any, settings: GatewaySettings) -> uvicorn.Config:
    """The uvicorn configuration of one gateway process (the CLI and the tests use it); the
    header bytes being received are held against ``app.state.gateway``'s in-flight budget."""
    gateway = getattr(app.state, "gateway", None)
    protocol = type(
        "HeaderDeadline",
        (HeaderDeadline,),
        {
            "header_timeout_s": settings.header_timeout_s,
            "inflight": None if gateway is None else gateway.inflight,
        },
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,
        timeout_keep_alive=KEEP_ALIVE_S,
        # HeaderDeadline refuses a larger header block with 431 before h11 sees it; h11's
        # own bound (a 400) stays behind it, a read's worth above.
        h11_max_incomplete_event_size=MAX_HEADER_BYTES + 256 * 1024,
        log_level="warning",
        access_log=False,
        # The gateway never reads the client's address, so uvicorn's X-Forwarded-For rewriting
        # would be a middleware layer on every request for nothing.
        proxy_headers=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
