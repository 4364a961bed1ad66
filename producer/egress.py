"""Where the gateway may send webhooks: the guard against server-side request forgery.

A webhook URL comes from a client, and the gateway calls it from inside the deployment, so a URL
naming ``localhost``, a metadata service (169.254.169.254) or a private address would let any
client reach what only the gateway can. ``EgressPolicy`` refuses every address that is not
globally routable (loopback, link-local, private, shared, reserved, multicast) unless
``--webhook-allow`` names its host or a network that holds it. The check runs twice: when the
job is submitted (a clear 400), and at every connection, where ``GuardedTransport`` resolves the
host, checks every address it got and connects to a checked one, so a name that resolves to a
public address at the check and to a private one at the connection (DNS rebinding) gets nowhere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from producer.settings import HOSTNAME

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[Sequence[tuple[Any, ...]]]]

MAX_URL_LENGTH = 2048


class Refused(Exception):
    """A webhook URL, or an address its host resolved to, that the guard does not allow."""


def checked_url(url: str) -> httpx.URL:
    """``url`` parsed, if a webhook may have it: http or https, a host, no credentials."""
    if len(url) > MAX_URL_LENGTH:
        raise Refused(f"a webhook URL may have at most {MAX_URL_LENGTH} characters")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise Refused(f"the webhook URL is not a valid URL ({e})") from None
    if parsed.scheme not in ("http", "https"):
        raise Refused(f"a webhook URL must be http or https, got {url!r}")
    if not parsed.host:
        raise Refused(f"the webhook URL {url!r} names no host")
    host = parsed.raw_host.decode("ascii", errors="replace")
    if not HOSTNAME.match(host) and not _is_address(host):
        raise Refused(f"the webhook URL is not a valid URL (its host {parsed.host!r})")
    if parsed.userinfo:
        raise Refused("a webhook URL may not carry credentials (deliveries are signed instead)")
    return parsed


async def _system_resolver(host: str, port: int) -> Sequence[tuple[Any, ...]]:
    loop = asyncio.get_running_loop()
    return await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _why_refused(address: Address) -> str | None:
    mapped = getattr(address, "ipv4_mapped", None)
    address = mapped or address
    for why, hit in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("private", address.is_private),
        ("multicast", address.is_multicast),
    ):
        if hit:
            return why
    return None if address.is_global else "non-public"


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    """What ``--webhook-allow`` lets through beside the public internet."""

    hosts: frozenset[str] = frozenset()
    """Host names allowed whatever they resolve to (exact, lower case)."""
    networks: tuple[Network, ...] = ()
    resolver: Resolver | None = None
    """Host and port to ``getaddrinfo``-style answers; None: the event loop's resolver."""

    @classmethod
    def of(cls, allow: Iterable[str], resolver: Resolver | None = None) -> EgressPolicy:
        hosts: set[str] = set()
        networks: list[Network] = []
        for entry in allow:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks), resolver)

    def refusal(self, host: str, address: Address) -> str | None:
        """Why ``address`` (which ``host`` resolved to) is refused; None if it is allowed."""
        if host.lower().rstrip(".") in self.hosts:
            return None
        if any(address in network for network in self.networks):
            return None
        why = _why_refused(address)
        if why is None:
            return None
        shown = str(address) if str(address) == host else f"{host} ({address})"
        return (
            f"the webhook host {shown} is a {why} address, which webhooks may not reach (SSRF "
            "guard); an operator allows it with --webhook-allow"
        )

    async def resolve(self, host: str, port: int, timeout_s: float | None = None) -> list[str]:
        """The addresses of ``host``, every one checked (``Refused`` if any is refused: a name
        with one private address among public ones is refused). ``OSError`` when it does not
        resolve."""
        resolver = self.resolver or _system_resolver
        async with asyncio.timeout(timeout_s):
            infos = await resolver(host, port)
        addresses: list[str] = []
        for *_, sockaddr in infos:
            raw = str(sockaddr[0]).split("%", 1)[0]  # an IPv6 scope id
            why = self.refusal(host, ipaddress.ip_address(raw))
            if why is not None:
                raise Refused(why)
            if raw not in addresses:
                addresses.append(raw)
        if not addresses:
            raise OSError(f"{host} resolves to no address")
        return addresses


class CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses the policy checked (the
    connection's TLS still verifies the host name of the URL)."""

    def __init__(self, policy: EgressPolicy) -> None:
        self._policy = policy
        self._network = httpcore.AnyIOBackend()

    # The parameter names are httpcore's interface (``timeout`` included).
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self._policy.resolve(host, port, timeout)
        except (OSError, TimeoutError) as e:
            raise httpcore.ConnectError(f"cannot resolve {host}: {e}") from e
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._network.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                error = e
        assert error is not None
        raise error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise Refused("webhooks do not go to Unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self._network.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over ``CheckedBackend``, with no proxy (the environment's proxies would
    connect where the guard never looked).

    httpx takes no network backend, so this replaces the connection pool its constructor built
    (``_pool``, which ``handle_async_request`` uses) with the same pool over the checked backend;
    the check below fails loudly if a new httpx builds it differently."""

    def __init__(self, policy: EgressPolicy, limits: httpx.Limits) -> None:
        super().__init__(limits=limits, trust_env=False)
        if not isinstance(self._pool, httpcore.AsyncConnectionPool):
            raise RuntimeError("httpx's transport no longer holds an httpcore connection pool")
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=CheckedBackend(policy),
        )
