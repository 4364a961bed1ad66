"""The addresses of a Redis host name, looked up for each new connection, the last answer kept.

A container network's DNS misses lookups for a moment: podman's aardvark-dns drops or refuses
the queries that arrive while it reloads, which it does each time a container joins or leaves
the network (containers/aardvark-dns#389), and glibc asks again only after its timeout (5 s by
default), past the 3 s connect timeout. So once a name has resolved in this process, a lookup
that fails, or has not answered within ``STALE_AFTER_S``, is answered with the addresses the name
had last ("serve stale", as RFC 8767 lets resolvers do). A name that never resolved is looked up
again until the caller's own timeout ends it: nothing was sent yet, so asking again is safe. A
stale address that no longer answers fails the connect as any address would.

The lean connection (``runtime.resp``) calls ``addresses`` itself; redis-py's pooled clients get
it through ``connection_class``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection

STALE_AFTER_S = 0.5
"""How long a lookup may take before the name's last addresses are used instead (a lookup on a
container network or a cluster's DNS takes milliseconds)."""

_PAUSE_S, _MAX_PAUSE_S = 0.05, 0.5

Address = tuple[int, Any]
"""``(family, sockaddr)``, as ``getaddrinfo`` gives them."""

_last: dict[tuple[str, int], list[Address]] = {}

_in_flight: dict[tuple[asyncio.AbstractEventLoop, str, int], asyncio.Future[Any]] = {}
"""The lookup of a name that a loop has asked and that has not answered yet: every connection
the loop opens meanwhile waits on it, not on a lookup of its own. A lookup runs in the loop's
default executor, and one that glibc leaves hanging keeps its thread until glibc's own timeout
(5 s) after the connection has given up on it; started once per connect, a few of them could
fill the executor and queue every later lookup behind them."""


def _lookup(loop: asyncio.AbstractEventLoop, host: str, port: int) -> asyncio.Future[Any]:
    key = (loop, host, port)
    lookup = _in_flight.get(key)
    if lookup is None:
        lookup = asyncio.ensure_future(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        _in_flight[key] = lookup

        def done(ended: asyncio.Future[Any]) -> None:
            _in_flight.pop(key, None)
            if not ended.cancelled():
                ended.exception()  # each waiter got it; nobody left to tell

        lookup.add_done_callback(done)
    return lookup


async def addresses(host: str, port: int, failures: list[socket.gaierror]) -> list[Address]:
    """The addresses to try, in order, for a TCP connection to ``host:port``: a fresh lookup's,
    else the name's last. Each failed lookup of a name with none is appended to ``failures``
    (for the caller's error message) and asked again after a pause, until the caller's timeout
    cancels the wait. Connections opened at once share one lookup (``_in_flight``); a caller
    that stops waiting leaves it running for the others."""
    loop = asyncio.get_running_loop()
    key = (host, port)
    pause_s = _PAUSE_S
    while True:
        lookup = asyncio.shield(_lookup(loop, host, port))
        try:
            if key in _last:
                found = await asyncio.wait_for(lookup, STALE_AFTER_S)
            else:
                found = await lookup
        except (socket.gaierror, TimeoutError) as err:
            if key in _last:
                return _last[key]
            assert isinstance(err, socket.gaierror)  # no timeout without a last answer
            failures.append(err)
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, _MAX_PAUSE_S)
            continue
        fresh: list[Address] = [(family, sockaddr) for family, _, _, _, sockaddr in found]
        if fresh:
            _last[key] = fresh
        return fresh


async def connect_first(
    host: str,
    port: int,
    failures: list[socket.gaierror],
    connect: Callable[[Any], Awaitable[None]],
) -> None:
    """``connect`` to the first of ``host``'s addresses (``addresses``) that takes the
    connection, each in turn as ``open_connection`` would; the last refusal is the error."""
    refused: OSError = OSError(f"{host} has no address")
    for _family, sockaddr in await addresses(host, port, failures):
        try:
            await connect(sockaddr)
            return
        except OSError as err:
            refused = err
    raise refused


class _LookedUp:
    """redis-py's TCP connections, their host looked up here (``addresses``) instead of by
    ``asyncio.open_connection``: the pooled clients (``Broker.commands``) meet a container
    network's reloads as the lean connection does. The connect timeout bounds the lookups too;
    each address is tried in turn, as ``open_connection`` would, a TLS one checked against the
    host's name."""

    host: str
    port: int
    socket_connect_timeout: float | None
    _address: str | None = None

    def _connection_arguments(self) -> Mapping[str, Any]:
        arguments = dict(super()._connection_arguments())  # type: ignore[misc]
        if self._address is not None:
            if "ssl" in arguments:
                arguments["server_hostname"] = self.host
            arguments["host"] = self._address
        return arguments

    async def _connect(self) -> None:
        failures: list[socket.gaierror] = []
        try:
            async with asyncio.timeout(self.socket_connect_timeout):
                await connect_first(self.host, self.port, failures, self._connect_to)
        except TimeoutError:
            if failures:
                raise failures[-1] from None
            raise

    async def _connect_to(self, sockaddr: Any) -> None:
        self._address = sockaddr[0]
        try:
            await super()._connect()  # type: ignore[misc]
        finally:
            self._address = None


class LookedUpConnection(_LookedUp, Connection):
    """``redis://`` (``_LookedUp``)."""


class LookedUpSSLConnection(_LookedUp, SSLConnection):
    """``rediss://`` (``_LookedUp``)."""


def connection_class(url: str) -> type[AbstractConnection] | None:
    """The connection class for a redis-py client of ``url``: ours for TCP and TLS, None (redis-py
    picks) for a Unix socket."""
    scheme = url.partition("://")[0].lower()
    return {"redis": LookedUpConnection, "rediss": LookedUpSSLConnection}.get(scheme)
