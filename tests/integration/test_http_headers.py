"""Request headers are bounded (431 past 16 KiB, whatever the parser) and held against
``--max-inflight-bytes`` while they arrive: big headers cannot grow a gateway's memory."""

from __future__ import annotations

import json

import httpx

from bench.header_flood import REQUEST_LINE, flood, header_lines, rss_bytes
from producer.server import MAX_HEADER_BYTES
from tests.support import (
    connect,
    free_port,
    gateway_process,
    read_until_closed,
    sim_body,
    wait_until,
)


def answer(raw: bytes) -> tuple[int, dict[str, str], str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers, json.loads(body)["error"]


def test_a_header_block_past_16_kib_gets_431_and_the_connection_is_closed(stack):
    s = stack(models=("sim",))
    with connect(s.gateway.settings.port) as sock:
        sock.sendall(REQUEST_LINE + header_lines(MAX_HEADER_BYTES + 4096))
        status, headers, error = answer(read_until_closed(sock))
    assert status == 431 and headers["connection"] == "close"
    assert f"{MAX_HEADER_BYTES} bytes" in error
    assert s.gateway.gateway.inflight.held == 0


def test_a_long_url_counts_toward_the_bound(stack):
    s = stack(models=("sim",))
    with connect(s.gateway.settings.port) as sock:
        sock.sendall(b"GET /v2/health/live?" + b"q" * (MAX_HEADER_BYTES + 10))
        status, _, _ = answer(read_until_closed(sock))
    assert status == 431


def test_headers_within_the_bound_are_served_on_a_kept_alive_connection(stack):
    s = stack(models=("sim",))
    s.wait_ready("sim")
    with s.client() as c:
        for i in range(3):  # the count starts again for each request of the connection
            big = {"x-filler": "a" * (MAX_HEADER_BYTES - 2048)}
            r = c.post("/v2/models/sim/infer", json=sim_body(i), headers=big)
            assert r.status_code == 200, r.text
    assert s.gateway.gateway.inflight.held == 0


def test_headers_being_received_are_held_against_the_inflight_budget(stack):
    part = 12_000
    s = stack(models=("sim",), max_inflight_bytes=3 * part + 4000)
    s.wait_ready("sim")
    inflight = s.gateway.gateway.inflight
    port = s.gateway.settings.port
    held = [connect(port) for _ in range(3)]
    try:
        for sock in held:
            sock.sendall(REQUEST_LINE + header_lines(part - len(REQUEST_LINE)))
        wait_until(lambda: inflight.held == 3 * part, what="the three header blocks held")
        with connect(port) as fourth:
            fourth.sendall(REQUEST_LINE + header_lines(part - len(REQUEST_LINE)))
            status, headers, error = answer(read_until_closed(fourth))
        assert status == 429 and "retry-after" in headers
        assert "in flight" in error
        assert inflight.held == 3 * part
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: inflight.held == 0, what="the holds given back when the clients left")
    # A request's own hold counts its headers: a body that fits alone, sent with 14 KiB of
    # headers, passes the budget and is refused.
    body = json.dumps(sim_body(1)).encode() + b" " * 28_000
    big = {"content-type": "application/json", "x-filler": "a" * (MAX_HEADER_BYTES - 2048)}
    with s.client() as c:
        assert c.post("/v2/models/sim/infer", content=body).status_code == 200
        r = c.post("/v2/models/sim/infer", content=body, headers=big)
    assert r.status_code == 413 and "--max-inflight-bytes" in r.json()["error"], r.text
    assert inflight.held == 0


def test_64_clients_sending_huge_headers_do_not_grow_a_real_gateway(redis_url, namespace):
    """The red team's case, scaled to a test: 64 connections, each sending a 4 MiB header
    (the body held back). Unbounded, a gateway keeps 256 MiB of them; bounded, it closes each
    after 16 KiB and its memory stays about where it was."""
    port = free_port()
    proc = gateway_process(redis_url, namespace, port)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:

            def live() -> bool:
                try:
                    return c.get("/v2/health/live").status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(live, timeout_s=30, what="the gateway to answer")
        before = rss_bytes(proc.pid)
        answers = flood(port, 64, 4 * 1024 * 1024)
        grown = rss_bytes(proc.pid) - before
        assert None not in answers, "the gateway took a 4 MiB header without refusing it"
        statuses = [a[:12] for a in answers if a]
        assert all(s == b"HTTP/1.1 431" for s in statuses), statuses
        assert statuses, "no client read its 431 (all were reset)"
        assert grown < 32 * 1024 * 1024, f"the gateway grew by {grown / 2**20:.0f} MiB"
    finally:
        proc.terminate()
        proc.wait(timeout=15)
