"""The HTTP server around the gateway's app: uvicorn, with limits on slow and idle clients.

uvicorn closes a keep-alive connection idle between requests (``timeout_keep_alive``), but
nothing bounds how long a client may take to send a request's headers: a connection that opens
and sends nothing, or trickles a header line now and then (slowloris), holds a socket and a
protocol object for ever. ``HeaderDeadline`` gives each request ``--header-timeout-s`` from its
connection opening, or from the first byte of a following request, to complete its headers,
then answers 408 and closes. Bodies are bounded by the app itself (``--body-timeout-s``, see
``producer.app``), and header sizes by the HTTP parser (``MAX_HEADER_BYTES`` for h11; httptools
has its own fixed limit).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from producer.settings import GatewaySettings

KEEP_ALIVE_S = 5
"""Seconds an idle keep-alive connection stays open (uvicorn's default, stated)."""
MAX_HEADER_BYTES = 16 * 1024
GRACEFUL_SHUTDOWN_S = 10

_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
)


def _timed_out_response(seconds: float) -> bytes:
    error = f"the request headers did not arrive within {seconds:g} s; the connection is closed"
    body = json.dumps({"error": error}).encode()
    return _TIMED_OUT + f"content-length: {len(body)}\r\n\r\n".encode() + body


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
    on each request's headers. A new request's headers are complete when the protocol starts
    a new request cycle (``cycle``), the one attribute both implementations share."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._cycle_at_arm: Any = None
        super().connection_made(OneWrite(transport))
        self._arm()

    def data_received(self, data: bytes) -> None:
        between_requests = self.cycle is None or self.cycle.response_complete
        super().data_received(data)
        if self._header_timer is not None:
            if self.cycle is not self._cycle_at_arm:
                self._disarm()  # the headers are complete: a request cycle began
        elif between_requests and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of a following request, its headers still incomplete

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        if not self.transport.is_closing():
            self.transport.write(_timed_out_response(self.header_timeout_s))
            self.transport.close()


def server_config(app: Any, settings: GatewaySettings) -> uvicorn.Config:
    """The uvicorn configuration of one gateway process (the CLI and the tests use it)."""
    protocol = type(
        "HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": settings.header_timeout_s}
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        log_level="warning",
        access_log=False,
        # The gateway never reads the client's address, so uvicorn's X-Forwarded-For rewriting
        # would be a middleware layer on every request for nothing.
        proxy_headers=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
