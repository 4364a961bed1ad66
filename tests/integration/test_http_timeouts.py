"""Idle and trickling connections are closed: a client cannot hold the gateway's sockets open."""

from __future__ import annotations

import json
import time

import pytest

from tests.support import SOCKET_TIMEOUT_S, connect, read_until_closed, sim_body


@pytest.mark.serial  # sends within a 0.5 s header timeout
def test_a_connection_that_never_sends_its_headers_is_closed(stack):
    s = stack(models=("sim",), header_timeout_s=0.5)
    with connect(s.gateway.settings.port) as idle, connect(s.gateway.settings.port) as slow:
        slow.sendall(b"POST /v2/models/sim/infer HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        for _ in range(3):  # a header line now and then (slowloris) does not keep it open
            slow.sendall(b"x-filler: 1\r\n")
            time.sleep(0.2)
        answer = read_until_closed(slow)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert read_until_closed(idle).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < SOCKET_TIMEOUT_S


def test_a_body_that_trickles_in_gets_408(stack):
    s = stack(models=("sim",), body_timeout_s=0.5)
    body = json.dumps(sim_body(1)).encode()
    with connect(s.gateway.settings.port) as sock:
        sock.sendall(
            b"POST /v2/models/sim/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        answer = read_until_closed(sock)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert "0.5 s" in json.loads(payload)["error"]


def test_a_complete_request_is_answered_within_the_timeouts(stack):
    s = stack(models=("sim",), header_timeout_s=0.5, body_timeout_s=0.5)
    with s.client() as c:
        for i in range(3):  # on one keep-alive connection, with pauses between requests
            r = c.post("/v2/models/sim/infer", json=sim_body(i))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [4.0 * i]
            time.sleep(0.6)
