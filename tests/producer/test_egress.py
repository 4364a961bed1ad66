"""The SSRF guard: which webhook URLs and addresses are refused, what --webhook-allow lets
through, and that a connection goes only to an address checked at that moment."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from producer.egress import CheckedBackend, EgressPolicy, GuardedTransport, Refused, checked_url
from tests.receiver import receiver


def answers(*addresses: str) -> list[tuple[Any, ...]]:
    """``getaddrinfo``-style answers naming ``addresses``."""
    return [
        (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 80))
        for a in addresses
    ]


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.1", "private"),
        ("172.16.5.5", "private"),
        ("169.254.169.254", "link-local"),  # the cloud metadata service
        ("fe80::1", "link-local"),
        ("::ffff:127.0.0.1", "loopback"),
        ("100.64.0.1", "non-public"),  # carrier-grade NAT
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
    ],
)
def test_addresses_that_are_not_public_are_refused_by_default(address, why):
    refusal = EgressPolicy().refusal(address, ipaddress.ip_address(address))
    assert refusal is not None and why in refusal and "--webhook-allow" in refusal


def test_public_addresses_pass_and_the_allow_list_opens_hosts_and_networks():
    policy = EgressPolicy.of(["127.0.0.1", "10.0.0.0/8", "Hooks.Internal"])
    assert policy.refusal("93.184.215.14", ipaddress.ip_address("93.184.215.14")) is None
    assert policy.refusal("127.0.0.1", ipaddress.ip_address("127.0.0.1")) is None
    assert policy.refusal("10.9.9.9", ipaddress.ip_address("10.9.9.9")) is None
    assert policy.refusal("hooks.internal.", ipaddress.ip_address("192.168.1.1")) is None
    assert policy.refusal("127.0.0.2", ipaddress.ip_address("127.0.0.2")) is not None


def test_a_host_with_one_private_address_among_public_ones_is_refused():
    async def resolver(host: str, port: int) -> Sequence[tuple[Any, ...]]:
        return answers("93.184.215.14", "10.0.0.7")

    with pytest.raises(Refused, match=r"10\.0\.0\.7"):
        asyncio.run(EgressPolicy(resolver=resolver).resolve("mixed.example", 80))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://example.com/x", "http or https"),
        ("http:///path", "no host"),
        ("https://user:pw@example.com/", "credentials"),
        ("http://" + "a" * 3000 + ".com", "at most"),
        ("http://exa mple.com/", "not a valid URL"),
    ],
)
def test_malformed_webhook_urls_are_refused_with_the_reason(url, message):
    with pytest.raises(Refused, match=message):
        checked_url(url)


def test_a_connection_goes_only_to_the_address_checked_at_that_moment():
    """DNS rebinding: the name resolved to a public address when the job was submitted and to
    a loopback one now; the connection is refused, and nothing reaches the receiver."""
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> Sequence[tuple[Any, ...]]:
        calls.append(host)
        return answers("93.184.215.14") if len(calls) == 1 else answers("127.0.0.1")

    async def go(url: str) -> None:
        policy = EgressPolicy(resolver=rebinding)
        assert await policy.resolve("hooks.example", 80) == ["93.184.215.14"]  # submission
        transport = GuardedTransport(policy, httpx.Limits(max_connections=2))
        async with httpx.AsyncClient(transport=transport) as client:
            with pytest.raises(Refused, match="loopback"):
                await client.post(url.replace("127.0.0.1", "hooks.example"), content=b"{}")

    with receiver() as hooks:
        asyncio.run(go(hooks.url))
        assert hooks.received == []


def test_an_allowed_loopback_receiver_is_reached_through_the_checked_backend():
    async def go(url: str) -> int:
        transport = GuardedTransport(EgressPolicy.of(["127.0.0.1"]), httpx.Limits())
        async with httpx.AsyncClient(transport=transport) as client:
            return (await client.post(url, content=b"{}")).status_code

    with receiver() as hooks:
        assert asyncio.run(go(hooks.url)) == 200
        assert len(hooks.received) == 1


def test_unix_sockets_and_unresolvable_hosts_are_not_reached():
    async def nowhere(host: str, port: int) -> Sequence[tuple[Any, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def go() -> None:
        backend = CheckedBackend(EgressPolicy(resolver=nowhere))
        with pytest.raises(Refused):
            await backend.connect_unix_socket("/run/docker.sock")
        transport = GuardedTransport(EgressPolicy(resolver=nowhere), httpx.Limits())
        async with httpx.AsyncClient(transport=transport) as client:
            with pytest.raises(httpx.ConnectError, match="cannot resolve"):
                await client.post("http://nowhere.example/", content=b"{}")

    asyncio.run(go())
