"""The addresses of a Redis host name, looked up for each new connection, the last answer kept.

A container network's DNS misses lookups for a moment: podman's aardvark-dns drops or refuses
the queries that arrive while it reloads, which it does each time a container joins or leaves
the network (containers/aardvark-dns#389), and glibc asks again only after its timeout (5 s by
default), past the 3 s connect timeout. So once a name has resolved in this process, a lookup
that fails, or has not answered within ``STALE_AFTER_S``, is answered with the addresses the name
had last ("serve stale", as RFC 8767 lets resolvers do). A name that never resolved is looked up
again until the caller's own timeout ends it: nothing was sent yet, so asking again is safe. A
stale address that no longer answers fails the connect as any address would.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

STALE_AFTER_S = 0.5
"""How long a lookup may take before the name's last addresses are used instead (a lookup on a
container network or a cluster's DNS takes milliseconds)."""

_PAUSE_S, _MAX_PAUSE_S = 0.05, 0.5

Address = tuple[int, Any]
"""``(family, sockaddr)``, as ``getaddrinfo`` gives them."""

_last: dict[tuple[str, int], list[Address]] = {}


async def addresses(host: str, port: int, failures: list[socket.gaierror]) -> list[Address]:
    """The addresses to try, in order, for a TCP connection to ``host:port``: a fresh lookup's,
    else the name's last. Each failed lookup of a name with none is appended to ``failures``
    (for the caller's error message) and asked again after a pause, until the caller's timeout
    cancels the wait."""
    loop = asyncio.get_running_loop()
    key = (host, port)
    pause_s = _PAUSE_S
    while True:
        lookup = loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
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
